#include "copy.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstring>
#include <limits>
#include <utility>

#include "text.hpp"

namespace tensorbucket::detail {

bool streams(std::span<const std::byte> payload) noexcept {
  return payload.size() >= kStreamingBytes &&
         reinterpret_cast<std::uintptr_t>(payload.data()) % 16 == 0;
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
  bool streaming = streams(payload.first(payload_bytes));
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
}

}  // namespace tensorbucket::detail
