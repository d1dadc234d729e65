#include "copy.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

#include "base/text.hpp"

namespace tensorbucket::detail {

namespace {

bool large(std::span<const std::byte> payload) noexcept { return payload.size() >= kStreamingBytes; }

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
  // Whether the environment asked for memcpy, which no payload then streams.
  bool memcpy_asked() const noexcept { return memcpy_asked_; }
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
    memcpy_asked_ = routine == "memcpy";
  }

  bool memcpy_asked_ = false;

  std::atomic<int> state_{kMeasuring};
  std::atomic<unsigned> turns_{0};
  Trials streaming_, plain_;
  std::atomic<int> written_{0};  // trials of both
};

#if defined(__x86_64__)
// Non-temporal copies of `lines` 64-byte lines from each of `pages` 4 KiB blocks (counted from
// `to`), a few lines of every block in turn: reading several pages at once keeps more of them in
// flight from memory than one sequential stream does. How many of each: on the Intel Xeon hosts
// of issue 43, 8 pages in turn, 4 lines (256 bytes) of each, wrote 256 MiB at 0.87-0.96x glibc's
// memcpy on one (Ice Lake) where a line of each took 1.21-1.34x; on the other (Emerald Rapids) a
// line of each took 0.92x, one stream of SSE2 stores 1.2x. `to` is 64-byte aligned. One routine
// per vector width.
using StreamLines = void (*)(std::byte* to, const std::byte* from, std::size_t lines, std::size_t pages);
constexpr std::size_t kPage = 4096, kLine = 64, kPagesInTurn = 8, kLinesInTurn = 4;

[[gnu::target("avx512f")]] void stream_lines_avx512(std::byte* to, const std::byte* from, std::size_t lines,
                                                    std::size_t pages) {
  for (std::size_t line = 0; line < lines * kLine; line += kLinesInTurn * kLine) {
    auto end = std::min(lines * kLine, line + kLinesInTurn * kLine);
    for (std::size_t page = 0; page < pages * kPage; page += kPage) {
      for (auto at = page + line; at < page + end; at += kLine) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(to + at), _mm512_loadu_si512(from + at));
      }
    }
  }
}

[[gnu::target("avx2")]] void stream_lines_avx2(std::byte* to, const std::byte* from, std::size_t lines,
                                               std::size_t pages) {
  for (std::size_t line = 0; line < lines * kLine; line += kLinesInTurn * kLine) {
    auto end = std::min(lines * kLine, line + kLinesInTurn * kLine);
    for (std::size_t page = 0; page < pages * kPage; page += kPage) {
      for (auto at = page + line; at < page + end; at += kLine) {
        auto* source = reinterpret_cast<const __m256i*>(from + at);
        auto* destination = reinterpret_cast<__m256i*>(to + at);
        __m256i low = _mm256_loadu_si256(source), high = _mm256_loadu_si256(source + 1);
        _mm256_stream_si256(destination, low);
        _mm256_stream_si256(destination + 1, high);
      }
    }
  }
}

void stream_lines_sse2(std::byte* to, const std::byte* from, std::size_t lines, std::size_t pages) {
  for (std::size_t line = 0; line < lines * kLine; line += kLinesInTurn * kLine) {
    auto end = std::min(lines * kLine, line + kLinesInTurn * kLine);
    for (std::size_t page = 0; page < pages * kPage; page += kPage) {
      for (auto at = page + line; at < page + end; at += kLine) {
        auto* source = reinterpret_cast<const __m128i*>(from + at);
        auto* destination = reinterpret_cast<__m128i*>(to + at);
        __m128i a = _mm_loadu_si128(source), b = _mm_loadu_si128(source + 1);
        __m128i c = _mm_loadu_si128(source + 2), d = _mm_loadu_si128(source + 3);
        _mm_stream_si128(destination, a);
        _mm_stream_si128(destination + 1, b);
        _mm_stream_si128(destination + 2, c);
        _mm_stream_si128(destination + 3, d);
      }
    }
  }
}

struct Routine {
  std::string_view name;
  StreamLines lines;
  bool runs;  // on this CPU (and this OS: __builtin_cpu_supports checks that it saves the registers)
};

// Widest first.
const std::array<Routine, 3>& routines() noexcept {
  static const std::array<Routine, 3> all{Routine{"avx512", stream_lines_avx512, __builtin_cpu_supports("avx512f") != 0},
                                          Routine{"avx2", stream_lines_avx2, __builtin_cpu_supports("avx2") != 0},
                                          Routine{"sse2", stream_lines_sse2, true}};
  return all;
}

void stream(StreamLines stream_lines, std::byte* destination, const std::byte* source, std::size_t bytes) noexcept {
  // Up to the destination's first 64-byte boundary with ordinary stores (none where the
  // destination is 64-byte aligned, as every entry of a slot's page-aligned payload is).
  auto head = std::min(bytes, (kLine - reinterpret_cast<std::uintptr_t>(destination) % kLine) % kLine);
  if (head != 0) std::memcpy(destination, source, head);
  std::size_t done = head;
  while (bytes - done >= kPage) {
    auto pages = std::min(kPagesInTurn, (bytes - done) / kPage);
    stream_lines(destination + done, source + done, kPage / kLine, pages);
    done += pages * kPage;
  }
  auto lines = (bytes - done) / kLine;
  stream_lines(destination + done, source + done, lines, 1);
  done += lines * kLine;
  if (done != bytes) std::memcpy(destination + done, source + done, bytes - done);
}

StreamLines widest() noexcept {
  static const StreamLines lines = [] {
    for (const auto& routine : routines()) {
      if (routine.runs) return routine.lines;
    }
    return stream_lines_sse2;
  }();
  return lines;
}
#endif

}  // namespace

const char* large_copies() noexcept { return LargeCopies::get().name(); }

std::uint64_t streaming_from() noexcept {
  static const std::uint64_t from = [] {
    auto level2 = ::sysconf(_SC_LEVEL2_CACHE_SIZE);
    return level2 > 0 ? std::min<std::uint64_t>(static_cast<std::uint64_t>(level2) / 8 * 3, kStreamingBytes)
                      : kStreamingBytes;
  }();
  return from;
}

bool streams(std::span<const std::byte> payload) noexcept {
  if (large(payload)) return LargeCopies::get().streaming();
  return payload.size() >= streaming_from() && !LargeCopies::get().memcpy_asked();
}

void zero_bytes(std::byte* destination, std::size_t bytes, bool streaming) noexcept {
  static constexpr std::array<std::byte, 4096> kZeros{};  // padding is under 256 bytes
  if (streaming && bytes <= kZeros.size()) return copy_bytes(destination, kZeros.data(), bytes, true);
  std::memset(destination, 0, bytes);
}

void copy_bytes(std::byte* destination, const std::byte* source, std::size_t bytes,
                bool streaming) noexcept {
#if defined(__x86_64__)
  if (streaming) return stream(widest(), destination, source, bytes);
#endif
  static_cast<void>(streaming);
  std::memcpy(destination, source, bytes);
}

std::vector<std::string_view> streaming_routines() {
  std::vector<std::string_view> names;
#if defined(__x86_64__)
  for (const auto& routine : routines()) {
    if (routine.runs) names.push_back(routine.name);
  }
#endif
  return names;
}

void stream_with(std::string_view routine, std::byte* destination, const std::byte* source, std::size_t bytes) {
#if defined(__x86_64__)
  for (const auto& known : routines()) {
    if (known.name == routine && known.runs) return stream(known.lines, destination, source, bytes);
  }
#endif
  text::fail(ErrorCode::InvalidArgument, "no streaming routine ", text::Quoted{routine}, " on this CPU");
}

void finish_streaming() noexcept {
#if defined(__x86_64__)
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

// Without streaming, a store to a line that is not in cache waits for its read for ownership.
// Asking for the next lines a little ahead of the copy lets those reads overlap the copies
// before them. Into a slot last written two publishes ago (out of L2), 1000 x 1 KiB packed in
// 0.9x the time alone, 0.96x within a whole publish(); from 4 KiB entries on it made no
// difference, and asking for a whole large entry before copying it is slower (bench/RESULTS.md,
// issue 43). Entry offsets are multiples of kPayloadAlignment (256), so of a line.
constexpr std::uint64_t kAskAhead = 2048;

void EntryCopier::copy(std::span<std::byte> to, const std::byte* from) noexcept {
  if (!streaming_ && to.size() <= kAskAhead) {  // larger ones gained nothing, and 256 MiB lost 1.8x
    auto offset = static_cast<std::uint64_t>(to.data() - payload_.data());
    auto until = std::min<std::uint64_t>(offset + to.size() + kAskAhead, payload_.size());
    for (asked_ = std::max(asked_, offset); asked_ < until; asked_ += 64) {
      __builtin_prefetch(payload_.data() + asked_, 1, 3);
    }
  }
  if (near_end_ != nullptr && to.size() > NearEnd::kPaceBytes) return copy_paced(to.data(), from, to.size(), streaming_, *near_end_);
  // One piece, without a call per entry when not streaming: 1000 small entries add up.
  if (near_end_ != nullptr) near_end_->starting();
  if (streaming_) {
    copy_bytes(to.data(), from, to.size(), true);
  } else {
    std::memcpy(to.data(), from, to.size());
  }
  if (near_end_ != nullptr) near_end_->copied(to.size());
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
  payload = payload.first(payload_bytes);
  auto turn = large(payload) ? LargeCopies::get().next() : LargeCopies::Turn{streams(payload), false};
  bool streaming = turn.streaming;
  auto started = turn.trial ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  EntryCopier copier(payload, streaming, near_end);
  auto zero = [&](std::uint64_t offset, std::uint64_t bytes) { zero_bytes(payload.data() + offset, bytes, streaming); };
  walk_payload(entries, payload_bytes, zero, [&](std::size_t i) {
    // Null: declared for in-place writing and empty (refused above otherwise).
    if (sources[i] != nullptr) copier.copy(payload.subspan(entries[i].byte_offset, entries[i].byte_length), sources[i]);
  });
  if (streaming) finish_streaming();
  if (turn.trial) {
    auto took = std::chrono::steady_clock::now() - started;
    LargeCopies::get().took(streaming, payload_bytes, std::chrono::duration_cast<std::chrono::nanoseconds>(took).count());
  }
}

}  // namespace tensorbucket::detail
