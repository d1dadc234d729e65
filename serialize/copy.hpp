// Internal: copying entries into a payload, for packing and for in-place writers alike.
//
// Past kStreamingBytes of payload the destination cannot stay in cache anyway, so entries are
// copied with non-temporal stores: glibc's memcpy switches to them only for single copies of
// several MiB, and a bucket of many 256 KiB tensors otherwise pays a read-for-ownership of
// every destination line (measured: 1.1-1.3x a single memcpy of the same bytes). The
// threshold was 16 MiB; at 4 MiB, 1000 x 8 KiB and 1000 x 16 KiB buckets (two slots of which
// outgrow the share of L3 a VM gets) hand off in 0.5-0.8x the time, while 1000 x 4 KiB showed
// no difference either way and stays cached for its consumer (bench/RESULTS.md, issue 21).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "tensorbucket/bucket.hpp"

namespace tensorbucket::detail {

inline constexpr std::uint64_t kStreamingBytes = 4u << 20;  // a payload past 4 MiB

// Whether copies into `payload` should stream: large enough, and 16-byte aligned (entries are
// kPayloadAlignment-aligned from the payload's start).
bool streams(std::span<const std::byte> payload) noexcept;

// memcpy, or non-temporal stores when `streaming`. Streaming stores are weakly ordered: call
// finish_streaming() after the last one and before publishing.
void copy_bytes(std::byte* destination, const std::byte* source, std::size_t bytes,
                bool streaming) noexcept;
void finish_streaming() noexcept;

// Calls `wake` once, when a copy of `total` bytes is due to end within `lead`, judged from its
// pace since the first piece (the clock is read every kPaceBytes: copy_paced() cuts larger
// pieces). A channel wakes its consumers then, so that they spin through the end of a long
// copy instead of waking after it. Without `wake` it only counts.
class NearEnd {
 public:
  static constexpr std::uint64_t kPaceBytes = 256u << 10;
  NearEnd(std::uint64_t total, std::chrono::nanoseconds lead, std::function<void()> wake);
  void copied(std::uint64_t bytes) {  // after each piece, in any order
    copied_ += bytes;
    if (copied_ >= next_look_) look();
  }
  void starting() {  // before each piece: the pace counts from the first
    if (copied_ == 0) start_ = std::chrono::steady_clock::now();
  }

 private:
  void look();  // the clock; wakes when due, and then never looks again

  std::uint64_t total_;
  std::chrono::nanoseconds lead_;
  std::function<void()> wake_;
  std::chrono::steady_clock::time_point start_;
  std::uint64_t copied_ = 0;
  std::uint64_t next_look_;
};

// copy_bytes(), in kPaceBytes pieces told to `near_end`, so that one large tensor is paced too.
void copy_paced(std::byte* destination, const std::byte* source, std::size_t bytes, bool streaming,
                NearEnd& near_end) noexcept;

// BucketBuilder::pack_into() into a payload the caller sized: copies every entry, zeroes the
// padding, and tells `near_end` (when given; its total is the entries' bytes) what it copied.
void pack(const BucketBuilder& bucket, std::span<std::byte> payload, NearEnd* near_end = nullptr);

}  // namespace tensorbucket::detail
