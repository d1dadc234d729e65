// Internal: copying entries into a payload, for packing and for in-place writers alike.
//
// Past kStreamingBytes of payload the destination cannot stay in cache anyway. On the AMD EPYC
// hosts measured, copying its entries with non-temporal stores was then faster than glibc's
// memcpy, which switches to them only for single copies of several MiB, so that a bucket of
// many 256 KiB tensors paid a read-for-ownership of every destination line (1.1-1.3x a single
// memcpy of the same bytes; 1000 x 8 KiB and x 16 KiB handed off in 0.5-0.8x the time with
// streaming from 4 MiB, bench/RESULTS.md, issue 21). On an Intel Xeon host glibc's memcpy,
// which picks its routine per CPU, wrote 256 MiB faster than a sequential streaming loop; the
// loop now reads several pages in turn, a few lines of each, with the CPU's widest stores,
// which beat it on both Intel hosts measured (issue 43). Neither is fixed: a process times its
// first large packs with each and keeps the faster (large_copies()).
//
// Smaller payloads stream without timing from streaming_from(): a copy timed alone does not
// see what memcpy leaves behind (see there).
#pragma once

#include "base/private.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "tensorbucket/bucket.hpp"

namespace tensorbucket::detail {

inline constexpr std::uint64_t kStreamingBytes = 4u << 20;  // a payload past 4 MiB

// Whether copies into `payload` should stream: from streaming_from() bytes, and past
// kStreamingBytes when streaming is this host's way (or not yet measured against memcpy).
bool streams(std::span<const std::byte> payload) noexcept;

// The payload size from which copies stream without being timed: 3/8 of this core's L2 cache
// as the OS reports it (kStreamingBytes where it reports none). From there memcpy's sources
// and destination together fill more than 3/4 of the L2, so its destination lines, read for
// ownership, leave it dirty during the copy or soon after, and their write-back lands on what
// runs next. Timed alone, memcpy copied 1000 x 1 KiB faster; a whole handoff took 59-61 us
// streaming against 70-74 us with memcpy (an Intel Xeon with 2 MiB of L2; 768 KiB payloads
// went the other way, 48 against 42 us: bench/RESULTS.md, issue 43).
// TENSORBUCKET_LARGE_COPIES=memcpy turns it off too.
std::uint64_t streaming_from() noexcept;

// Zeroes `bytes` at `destination` (padding), with streaming stores when `streaming`: ordinary
// stores in between a streamed payload's lines cost the handoff more than the zeroes.
void zero_bytes(std::byte* destination, std::size_t bytes, bool streaming) noexcept;

// How payloads past kStreamingBytes are copied in this process: "streaming" or "memcpy" once
// chosen, "measuring" before. The first 2 x kCopyTrials packs of such payloads alternate the
// two and are timed per byte; the one with the lower median runs from then on.
// TENSORBUCKET_LARGE_COPIES=streaming|memcpy in the environment chooses without measuring.
inline constexpr int kCopyTrials = 6;
const char* large_copies() noexcept;

// memcpy, or non-temporal stores when `streaming` (at any alignment). Streaming stores are
// weakly ordered: call finish_streaming() after the last one and before publishing.
void copy_bytes(std::byte* destination, const std::byte* source, std::size_t bytes,
                bool streaming) noexcept;
void finish_streaming() noexcept;

// The streaming routines this CPU runs, widest first ("avx512", "avx2", "sse2"; none but on
// x86-64): copy_bytes() streams with the first. stream_with() copies with the one named, so
// that tests check each (InvalidArgument for one this CPU does not run).
std::vector<std::string_view> streaming_routines();
void stream_with(std::string_view routine, std::byte* destination, const std::byte* source, std::size_t bytes);

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

// Copies a payload's entries one at a time, in payload order, as pack() does: a small entry in
// one memcpy, with the lines of the entries after it asked for writing ahead of the copy; a
// large one in kPaceBytes pieces told to `near_end` (when given). Streaming stores need
// finish_streaming() after the last. What pack() and a reservation's writes share (one copier
// from its first write to its last, so that writing entry by entry costs what write_all()
// does).
class EntryCopier {
 public:
  EntryCopier(std::span<std::byte> payload, bool streaming, NearEnd* near_end) noexcept
      : payload_(payload), streaming_(streaming), near_end_(near_end) {}
  // `to`: the entry's bytes, within the payload.
  void copy(std::span<std::byte> to, const std::byte* from) noexcept;
  bool streaming() const noexcept { return streaming_; }

 private:
  std::span<std::byte> payload_;
  bool streaming_;
  NearEnd* near_end_;
  std::uint64_t asked_ = 0;  // the offset up to which lines were asked for writing
};

// Walks a payload of `payload_bytes` laid out as `entries` (in payload order, as a builder lays
// them out): `gap(offset, bytes)` for the padding before each entry and after the last, which
// must be zeroed so that no bytes of an older bucket travel in it, and `entry(index)` after the
// gap before entry `index`. The one walker of the padding, for host and device payloads alike.
template <class Gap, class Entry>
void walk_payload(std::span<const ManifestEntry> entries, std::uint64_t payload_bytes, Gap&& gap, Entry&& entry) {
  std::uint64_t end = 0;  // of the last entry
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].byte_offset > end) gap(end, entries[i].byte_offset - end);
    entry(i);
    end = entries[i].byte_offset + entries[i].byte_length;
  }
  if (payload_bytes > end) gap(end, payload_bytes - end);
}

template <class Gap>
void for_each_gap(std::span<const ManifestEntry> entries, std::uint64_t payload_bytes, Gap&& gap) {
  walk_payload(entries, payload_bytes, gap, [](std::size_t) {});
}

// BucketBuilder::pack_into() into a payload the caller sized: copies every entry, zeroes the
// padding, and tells `near_end` (when given; its total is the entries' bytes) what it copied.
void pack(const BucketBuilder& bucket, std::span<std::byte> payload, NearEnd* near_end = nullptr);

}  // namespace tensorbucket::detail
