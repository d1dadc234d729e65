// Internal: the messages between a Server and a RemoteSubscriber once the front door let the
// peer in (door.hpp; docs/network.md, "Protocol"). Each is one tagged UCX message of fixed
// little-endian layout; the tag's top byte says which, and a peer's messages to the server
// carry the random key the server gave that connection at the front door.
#pragma once

#include "base/private.hpp"

#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "door.hpp"
#include "tensorbucket/header.hpp"

#include <ucp/api/ucp.h>

namespace tensorbucket::net::detail {

enum class Kind : std::uint8_t {
  Bucket = 5,     // server → peer: BucketAnnounce, the frame, and a payload of one chunk at most
  Payload,        // server → peer: one chunk of the payload's bytes (chunks in order)
  Ack,            // peer → server: the ordinal of the last bucket it took
  Heartbeat,      // server → peer: the first message on a link, then whenever idle
  PayloadHash,    // server → peer, after the chunks: chunked_hash() of the payload
};

inline constexpr ucp_tag_t kKindMask = 0xffull << 56;
inline constexpr ucp_tag_t kKeyMask = ~kKindMask;
inline constexpr ucp_tag_t kAllBits = ~0ull;
constexpr ucp_tag_t tag(Kind kind, std::uint64_t key = 0) {
  return (static_cast<ucp_tag_t>(kind) << 56) | (key & kKeyMask);
}

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
inline constexpr std::uint64_t kMinChunkBytes = 64 << 10, kMaxChunkBytes = 1ull << 30;  // what a relay accepts
inline constexpr std::size_t kChunksInFlight = 8;  // per peer, sent and not yet received

// The largest frame a Bucket message carries: a header and the largest manifest.
inline constexpr std::size_t kMaxFrameBytes = sizeof(BucketHeader) + kMaxManifestBytes;

// What both ends allow the other: a payload under way may take its size at this rate on top of
// the idle timeout (serve's peer timeout, the relay's idle timeout), and a closing link this long
// to flush what it owes.
inline constexpr double kSlowestBytesPerMs = 10e3;  // 10 MB/s
inline constexpr std::chrono::milliseconds kCloseLimit{1000};

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

}  // namespace tensorbucket::net::detail
