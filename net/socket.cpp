// Sockets of our own: addresses, the front door's connections (door.hpp).
#include "socket.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "base/text.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::net::detail {

using text::fail;
using text::Quoted;

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
    fail(ErrorCode::NetworkError, "resolving ", Quoted{host}, ": no thread for the resolver: ", e.what());
  }
  return lookup;
}

}  // namespace

SocketAddress parse_address(std::string_view text, bool numeric_only, std::chrono::milliseconds limit) {
  auto bad = [&](std::string_view why) {
    return Error(ErrorCode::InvalidArgument,
                 text::message("address ", Quoted{text}, ' ', why, " (want ADDRESS:PORT, or [ADDRESS]:PORT for IPv6)"));
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
      fail(ErrorCode::NetworkError, "address ", Quoted{text}, ": the resolver gave no answer within ", limit.count(), " ms");
    }
  }
  if (lookup->status != 0) {
    fail(numeric_only ? ErrorCode::InvalidArgument : ErrorCode::NetworkError, "address ", Quoted{text}, ": ",
         ::gai_strerror(lookup->status), numeric_only ? " (a listener takes a numeric address of this host)" : "");
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

Socket listen_on(const SocketAddress& address) {
  auto refused = [&](int error) {
    const char* why = error == EADDRINUSE      ? "the port is in use: a process listens on it, or connections of one that did are closing"
                      : error == EADDRNOTAVAIL ? "not an address of this host"
                      : error == EACCES        ? "a port below 1024 needs privileges"
                                               : std::strerror(error);
    fail(ErrorCode::NetworkError, "cannot listen on ", address.text, ": ", why);
  };
  Socket listening(::socket(address.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listening) refused(errno);
  int on = 1;
  // A server restarted on its port binds it again at once, over the last one's connections in
  // TIME_WAIT; and [::] is IPv6's every interface, not IPv4's too.
  ::setsockopt(listening.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  if (address.storage.ss_family == AF_INET6) ::setsockopt(listening.get(), IPPROTO_IPV6, IPV6_V6ONLY, &on, sizeof on);
  if (::bind(listening.get(), address.get(), address.length) != 0 || ::listen(listening.get(), SOMAXCONN) != 0) {
    refused(errno);
  }
  return listening;
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


Socket::~Socket() { reset(); }

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void Socket::reset() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

sockaddr_storage local_address(const Socket& socket) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  ::getsockname(socket.get(), reinterpret_cast<sockaddr*>(&address), &length);
  return address;
}

namespace {

// Waits until `fd` is ready for `events`, or `until`: false then.
bool ready(int fd, short events, Clock::time_point until) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0) return false;
    pollfd wanted{fd, events, 0};
    int got = ::poll(&wanted, 1, static_cast<int>(std::min<long long>(left + 1, 1000)));
    if (got > 0) return true;
    if (got < 0 && errno != EINTR) return true;  // the call that follows says what is wrong
  }
}

}  // namespace

Socket connect_to(const SocketAddress& address, Clock::time_point until) {
  Socket link(::socket(address.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!link) fail(ErrorCode::NetworkError, "socket: ", std::strerror(errno));
  int error = ::connect(link.get(), address.get(), address.length) == 0 ? 0 : errno;
  if (error == EINPROGRESS) {
    if (!ready(link.get(), POLLOUT, until)) {
      throw Error(ErrorCode::NetworkError, "no server answered in time (the host is unreachable, or drops the connection)");
    }
    socklen_t length = sizeof error;
    ::getsockopt(link.get(), SOL_SOCKET, SO_ERROR, &error, &length);
  }
  if (error != 0) {
    fail(ErrorCode::NetworkError, "no server answered (nothing listens there, or the host is unreachable): ",
         std::strerror(error));
  }
  return link;
}

void send_all(const Socket& link, std::span<const std::byte> bytes, Clock::time_point until) {
  while (!bytes.empty()) {
    auto sent = ::send(link.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (sent > 0) {
      bytes = bytes.subspan(static_cast<std::size_t>(sent));
    } else if (sent < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!ready(link.get(), POLLOUT, until)) throw Error(ErrorCode::NetworkError, "the server took nothing in time");
    } else {
      fail(ErrorCode::NetworkError, "sending: ", std::strerror(errno));
    }
  }
}

bool read_available(const Socket& link, DoorReader& reader) {
  while (!reader.done()) {
    auto room = reader.room();
    auto got = ::recv(link.get(), room.data(), room.size(), 0);
    if (got > 0) {
      reader.got(static_cast<std::size_t>(got));
    } else if (got == 0) {
      return false;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return true;
    } else if (errno != EINTR) {
      fail(ErrorCode::NetworkError, "receiving: ", std::strerror(errno));
    }
  }
  return true;
}

void read_message(const Socket& link, DoorReader& reader, Clock::time_point until) {
  for (;;) {
    if (!read_available(link, reader)) {
      fail(ErrorCode::NetworkError, "the server closed the connection where a ", reader.due(), " was due");
    }
    if (reader.done()) return;
    if (!ready(link.get(), POLLIN, until)) fail(ErrorCode::NetworkError, "no ", reader.due(), " came in time");
  }
}

}  // namespace tensorbucket::net::detail
