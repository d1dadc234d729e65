// Internal: the messages between a Server and a RemoteSubscriber (docs/network.md, "Protocol").
// Each is one tagged UCX message of fixed little-endian layout; the tag's top byte says which,
// and a peer's messages to the server carry the random key the server gave that connection.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensorbucket/header.hpp"

#include <ucp/api/ucp.h>

namespace tensorbucket::net::detail {

static_assert(std::endian::native == std::endian::little, "the wire layout is little-endian");

inline constexpr std::uint32_t kProtocolVersion = 2;
inline constexpr std::array<char, 8> kMagic = {'T', 'B', 'N', 'E', 'T', '\0', '\0', '\0'};

enum class Kind : std::uint8_t {
  Challenge = 1,  // server → peer: the connection's key and the server's nonce
  Proof,          // peer → server: its proof and its own nonce
  Welcome,        // server → peer: the server's proof; buckets follow
  Refused,        // server → peer: why it closes the link (text)
  Bucket,         // server → peer: BucketAnnounce, the frame, and a payload of one chunk at most
  Payload,        // server → peer: one chunk of the payload's bytes (chunks in order)
  Ack,            // peer → server: the ordinal of the last bucket it took
  Heartbeat,      // server → peer, when idle: the link is alive
  PayloadHash,    // server → peer, after the chunks: chunked_hash() of the payload
};

inline constexpr ucp_tag_t kKindMask = 0xffull << 56;
inline constexpr ucp_tag_t kKeyMask = ~kKindMask;
inline constexpr ucp_tag_t kAllBits = ~0ull;
constexpr ucp_tag_t tag(Kind kind, std::uint64_t key = 0) {
  return (static_cast<ucp_tag_t>(kind) << 56) | (key & kKeyMask);
}

using Nonce = std::array<std::uint8_t, 32>;
using Digest = std::array<std::uint8_t, 32>;  // HMAC-SHA256

struct Challenge {
  std::array<char, 8> magic;
  std::uint32_t version;
  std::uint32_t reserved;
  std::uint64_t key;
  Nonce nonce;
};
struct ProofMessage {
  std::array<char, 8> magic;
  std::uint32_t version;
  std::uint32_t reserved;
  Digest proof;  // client_proof(token, server nonce, key)
  Nonce nonce;
};
struct Welcome {
  Digest proof;  // server_proof(token, peer nonce, key)
  std::uint32_t channel_bytes;
  std::array<char, 252> channel;  // the served channel's name
};
struct BucketAnnounce {
  std::uint64_t ordinal;      // 1, 2, ... on this link; acknowledged by Ack
  std::uint64_t sequence;     // in the served channel
  std::uint64_t incarnation;  // of the served channel's producer
  std::uint64_t payload_bytes;
  std::uint64_t frame_bytes;   // the frame that follows this announce in the same message
  // A payload of kChunkBytes or less travels in this message, at `whole_offset` (a multiple of
  // kPayloadAlignment, after the frame), its hash in `whole_hash`: one rendezvous, not three
  // messages. A larger one comes in Payload messages of `chunk_bytes` (the last: the rest),
  // then PayloadHash; the whole_ fields are 0.
  std::uint64_t chunk_bytes;   // 0: the payload is in this message
  std::uint64_t whole_offset;
  std::uint64_t whole_hash;
};

// A payload travels in chunks, a few in flight at a time. The server hashes each chunk just
// before it sends it and the relay just after it arrives, so that each side reads it while it
// is in the cache, and neither stops the link to hash. The payload's hash, sent after the
// chunks and checked by the peer, is the xxh3 of the chunks' xxh3s in order; ChunkedHash
// computes it a chunk at a time.
inline constexpr std::uint64_t kChunkBytes = 1ull << 20;
inline constexpr std::size_t kChunksInFlight = 8;  // per peer, sent and not yet received

class ChunkedHash {
 public:
  explicit ChunkedHash(std::uint64_t chunks) { hashes_.reserve(chunks); }
  void add(std::span<const std::byte> chunk) { hashes_.push_back(xxh3(chunk)); }
  std::size_t chunks() const noexcept { return hashes_.size(); }
  std::uint64_t value() const noexcept { return xxh3(std::as_bytes(std::span(hashes_))); }

 private:
  std::vector<std::uint64_t> hashes_;
};

// The hash of a payload that travels whole: as if in chunks, as one chunk.
inline std::uint64_t hash_as_one_chunk(std::span<const std::byte> payload) {
  ChunkedHash hash(1);
  if (!payload.empty()) hash.add(payload);
  return hash.value();
}

constexpr std::uint64_t chunk_count(std::uint64_t payload_bytes, std::uint64_t chunk_bytes) {
  return (payload_bytes + chunk_bytes - 1) / chunk_bytes;
}
struct Ack {
  std::uint64_t ordinal;
};
// Refused: a reason code, then text (kMaxRefusalBytes at most in all).
enum class Refusal : std::uint8_t {
  WrongToken = 1,  // the peer's proof failed: it gives up (Unauthorized)
  Other,           // the server is full, or the peer was slow or malformed: it may retry
};
inline constexpr std::size_t kMaxRefusalBytes = 512;

// Random bytes from the kernel; SystemError when it has none.
void random_bytes(void* into, std::size_t size);
// What each side proves it holds the token with: HMAC-SHA256 of a side's label, the other
// side's fresh nonce and the connection's key. Neither proof can be replayed on another link.
Digest client_proof(std::string_view token, const Nonce& server_nonce, std::uint64_t key);
Digest server_proof(std::string_view token, const Nonce& peer_nonce, std::uint64_t key);
bool same_digest(const Digest& a, const Digest& b) noexcept;  // in constant time

}  // namespace tensorbucket::net::detail
