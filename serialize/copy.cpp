#include "copy.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>
#include <utility>

#include "text.hpp"

namespace tensorbucket::detail {

namespace {

bool large_and_aligned(std::span<const std::byte> payload) noexcept {
  return payload.size() >= kStreamingBytes && reinterpret_cast<std::uintptr_t>(payload.data()) % 16 == 0;
}

// The choice large_copies() reports, one per process (a forked child goes on with its
// parent's): trials while measuring, then the faster routine.
class LargeCopies {
 public:
  static LargeCopies& get() {
    static LargeCopies choice;
    return choice;
  }

  // The routine of the next large pack, and whether it is a trial to time.
  struct Turn {
    bool streaming = false;
    bool trial = false;
  };
  Turn next() noexcept {
    auto state = state_.load(std::memory_order_relaxed);
    if (state != kMeasuring) return {state == kStreaming, false};
    return {turns_.fetch_add(1, std::memory_order_relaxed) % 2 == 0, true};
  }

  // A trial took `nanoseconds` for `bytes`. Without a lock: a child forked while another
  // thread held one would never get it.
  void took(bool streaming, std::uint64_t bytes, std::int64_t nanoseconds) noexcept {
    auto& trials = streaming ? streaming_ : plain_;
    auto slot = trials.taken.fetch_add(1, std::memory_order_relaxed);
    if (slot >= kCopyTrials) return;
    trials.nanoseconds_per_byte[slot].store(static_cast<double>(nanoseconds) / static_cast<double>(bytes),
                                            std::memory_order_relaxed);
    // The last trial written decides; acq_rel makes every other trial's value visible to it.
    if (written_.fetch_add(1, std::memory_order_acq_rel) + 1 == 2 * kCopyTrials) {
      state_.store(streaming_.median() <= plain_.median() ? kStreaming : kPlain, std::memory_order_relaxed);
    }
  }

  // In-place writers, whose copies are not timed: streaming until measured otherwise.
  bool streaming() const noexcept { return state_.load(std::memory_order_relaxed) != kPlain; }
  const char* name() const noexcept {
    switch (state_.load(std::memory_order_relaxed)) {
      case kStreaming:
        return "streaming";
      case kPlain:
        return "memcpy";
      default:
        return "measuring";
    }
  }

 private:
  enum State : int { kMeasuring, kStreaming, kPlain };

  struct Trials {
    std::atomic<unsigned> taken{0};
    std::array<std::atomic<double>, kCopyTrials> nanoseconds_per_byte{};
    double median() const {
      std::array<double, kCopyTrials> values{};
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = nanoseconds_per_byte[i].load(std::memory_order_relaxed);
      std::sort(values.begin(), values.end());
      return (values[(kCopyTrials - 1) / 2] + values[kCopyTrials / 2]) / 2;
    }
  };

  LargeCopies() {
    const char* asked = std::getenv("TENSORBUCKET_LARGE_COPIES");
    std::string_view routine = asked != nullptr ? asked : "";
    if (routine == "streaming") state_ = kStreaming;
    if (routine == "memcpy") state_ = kPlain;
  }

  std::atomic<int> state_{kMeasuring};
  std::atomic<unsigned> turns_{0};
  Trials streaming_, plain_;
  std::atomic<int> written_{0};  // trials of both
};

}  // namespace

const char* large_copies() noexcept { return LargeCopies::get().name(); }

bool streams(std::span<const std::byte> payload) noexcept {
  return large_and_aligned(payload) && LargeCopies::get().streaming();
}

void copy_bytes(std::byte* destination, const std::byte* source, std::size_t bytes,
                bool streaming) noexcept {
#if defined(__SSE2__)
  if (streaming) {
    std::size_t done = 0;
    for (; done + 64 <= bytes; done += 64) {
      auto* from = reinterpret_cast<const __m128i*>(source + done);
      auto* to = reinterpret_cast<__m128i*>(destination + done);
      __m128i a = _mm_loadu_si128(from), b = _mm_loadu_si128(from + 1);
      __m128i c = _mm_loadu_si128(from + 2), d = _mm_loadu_si128(from + 3);
      _mm_stream_si128(to, a);
      _mm_stream_si128(to + 1, b);
      _mm_stream_si128(to + 2, c);
      _mm_stream_si128(to + 3, d);
    }
    std::memcpy(destination + done, source + done, bytes - done);
    return;
  }
#endif
  static_cast<void>(streaming);
  std::memcpy(destination, source, bytes);
}

void finish_streaming() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

NearEnd::NearEnd(std::uint64_t total, std::chrono::nanoseconds lead, std::function<void()> wake)
    : total_(total),
      lead_(lead),
      wake_(std::move(wake)),
      next_look_(wake_ ? kPaceBytes : std::numeric_limits<std::uint64_t>::max()) {}

void NearEnd::look() {
  next_look_ = copied_ + kPaceBytes;
  auto elapsed = std::chrono::steady_clock::now() - start_;
  auto left = static_cast<double>(total_ - std::min(copied_, total_)) / static_cast<double>(copied_);
  if (left * static_cast<double>(elapsed.count()) <= static_cast<double>(std::chrono::nanoseconds(lead_).count())) {
    next_look_ = std::numeric_limits<std::uint64_t>::max();
    wake_();
  }
}

void copy_paced(std::byte* destination, const std::byte* source, std::size_t bytes, bool streaming,
                NearEnd& near_end) noexcept {
  near_end.starting();
  for (std::size_t done = 0; done < bytes;) {
    auto piece = std::min<std::size_t>(bytes - done, NearEnd::kPaceBytes);
    copy_bytes(destination + done, source + done, piece, streaming);
    near_end.copied(piece);
    done += piece;
  }
}

void pack(const BucketBuilder& bucket, std::span<std::byte> payload, NearEnd* near_end) {
  const auto& entries = bucket.manifest().entries;
  auto sources = bucket.entry_sources();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (sources[i] == nullptr && entries[i].byte_length != 0) {
      text::fail(ErrorCode::InvalidArgument, "entry ", text::Quoted{entries[i].name},
                 " was declared for in-place writing; write it through entry_spans() instead");
    }
  }
  auto payload_bytes = bucket.payload_bytes();
  // Streaming needs 16-byte aligned destinations: entries are 256-aligned from the payload.
  auto turn = large_and_aligned(payload.first(payload_bytes)) ? LargeCopies::get().next() : LargeCopies::Turn{};
  bool streaming = turn.streaming;
  auto started = turn.trial ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  std::uint64_t written = 0;  // everything before this is packed or zeroed
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto& entry = entries[i];
    if (entry.byte_offset > written) std::memset(payload.data() + written, 0, entry.byte_offset - written);
    if (sources[i] != nullptr && near_end != nullptr) {
      copy_paced(payload.data() + entry.byte_offset, sources[i], entry.byte_length, streaming, *near_end);
    } else if (sources[i] != nullptr) {
      copy_bytes(payload.data() + entry.byte_offset, sources[i], entry.byte_length, streaming);
    }
    written = entry.byte_offset + entry.byte_length;
  }
  std::memset(payload.data() + written, 0, payload_bytes - written);
  if (streaming) finish_streaming();
  if (turn.trial) {
    auto took = std::chrono::steady_clock::now() - started;
    LargeCopies::get().took(streaming, payload_bytes, std::chrono::duration_cast<std::chrono::nanoseconds>(took).count());
  }
}

}  // namespace tensorbucket::detail
