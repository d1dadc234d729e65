// Internal: copying entries into a payload, for packing and for in-place writers alike.
//
// Past kStreamingBytes of payload the destination cannot stay in cache anyway, so entries are
// copied with non-temporal stores: glibc's memcpy switches to them only for single copies of
// several MiB, and a bucket of many 256 KiB tensors otherwise pays a read-for-ownership of
// every destination line (measured: 1.1-1.3x a single memcpy of the same bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace tensorbucket::detail {

inline constexpr std::uint64_t kStreamingBytes = 16u << 20;

// Whether copies into `payload` should stream: large enough, and 16-byte aligned (entries are
// kPayloadAlignment-aligned from the payload's start).
bool streams(std::span<const std::byte> payload) noexcept;

// memcpy, or non-temporal stores when `streaming`. Streaming stores are weakly ordered: call
// finish_streaming() after the last one and before publishing.
void copy_bytes(std::byte* destination, const std::byte* source, std::size_t bytes,
                bool streaming) noexcept;
void finish_streaming() noexcept;

}  // namespace tensorbucket::detail
