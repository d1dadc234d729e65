// Internal: sockets of our own. Addresses as users write them, the interfaces they are on, and
// the front door's TCP connections (door.hpp), every wait under a deadline.
#pragma once

#include "base/private.hpp"

#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "door.hpp"

namespace tensorbucket::net::detail {

using Clock = std::chrono::steady_clock;

// "ADDRESS:PORT", or "[ADDRESS]:PORT" for IPv6. A listener takes a numeric address only (never
// a name that could resolve to every interface); a connect may name a host, which the resolver
// must answer within `limit` (NetworkError past it: a hung resolver does not hang the caller).
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  std::string text;  // as given, for messages
  const sockaddr* get() const noexcept { return reinterpret_cast<const sockaddr*>(&storage); }
};
SocketAddress parse_address(std::string_view text, bool numeric_only,
                            std::chrono::milliseconds limit = std::chrono::seconds(5));
std::string to_string(const sockaddr_storage& address);

// The network interface UCX may use for a link: the one that holds `address`, an address of
// this host (a listener's); "" for a wildcard address (every interface).
std::string interface_holding(const SocketAddress& address);
// The same for the interface this host reaches `peer` through (a connecting side's).
std::string interface_towards(const SocketAddress& peer);

// A descriptor, closed with its owner.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) noexcept : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Socket& operator=(Socket&& other) noexcept;
  ~Socket();
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept;

 private:
  int fd_ = -1;
};

// A non-blocking listening socket on `address`. NetworkError naming why not: the port taken,
// not an address of this host.
Socket listen_on(const SocketAddress& address);
sockaddr_storage local_address(const Socket& socket);

// The connecting side, each call done by `until` or NetworkError, as on a closed connection:
// a non-blocking connection to `address`; all of `bytes` sent; one whole message read.
Socket connect_to(const SocketAddress& address, Clock::time_point until);
void send_all(const Socket& link, std::span<const std::byte> bytes, Clock::time_point until);
void read_message(const Socket& link, DoorReader& reader, Clock::time_point until);
// What has come of a message, without waiting: false once the other side closed.
bool read_available(const Socket& link, DoorReader& reader);

}  // namespace tensorbucket::net::detail
