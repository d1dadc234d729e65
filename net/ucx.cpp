#include "ucx.hpp"

#include <dlfcn.h>
#include <link.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <type_traits>

#include "base/text.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::net::detail {

using text::fail;

namespace {

constexpr const char* kUcp = "libucp.so.0";

// A libucp already in the process (another library's: MPI, UCC, a preload) is the one to use:
// a second copy loaded by path would share the first one's libucs, and crash at exit. Else the
// one in the folder the build found it in, else wherever the dynamic loader finds one.
// RTLD_LOCAL: UCX's symbols stay out of the process's global scope. Never closed: UCX cannot
// be unloaded while its hooks are in place. Null, with why, when none loads.
void* open_ucp(std::string& why) {
  if (void* loaded = ::dlopen(kUcp, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) return loaded;
  std::string_view folder = TENSORBUCKET_UCX_LIBDIR;
  if (!folder.empty()) {
    auto path = std::string(folder) + "/" + kUcp;
    if (void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) return library;
    why = std::string(::dlerror()) + "; then ";
  }
  if (void* library = ::dlopen(kUcp, RTLD_NOW | RTLD_LOCAL)) return library;
  why += ::dlerror();
  return nullptr;
}

// The file `library` was loaded from.
std::string file_of(void* library) {
  link_map* map = nullptr;
  if (::dlinfo(library, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && *map->l_name) {
    return map->l_name;
  }
  return kUcp;
}

}  // namespace

const Ucx& ucx() {
  static const Ucx loaded = [] {
    std::string why;
    void* library = open_ucp(why);
    if (library == nullptr) fail(ErrorCode::NetworkError, "cannot load UCX, which the network side needs: ", why);
    auto path = file_of(library);
    auto find = [&](auto& function, const char* name) {
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(::dlsym(library, name));
      if (function == nullptr) fail(ErrorCode::NetworkError, "the UCX loaded (", path, ") has no ", name);
    };
    // UCX itself only warns when its API is older than the headers built against: a call into
    // it could then take structures of another layout.
    decltype(&ucp_get_version) get_version = nullptr;
    find(get_version, "ucp_get_version");
    unsigned major = 0, minor = 0, release = 0;
    get_version(&major, &minor, &release);
    if (major != UCP_API_MAJOR || minor < UCP_API_MINOR) {
      fail(ErrorCode::NetworkError, "the UCX loaded (", path, ") is version ", major, ".", minor, ".", release,
           "; this build needs ", UCP_API_MAJOR, ".", UCP_API_MINOR, " or a later ", UCP_API_MAJOR, ".x");
    }
    Ucx api{};
    find(api.status_string, "ucs_status_string");
    find(api.config_read, "ucp_config_read");
    find(api.config_modify, "ucp_config_modify");
    find(api.config_print, "ucp_config_print");
    find(api.config_release, "ucp_config_release");
    find(api.init_version, "ucp_init_version");
    find(api.cleanup, "ucp_cleanup");
    find(api.worker_create, "ucp_worker_create");
    find(api.worker_destroy, "ucp_worker_destroy");
    find(api.worker_get_efd, "ucp_worker_get_efd");
    find(api.worker_query, "ucp_worker_query");
    find(api.worker_release_address, "ucp_worker_release_address");
    find(api.worker_progress, "ucp_worker_progress");
    find(api.worker_arm, "ucp_worker_arm");
    find(api.ep_create, "ucp_ep_create");
    find(api.ep_close_nbx, "ucp_ep_close_nbx");
    find(api.tag_send_nbx, "ucp_tag_send_nbx");
    find(api.tag_probe_nb, "ucp_tag_probe_nb");
    find(api.tag_msg_recv_nbx, "ucp_tag_msg_recv_nbx");
    find(api.request_check_status, "ucp_request_check_status");
    find(api.request_cancel, "ucp_request_cancel");
    find(api.request_free, "ucp_request_free");
    return api;
  }();
  return loaded;
}

void fail_ucx(std::string_view what, ucs_status_t status) {
  fail(ErrorCode::NetworkError, what, ": ", ucx().status_string(status));
}

namespace {

// NET_DEVICES as the configuration has it (the environment, or a ucx.conf); empty when UCX's
// printout of it cannot be read.
std::string configured_net_devices(const ucp_config_t* config) {
  char* text = nullptr;
  std::size_t size = 0;
  FILE* out = ::open_memstream(&text, &size);
  if (out == nullptr) return {};
  ucx().config_print(config, out, nullptr, UCS_CONFIG_PRINT_CONFIG);
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

// This process's listening TCP sockets, as (descriptor, inode, port).
template <class Listening>
std::vector<Listening> listening_sockets() {
  std::vector<Listening> found;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", error)) {
    int fd = -1;
    const auto name = entry.path().filename().string();
    if (std::from_chars(name.data(), name.data() + name.size(), fd).ec != std::errc{}) continue;
    struct stat status{};
    int accepting = 0;
    socklen_t length = sizeof accepting;
    sockaddr_storage address{};
    socklen_t address_length = sizeof address;
    // Asked of the kernel directly, as in closed_listening_port(): UCX's threads use these.
    if (::syscall(SYS_fstat, fd, &status) != 0 || !S_ISSOCK(status.st_mode) ||
        ::syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &length) != 0 || accepting == 0 ||
        ::syscall(SYS_getsockname, fd, reinterpret_cast<sockaddr*>(&address), &address_length) != 0) {
      continue;
    }
    std::uint16_t port = 0;
    if (address.ss_family == AF_INET) port = ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
    else if (address.ss_family == AF_INET6) port = ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
    else continue;
    found.push_back({fd, status.st_ino, port});
  }
  return found;
}

// Threads of this process: only a process of one thread can tell the listening sockets UCX
// opens from another thread's (a Python program's own server).
std::size_t threads() {
  std::error_code error;
  return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator("/proc/self/task", error),
                                                std::filesystem::directory_iterator()));
}

}  // namespace

Worker::Worker(const std::string& interface, sa_family_t family) {
  // Asked before UCX makes threads of its own (its first context does).
  bool watched = threads() == 1;
  ucp_config_t* config = nullptr;
  if (auto status = ucx().config_read(nullptr, nullptr, &config); status != UCS_OK) fail_ucx("ucp_config_read", status);
  // One setting of ours in the configuration, or the configuration let go of and NetworkError.
  auto set = [&](const char* name, const char* value, std::string_view what) {
    if (auto status = ucx().config_modify(config, name, value); status != UCS_OK) {
      ucx().config_release(config);
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
    set("NET_DEVICES", devices.c_str(), text::message("holding UCX to ", devices));
  }
  if (family == AF_INET6 && std::getenv("UCX_TCP_AF_PRIO") == nullptr) set("TCP_AF_PRIO", "inet6,inet", "preferring IPv6");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  auto status = ucx().init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &context_);
  ucx().config_release(config);
  if (status != UCS_OK) fail_ucx("ucp_init", status);
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  auto listening_before = watched ? listening_sockets<Listening>() : std::vector<Listening>();
  if (status = ucx().worker_create(context_, &worker_params, &worker_); status != UCS_OK) {
    ucx().cleanup(context_);
    if (status == UCS_ERR_ALREADY_EXISTS) {
      // UCX 1.22 keeps the wake-up handler of a listening socket it closed (an accept that
      // failed), and refuses every later worker in the process so.
      throw UcxUnusable(ErrorCode::NetworkError,
                        text::message("ucp_worker_create: ", ucx().status_string(status),
                                      ": UCX in this process makes no worker any more (it closed a listening "
                                      "socket of an earlier one, as when the process ran out of descriptors)"));
    }
    fail_ucx("ucp_worker_create", status);
  }
  for (const auto& socket : watched ? listening_sockets<Listening>() : std::vector<Listening>()) {
    bool before = std::any_of(listening_before.begin(), listening_before.end(),
                              [&](const Listening& old) { return old.inode == socket.inode; });
    if (!before) listening_.push_back(socket);
  }
  if (status = ucx().worker_get_efd(worker_, &event_fd_); status != UCS_OK) {
    ucx().worker_destroy(worker_);
    ucx().cleanup(context_);
    fail_ucx("ucp_worker_get_efd", status);
  }
}

Worker::~Worker() {
  // Messages nobody read (a heartbeat, a bucket under way when the link closed) are taken off
  // the queue first: UCX warns about each one it finds there. No progress is made meanwhile,
  // so no receive still under way writes into a buffer its owner already let go of.
  static std::byte scratch[64];  // received into only when a message is already here whole
  ucp_tag_recv_info_t info{};
  while (auto* message = ucx().tag_probe_nb(worker_, 0, 0, 1, &info)) {
    ucp_request_param_t param{};
    auto receiving = ucx().tag_msg_recv_nbx(worker_, scratch, sizeof scratch, message, &param);
    if (UCS_PTR_IS_PTR(receiving)) ucx().request_free(receiving);
  }
  ucx().worker_destroy(worker_);
  ucx().cleanup(context_);
}

std::vector<std::byte> Worker::address() const {
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  if (auto status = ucx().worker_query(worker_, &attr); status != UCS_OK) fail_ucx("ucp_worker_query", status);
  auto* bytes = reinterpret_cast<const std::byte*>(attr.address);
  std::vector<std::byte> address(bytes, bytes + attr.address_length);
  ucx().worker_release_address(worker_, attr.address);
  if (address.empty() || address.size() > kMaxWorkerAddress) {
    fail(ErrorCode::NetworkError, "UCX's worker address has ", address.size(), " bytes; the front door carries 1 to ",
         kMaxWorkerAddress);
  }
  return address;
}

std::optional<std::uint16_t> Worker::closed_listening_port() const {
  for (const auto& socket : listening_) {
    struct stat status{};
    int accepting = 0;
    socklen_t length = sizeof accepting;
    // UCX's thread may close the descriptor meanwhile, and another socket take its number: the
    // inode tells. Asked of the kernel directly: ThreadSanitizer models a descriptor as memory,
    // and reported this look beside UCX's close as a data race.
    if (::syscall(SYS_fstat, socket.fd, &status) != 0 || status.st_ino != socket.inode ||
        ::syscall(SYS_getsockopt, socket.fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &length) != 0 ||
        accepting == 0) {
      return socket.port;
    }
  }
  return std::nullopt;
}

void Worker::fail_listening_closed(std::uint16_t port) {
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  std::error_code error;
  auto open = std::distance(std::filesystem::directory_iterator("/proc/self/fd", error),
                            std::filesystem::directory_iterator());
  throw UcxUnusable(ErrorCode::NetworkError,
                    text::message("UCX closed its listening socket (port ", port,
                                  "): an accept there failed, as when this process is out of descriptors (", open,
                                  " open, the limit ", limit.rlim_cur,
                                  "), which connections to that port that never send hold one each; "
                                  "no peer can reach this process's UCX any more"));
}

bool Worker::progress() noexcept {
  bool any = false;
  for (int call = 0; call < progress_calls_ && ucx().worker_progress(worker_) != 0; ++call) any = true;
  return any;
}

void Worker::wait(std::chrono::microseconds limit) {
  progress();
  auto status = ucx().worker_arm(worker_);
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
  auto status = ucx().request_check_status(request_);
  if (status == UCS_INPROGRESS) return false;
  ucx().request_free(request_);
  request_ = nullptr;
  if (status != UCS_OK) fail_ucx(what_, status);
  return true;
}

bool Request::ended() const noexcept {
  return request_ == nullptr || ucx().request_check_status(request_) != UCS_INPROGRESS;
}

void Request::cancel() noexcept {
  if (request_ == nullptr) return;
  if (ucx().request_check_status(request_) == UCS_INPROGRESS) ucx().request_cancel(worker_, request_);
  ucx().request_free(request_);  // UCX frees it once it completes
  request_ = nullptr;
}

Request send(ucp_worker_h worker, ucp_ep_h ep, std::span<const std::byte> bytes, ucp_tag_t tag) {
  ucp_request_param_t param{};
  return Request(worker, ucx().tag_send_nbx(ep, bytes.data(), bytes.size(), tag, &param), "sending");
}

Request receive(ucp_worker_h worker, ucp_tag_message_h message, std::span<std::byte> into) {
  ucp_request_param_t param{};
  return Request(worker, ucx().tag_msg_recv_nbx(worker, into.data(), into.size(), message, &param), "receiving");
}

ucp_tag_message_h probe(ucp_worker_h worker, ucp_tag_t tag, ucp_tag_t mask, std::size_t* length,
                        ucp_tag_t* sender_tag) noexcept {
  ucp_tag_recv_info_t info{};
  auto message = ucx().tag_probe_nb(worker, tag, mask, 1, &info);
  if (message != nullptr) {
    *length = info.length;
    if (sender_tag != nullptr) *sender_tag = info.sender_tag;
  }
  return message;
}

std::optional<ucp_tag_t> oldest_tag(ucp_worker_h worker) noexcept {
  ucp_tag_recv_info_t info{};
  if (ucx().tag_probe_nb(worker, 0, 0, 0, &info) == nullptr) return std::nullopt;
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
  if (auto status = ucx().ep_create(worker, &params, &endpoint.ep); status != UCS_OK) fail_ucx(what, status);
}

}  // namespace

void connect(ucp_worker_h worker, Endpoint& endpoint, std::span<const std::byte> worker_address) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  params.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  create(worker, endpoint, params, "connecting to the peer's UCX worker");
}

void close(Worker& worker, Endpoint& endpoint, std::chrono::milliseconds limit, bool flush) noexcept {
  if (endpoint.ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = flush && endpoint.failed == UCS_OK ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
  auto closing = ucx().ep_close_nbx(std::exchange(endpoint.ep, nullptr), &param);
  if (!UCS_PTR_IS_PTR(closing)) return;
  auto until = Clock::now() + limit;
  while (ucx().request_check_status(closing) == UCS_INPROGRESS && Clock::now() < until) {
    worker.progress();
    std::this_thread::yield();
  }
  ucx().request_free(closing);
}

}  // namespace tensorbucket::net::detail
