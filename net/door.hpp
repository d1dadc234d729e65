// Internal: the front door (docs/network.md, "Protocol"). A relay first meets serve on a TCP
// connection of serve's own, where both prove they hold the token and then swap their UCX
// worker addresses; only then does either side make a UCX endpoint. So no byte from a peer
// without the token reaches UCX's connection code (which aborts on a crafted request, and has
// no deadline for one): it reaches the few fixed-size reads below, each bounded, under a
// deadline.
//
// Each message is a DoorHeader and `length` bytes, in this little-endian layout. This file has
// no I/O: both ends feed it bytes, so the fuzz target drives it as serve does.
#pragma once

#include "base/private.hpp"

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace tensorbucket::net::detail {

static_assert(std::endian::native == std::endian::little, "the wire layout is little-endian");

inline constexpr std::uint32_t kProtocolVersion = 3;  // 3: the token is proved at the front door
inline constexpr std::array<char, 8> kMagic = {'T', 'B', 'N', 'E', 'T', '\0', '\0', '\0'};

enum class DoorKind : std::uint8_t {
  Challenge = 1,  // serve → relay, at once: the connection's key and serve's nonce
  Proof,          // relay → serve: its proof and its own nonce
  Welcome,        // serve → relay: serve's proof and the channel's name
  Refused,        // serve → relay: why it closes the connection (a Refusal, then text)
  Address,        // each way, after the welcome: the sender's UCX worker address
};

struct DoorHeader {
  DoorKind kind;
  std::array<std::uint8_t, 3> reserved;  // zero
  std::uint32_t length;                  // of what follows
};

using Nonce = std::array<std::uint8_t, 32>;
using Digest = std::array<std::uint8_t, 32>;  // HMAC-SHA256

struct Challenge {
  std::array<char, 8> magic;
  std::uint32_t version;
  std::uint32_t reserved;
  std::uint64_t key;  // tags the relay's UCX messages to serve
  Nonce nonce;
};
struct ProofMessage {
  std::array<char, 8> magic;
  std::uint32_t version;
  std::uint32_t reserved;
  Digest proof;  // client_proof(token, serve's nonce, key)
  Nonce nonce;
};
struct Welcome {
  Digest proof;  // server_proof(token, the relay's nonce, key)
  std::uint32_t channel_bytes;
  std::array<char, 252> channel;  // the served channel's name
};
enum class Refusal : std::uint8_t {
  WrongToken = 1,  // the relay's proof failed: it gives up (Unauthorized)
  Other,           // serve is full, or the relay was slow or malformed: it may retry
};
inline constexpr std::size_t kMaxRefusalBytes = 512;
// A UCX worker address: a few hundred bytes for TCP and shared memory, more with RDMA ports.
inline constexpr std::size_t kMaxWorkerAddress = 64 << 10;

// Random bytes from the kernel; SystemError when it has none.
void random_bytes(void* into, std::size_t size);
// What each side proves it holds the token with: HMAC-SHA256 of a side's label, the other
// side's fresh nonce and the connection's key. Neither proof can be replayed on another link.
Digest client_proof(std::string_view token, const Nonce& server_nonce, std::uint64_t key);
Digest server_proof(std::string_view token, const Nonce& peer_nonce, std::uint64_t key);
bool same_digest(const Digest& a, const Digest& b) noexcept;  // in constant time

// A message as it goes out: its header, then `body`.
std::vector<std::byte> door_message(DoorKind kind, std::span<const std::byte> body);
template <class Fixed>
  requires std::is_trivially_copyable_v<Fixed>
std::vector<std::byte> door_message(DoorKind kind, const Fixed& body) {
  return door_message(kind, std::as_bytes(std::span(&body, 1)));
}
std::vector<std::byte> refusal_message(Refusal reason, std::string_view why);

// Takes one message of the kind due in from a stream, a piece at a time: never a byte past its
// end (what follows is the next message's), never more than the most it may have.
class DoorReader {
 public:
  // The next message is `kind` (`name` in errors), of `least` to `most` bytes; or a refusal,
  // where the reader is the relay's.
  void expect(DoorKind kind, std::string_view name, std::size_t least, std::size_t most, bool or_refusal);
  // Where the next bytes go; empty once the message is whole.
  std::span<std::byte> room() noexcept;
  // `count` bytes came into room() (no more than it had). NetworkError on a header of another
  // kind, of a size out of bounds, or with reserved bytes set.
  void got(std::size_t count);
  bool done() const noexcept { return have_ == sizeof(DoorHeader) + header_.length && have_header_; }
  DoorKind kind() const noexcept { return header_.kind; }
  const std::string& due() const noexcept { return name_; }  // the name of the kind expected
  std::span<const std::byte> body() const noexcept;

 private:
  DoorKind kind_{};
  std::string name_;
  std::size_t least_ = 0, most_ = 0;
  bool or_refusal_ = false;
  std::array<std::byte, sizeof(DoorHeader)> header_bytes_{};
  DoorHeader header_{};
  bool have_header_ = false;
  std::vector<std::byte> body_;
  std::size_t have_ = 0;  // bytes of this message so far, header included
};

// Serve's end of one connection: the challenge goes out at once; a proof that holds makes it
// Proved, and serve then welcomes it (or refuses it); the relay's worker address makes it Done.
// Anything else refuses it: Closing, with a refusal to send and why().
class ServerDoor {
 public:
  enum class State { Proving, Proved, Addressing, Done, Closing };
  ServerDoor(std::string_view token, std::uint64_t key);

  State state() const noexcept { return state_; }
  // Bytes due out, and that `count` of them went.
  std::span<const std::byte> output() const noexcept;
  void sent(std::size_t count) noexcept;
  // Where the next bytes from the relay go; empty while none are due (Proved, Done, Closing).
  std::span<std::byte> room() noexcept;
  // `count` bytes came into room(). Never throws a peer's error: it refuses the peer instead.
  void got(std::size_t count);

  // Proved → Addressing: serve's proof, the channel's name and serve's worker address go out.
  void welcome(std::string_view channel, std::span<const std::byte> worker_address);
  void refuse(Refusal reason, std::string why);
  const std::string& why() const noexcept { return why_; }
  bool wrong_token() const noexcept { return wrong_token_; }
  // Done: the relay's UCX worker address.
  std::span<const std::byte> peer_address() const noexcept { return reader_.body(); }
  std::uint64_t key() const noexcept { return key_; }

 private:
  std::string token_;
  std::uint64_t key_;
  Nonce nonce_{};       // serve's
  Nonce peer_nonce_{};  // the relay's
  State state_ = State::Proving;
  DoorReader reader_;
  std::vector<std::byte> out_;
  std::size_t out_sent_ = 0;
  std::string why_;
  bool wrong_token_ = false;
};

}  // namespace tensorbucket::net::detail
