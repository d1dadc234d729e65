// The bucket header and the frame (header + manifest bytes) that carries a manifest.
//
// The header is fixed-size and trivially copyable so it can live in shared memory and be
// copied out in one read; a layout version sits in its first bytes. It binds the two halves
// of a bucket together: the manifest's size and xxh3-64, the payload's size and (optionally)
// xxh3-64. A frame is the header's bytes followed by the manifest's bytes.
//
// Thread safety: value types and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "tensorbucket/manifest.hpp"

namespace tensorbucket {

inline constexpr std::uint32_t kHeaderMagic = 0x314B4254;  // "TBK1" in memory order
inline constexpr std::uint16_t kHeaderLayoutVersion = 1;

enum HeaderFlags : std::uint16_t {
  kPayloadChecksum = 1u << 0,   // payload_xxh3 is set and must be checked
  kPayloadBlockHash = 1u << 1,  // with kPayloadChecksum: payload_xxh3 is the payload's block
                                // hash (docs/format.md), as a device channel's payloads have
};
inline constexpr std::uint16_t kKnownHeaderFlags = kPayloadChecksum | kPayloadBlockHash;

struct BucketHeader {
  std::uint32_t magic;           // kHeaderMagic
  std::uint16_t layout_version;  // kHeaderLayoutVersion
  std::uint16_t flags;           // HeaderFlags
  std::uint64_t manifest_bytes;  // size of the encoded manifest that follows the header
  std::uint64_t manifest_xxh3;   // xxh3-64 of those bytes
  std::uint64_t payload_bytes;   // bytes of payload the manifest describes
  std::uint64_t payload_xxh3;    // xxh3-64 (or block hash) of the payload when kPayloadChecksum, else 0
  std::uint8_t reserved[24];     // zero; room for later fields without a layout bump
};
static_assert(sizeof(BucketHeader) == 64);
static_assert(std::is_trivially_copyable_v<BucketHeader>);
static_assert(std::is_standard_layout_v<BucketHeader>);
static_assert(offsetof(BucketHeader, layout_version) == 4);
static_assert(offsetof(BucketHeader, manifest_bytes) == 8);
static_assert(offsetof(BucketHeader, payload_xxh3) == 32);

struct EncodeOptions {
  bool payload_checksum = false;  // hash the payload (costs one pass over it)
};

// The header binding `encoded_manifest` (from encode_manifest) to `payload`, whose size becomes
// header.payload_bytes. For producers that place the frame themselves (shared memory).
BucketHeader make_header(std::span<const std::byte> encoded_manifest,
                         std::span<const std::byte> payload, const EncodeOptions& options = {});

// Header + encoded manifest for `payload`, whose size becomes header.payload_bytes.
std::vector<std::byte> encode_frame(const Manifest& manifest, std::span<const std::byte> payload,
                                    const EncodeOptions& options = {});

// Reads and checks the header at the start of `frame`: MissingManifest when the frame is
// empty or declares no manifest; HeaderCorrupt for a short frame, bad magic, unknown version
// or flags, non-zero reserved bytes or sizes past the limits.
BucketHeader read_header(std::span<const std::byte> frame);

// The manifest bytes of a frame whose header is `header`: ManifestCorrupt when the frame is
// truncated or extended, ChecksumMismatch when they do not hash to header.manifest_xxh3.
std::span<const std::byte> manifest_bytes(const BucketHeader& header,
                                          std::span<const std::byte> frame);

// xxh3-64, the hash used by headers.
std::uint64_t xxh3(std::span<const std::byte> bytes) noexcept;

}  // namespace tensorbucket
