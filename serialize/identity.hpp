// Internal: a manifest's identity fields (version, bucket_index, bucket_count) sit at a fixed
// place in its encoding, right after the endian flag and the format version. Producers send
// the same layout every step with a new version, so a producer restamps its encoded layout
// instead of encoding it again, and a consumer recognises a layout it already verified
// whatever bucket it belongs to.
#pragma once

#include "base/private.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

namespace tensorbucket::detail {

struct BucketIdentity {
  std::uint64_t version = 0;
  std::uint32_t bucket_index = 0;
  std::uint32_t bucket_count = 1;
};

inline constexpr std::size_t kIdentityOffset = 5;  // u8 endian flag, u32 format version
inline constexpr std::size_t kIdentityEnd = kIdentityOffset + 16;

// Both need an encoding of at least kIdentityEnd bytes.
BucketIdentity read_identity(std::span<const std::byte> encoded) noexcept;
void stamp_identity(std::span<std::byte> encoded, const BucketIdentity& identity) noexcept;

// ManifestCorrupt unless bucket_index < bucket_count.
void check_identity(const BucketIdentity& identity);

}  // namespace tensorbucket::detail
