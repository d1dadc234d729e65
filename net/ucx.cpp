#include "ucx.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <unistd.h>
#include <netdb.h>
#include <poll.h>

#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#include "tensorbucket/error.hpp"

namespace tensorbucket::net::detail {

void fail_ucx(std::string_view what, ucs_status_t status) {
  throw Error(ErrorCode::NetworkError, std::string(what) + ": " + ucs_status_string(status));
}

namespace {

// getaddrinfo()'s answer, freed with it.
struct Lookup {
  std::mutex mutex;
  std::condition_variable answered;
  bool done = false;
  int status = EAI_SYSTEM;
  addrinfo* found = nullptr;
  ~Lookup() {
    if (found != nullptr) ::freeaddrinfo(found);
  }
};

std::shared_ptr<Lookup> resolve(const std::string& host, const std::string& port, bool numeric) {
  auto lookup = std::make_shared<Lookup>();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = numeric ? AI_NUMERICHOST : 0;
  lookup->status = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &lookup->found);
  lookup->done = true;
  return lookup;
}

// A name: the resolver may take its time (DNS timeouts and retries), so it runs in a thread of
// its own, which a caller waits for as long as it likes. A thread given up on finishes alone, and
// a later caller for the same name waits for that one instead of starting another: a resolver
// that hangs holds one thread per name, not one per try.
std::shared_ptr<Lookup> resolve_name(const std::string& host, const std::string& port) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<Lookup>> under_way;
  std::lock_guard lock(mutex);
  auto key = host + ":" + port;
  if (auto lookup = under_way[key].lock()) {
    std::lock_guard answered(lookup->mutex);
    if (!lookup->done) return lookup;
  }
  auto lookup = std::make_shared<Lookup>();
  under_way[key] = lookup;
  try {
    std::thread([lookup, host, port] {
      int status = EAI_MEMORY;
      addrinfo* found = nullptr;
      try {
        auto answer = resolve(host, port, false);
        status = std::exchange(answer->status, EAI_SYSTEM);
        found = std::exchange(answer->found, nullptr);
      } catch (...) {  // no memory: reported as such
      }
      std::lock_guard answered(lookup->mutex);
      lookup->status = status;
      lookup->found = found;
      lookup->done = true;
      lookup->answered.notify_all();
    }).detach();
  } catch (const std::system_error& e) {
    under_way.erase(key);
    throw Error(ErrorCode::NetworkError, "resolving '" + host + "': no thread for the resolver: " + e.what());
  }
  return lookup;
}

}  // namespace

SocketAddress parse_address(std::string_view text, bool numeric_only, std::chrono::milliseconds limit) {
  auto bad = [&](const std::string& why) {
    return Error(ErrorCode::InvalidArgument, "address '" + std::string(text) + "' " + why +
                                                 " (want ADDRESS:PORT, or [ADDRESS]:PORT for IPv6)");
  };
  std::string_view host, port;
  if (text.starts_with('[')) {
    auto close = text.find("]:");
    if (close == std::string_view::npos) throw bad("lacks ']:' after the IPv6 address");
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    auto colon = text.rfind(':');
    if (colon == std::string_view::npos) throw bad("lacks a port");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) throw bad("is IPv6 without brackets");
  }
  unsigned number = 0;
  auto [end, error] = std::from_chars(port.data(), port.data() + port.size(), number);
  if (port.empty() || error != std::errc() || end != port.data() + port.size() || number > 65535) {
    throw bad("has no port from 0 to 65535");
  }
  if (host.empty()) throw bad("names no host");
  std::string host_text(host), port_text(port);
  if (numeric_only) {
    // A listener's address spelled out in full, so that every interface is served only when
    // 0.0.0.0 (or [::]) is named: getaddrinfo would take inet_aton's shorthands ("0:P" and
    // "0.0:P" are 0.0.0.0), and an IPv4-mapped address ([::ffff:0.0.0.0]) is every IPv4
    // interface to the socket.
    in6_addr six{};
    in_addr four{};
    if (text.starts_with('[')) {
      if (::inet_pton(AF_INET6, host_text.c_str(), &six) != 1) throw bad("has no IPv6 address in its brackets");
      if (IN6_IS_ADDR_V4MAPPED(&six)) throw bad("is an IPv4-mapped IPv6 address: name the IPv4 address itself");
    } else if (::inet_pton(AF_INET, host_text.c_str(), &four) != 1) {
      throw bad("is not an IPv4 address in four decimal parts (a listener takes one spelled out: 127.0.0.1)");
    }
  }
  auto lookup = resolve(host_text, port_text, true);  // a numeric address: no resolver
  if (lookup->status == EAI_NONAME && !numeric_only) {
    lookup = resolve_name(host_text, port_text);
    std::unique_lock lock(lookup->mutex);
    if (!lookup->answered.wait_for(lock, std::min(limit, std::chrono::milliseconds(std::chrono::hours(24))),
                                   [&] { return lookup->done; })) {
      throw Error(ErrorCode::NetworkError, "address '" + std::string(text) + "': the resolver gave no answer within " +
                                               std::to_string(limit.count()) + " ms");
    }
  }
  if (lookup->status != 0) {
    throw Error(numeric_only ? ErrorCode::InvalidArgument : ErrorCode::NetworkError,
                "address '" + std::string(text) + "': " + ::gai_strerror(lookup->status) +
                    (numeric_only ? " (a listener takes a numeric address of this host)" : ""));
  }
  SocketAddress address;
  std::memcpy(&address.storage, lookup->found->ai_addr, lookup->found->ai_addrlen);
  address.length = lookup->found->ai_addrlen;
  address.text = std::string(text);
  return address;
}

std::string to_string(const sockaddr_storage& address) {
  char host[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    ::inet_ntop(AF_INET, &in.sin_addr, host, sizeof host);
    port = ntohs(in.sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (address.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    ::inet_ntop(AF_INET6, &in6.sin6_addr, host, sizeof host);
    port = ntohs(in6.sin6_port);
  }
  return "[" + std::string(host) + "]:" + std::to_string(port);
}

namespace {

bool same_host_address(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr == reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr, &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr,
                       sizeof(in6_addr)) == 0;
  }
  return false;
}

bool wildcard(const sockaddr* address) {
  if (address->sa_family == AF_INET) return reinterpret_cast<const sockaddr_in*>(address)->sin_addr.s_addr == INADDR_ANY;
  if (address->sa_family == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr);
  }
  return false;
}

std::string interface_of(const sockaddr* address) {
  if (wildcard(address)) return {};
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return {};
  std::string name;
  for (auto* at = all; at != nullptr && name.empty(); at = at->ifa_next) {
    if (at->ifa_addr != nullptr && same_host_address(at->ifa_addr, address)) name = at->ifa_name;
  }
  ::freeifaddrs(all);
  return name;
}

}  // namespace

void check_listenable(const SocketAddress& address) {
  int fd = ::socket(address.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;  // UCX will say what is wrong
  int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);  // as UCX_TCP_CM_REUSEADDR=y: TIME_WAIT is no obstacle
  int error = ::bind(fd, address.get(), address.length) == 0 ? 0 : errno;
  ::close(fd);
  if (error == 0) return;
  std::string why = error == EADDRINUSE      ? "the port is in use: a process listens on it, or connections of one that did are closing"
                    : error == EADDRNOTAVAIL ? "not an address of this host"
                    : error == EACCES        ? "a port below 1024 needs privileges"
                                             : std::strerror(error);
  throw Error(ErrorCode::NetworkError, "cannot listen on " + address.text + ": " + why);
}

std::string interface_holding(const SocketAddress& address) { return interface_of(address.get()); }

std::string interface_towards(const SocketAddress& peer) {
  // A datagram socket "connected" to the peer sends nothing, but the kernel picks the route and
  // the local address it would use.
  int fd = ::socket(peer.storage.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return {};
  sockaddr_storage local{};
  socklen_t length = sizeof local;
  bool found = ::connect(fd, peer.get(), peer.length) == 0 &&
               ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  ::close(fd);
  return found ? interface_of(reinterpret_cast<const sockaddr*>(&local)) : std::string();
}

namespace {

// NET_DEVICES as the configuration has it (the environment, or a ucx.conf); empty when UCX's
// printout of it cannot be read.
std::string configured_net_devices(const ucp_config_t* config) {
  char* text = nullptr;
  std::size_t size = 0;
  FILE* out = ::open_memstream(&text, &size);
  if (out == nullptr) return {};
  ucp_config_print(config, out, nullptr, UCS_CONFIG_PRINT_CONFIG);
  std::fclose(out);
  std::string printed(text, size);
  std::free(text);
  constexpr std::string_view kKey = "UCX_NET_DEVICES=";
  auto at = printed.find(kKey);
  if (at == std::string::npos) return {};
  at += kKey.size();
  return printed.substr(at, printed.find('\n', at) - at);
}

// Every RDMA port of this host ("mlx5_0:1"): UCX counts them among its network devices too,
// and they open no listening socket.
std::string rdma_ports() {
  std::string ports;
  std::error_code error;
  for (const auto& device : std::filesystem::directory_iterator("/sys/class/infiniband", error)) {
    std::error_code inner;
    for (const auto& port : std::filesystem::directory_iterator(device.path() / "ports", inner)) {
      ports += "," + device.path().filename().string() + ":" + port.path().filename().string();
    }
  }
  return ports;
}

}  // namespace

Worker::Worker(const std::string& interface, sa_family_t family) {
  ucp_config_t* config = nullptr;
  if (auto status = ucp_config_read(nullptr, nullptr, &config); status != UCS_OK) fail_ucx("ucp_config_read", status);
  // One setting of ours in the configuration, or the configuration let go of and NetworkError.
  auto set = [&](const char* name, const char* value, std::string_view what) {
    if (auto status = ucp_config_modify(config, name, value); status != UCS_OK) {
      ucp_config_release(config);
      fail_ucx(what, status);
    }
  };
  // Unless the user named the devices: in the environment (even "all"), or in a ucx.conf. A
  // configuration that cannot be read is held too: the hold guards the host.
  bool user_named = std::getenv("UCX_NET_DEVICES") != nullptr;
  if (!interface.empty() && !user_named) {
    auto configured = configured_net_devices(config);
    user_named = !configured.empty() && configured != "all";
  }
  if (!interface.empty() && !user_named) {
    auto devices = interface + rdma_ports();
    set("NET_DEVICES", devices.c_str(), "holding UCX to " + devices);
  }
  if (family == AF_INET6 && std::getenv("UCX_TCP_AF_PRIO") == nullptr) set("TCP_AF_PRIO", "inet6,inet", "preferring IPv6");
  // Unless the user set it (UCX_TCP_CM_REUSEADDR): a server restarted on its port binds it
  // again at once, over the last one's connections in TIME_WAIT, as check_listenable() does.
  if (std::getenv("UCX_TCP_CM_REUSEADDR") == nullptr) set("CM_REUSEADDR", "y", "setting CM_REUSEADDR");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  auto status = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (status != UCS_OK) fail_ucx("ucp_init", status);
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (status = ucp_worker_create(context_, &worker_params, &worker_); status != UCS_OK) {
    ucp_cleanup(context_);
    fail_ucx("ucp_worker_create", status);
  }
  if (status = ucp_worker_get_efd(worker_, &event_fd_); status != UCS_OK) {
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    fail_ucx("ucp_worker_get_efd", status);
  }
}

Worker::~Worker() {
  // Messages nobody read (a heartbeat, a bucket under way when the link closed) are taken off
  // the queue first: UCX warns about each one it finds there. No progress is made meanwhile,
  // so no receive still under way writes into a buffer its owner already let go of.
  static std::byte scratch[64];  // received into only when a message is already here whole
  ucp_tag_recv_info_t info{};
  while (auto* message = ucp_tag_probe_nb(worker_, 0, 0, 1, &info)) {
    ucp_request_param_t param{};
    auto receiving = ucp_tag_msg_recv_nbx(worker_, scratch, sizeof scratch, message, &param);
    if (UCS_PTR_IS_PTR(receiving)) ucp_request_free(receiving);
  }
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

bool Worker::progress() noexcept {
  bool any = false;
  for (int call = 0; call < progress_calls_ && ucp_worker_progress(worker_) != 0; ++call) any = true;
  return any;
}

void Worker::wait(std::chrono::microseconds limit) {
  progress();
  auto status = ucp_worker_arm(worker_);
  if (status == UCS_ERR_BUSY) return;  // events came in meanwhile: the caller looks at them
  if (status != UCS_OK) fail_ucx("ucp_worker_arm", status);
  pollfd fd{event_fd_, POLLIN, 0};
  auto micros = std::max<std::chrono::microseconds::rep>(limit.count(), 0);
  timespec timeout{static_cast<time_t>(micros / 1'000'000), static_cast<long>(micros % 1'000'000) * 1000};
  ::ppoll(&fd, 1, &timeout, nullptr);
  progress();
}

void Pace::after(bool moved) {
  auto now = Clock::now();
  if (moved) last_moved_ = now;
  if (now - last_moved_ < kStillFor) {
    std::this_thread::yield();
  } else {
    worker_.wait(std::chrono::milliseconds(1));
  }
}

Request::Request(ucp_worker_h worker, ucs_status_ptr_t started, std::string_view what) : worker_(worker), what_(what) {
  if (UCS_PTR_IS_ERR(started)) fail_ucx(what, UCS_PTR_STATUS(started));
  request_ = UCS_PTR_IS_PTR(started) ? started : nullptr;
}

Request::Request(Request&& other) noexcept
    : worker_(other.worker_), request_(std::exchange(other.request_, nullptr)), what_(std::move(other.what_)) {}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    cancel();
    worker_ = other.worker_;
    request_ = std::exchange(other.request_, nullptr);
    what_ = std::move(other.what_);
  }
  return *this;
}

Request::~Request() { cancel(); }

bool Request::done() {
  if (request_ == nullptr) return true;
  auto status = ucp_request_check_status(request_);
  if (status == UCS_INPROGRESS) return false;
  ucp_request_free(request_);
  request_ = nullptr;
  if (status != UCS_OK) fail_ucx(what_, status);
  return true;
}

bool Request::ended() const noexcept {
  return request_ == nullptr || ucp_request_check_status(request_) != UCS_INPROGRESS;
}

void Request::cancel() noexcept {
  if (request_ == nullptr) return;
  if (ucp_request_check_status(request_) == UCS_INPROGRESS) ucp_request_cancel(worker_, request_);
  ucp_request_free(request_);  // UCX frees it once it completes
  request_ = nullptr;
}

Request send(ucp_worker_h worker, ucp_ep_h ep, std::span<const std::byte> bytes, ucp_tag_t tag) {
  ucp_request_param_t param{};
  return Request(worker, ucp_tag_send_nbx(ep, bytes.data(), bytes.size(), tag, &param), "sending");
}

Request receive(ucp_worker_h worker, ucp_tag_message_h message, std::span<std::byte> into) {
  ucp_request_param_t param{};
  return Request(worker, ucp_tag_msg_recv_nbx(worker, into.data(), into.size(), message, &param), "receiving");
}

ucp_tag_message_h probe(ucp_worker_h worker, ucp_tag_t tag, ucp_tag_t mask, std::size_t* length,
                        ucp_tag_t* sender_tag) noexcept {
  ucp_tag_recv_info_t info{};
  auto message = ucp_tag_probe_nb(worker, tag, mask, 1, &info);
  if (message != nullptr) {
    *length = info.length;
    if (sender_tag != nullptr) *sender_tag = info.sender_tag;
  }
  return message;
}

std::optional<ucp_tag_t> oldest_tag(ucp_worker_h worker) noexcept {
  ucp_tag_recv_info_t info{};
  if (ucp_tag_probe_nb(worker, 0, 0, 0, &info) == nullptr) return std::nullopt;
  return info.sender_tag;
}

namespace {

void on_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* endpoint = static_cast<Endpoint*>(arg);
  endpoint->failed = status == UCS_OK ? UCS_ERR_CONNECTION_RESET : status;
}

void create(ucp_worker_h worker, Endpoint& endpoint, ucp_ep_params_t& params, std::string_view what) {
  params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = on_error;
  params.err_handler.arg = &endpoint;
  if (auto status = ucp_ep_create(worker, &params, &endpoint.ep); status != UCS_OK) fail_ucx(what, status);
}

}  // namespace

void connect(ucp_worker_h worker, Endpoint& endpoint, const SocketAddress& address) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = address.get();
  params.sockaddr.addrlen = address.length;
  create(worker, endpoint, params, "connecting to " + address.text);
}

void accept(ucp_worker_h worker, Endpoint& endpoint, ucp_conn_request_h request) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  params.conn_request = request;
  create(worker, endpoint, params, "accepting a connection");
}

void close(Worker& worker, Endpoint& endpoint, std::chrono::milliseconds limit, bool flush) noexcept {
  if (endpoint.ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = flush && endpoint.failed == UCS_OK ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
  auto closing = ucp_ep_close_nbx(std::exchange(endpoint.ep, nullptr), &param);
  if (!UCS_PTR_IS_PTR(closing)) return;
  auto until = Clock::now() + limit;
  while (ucp_request_check_status(closing) == UCS_INPROGRESS && Clock::now() < until) {
    worker.progress();
    std::this_thread::yield();
  }
  ucp_request_free(closing);
}

}  // namespace tensorbucket::net::detail
