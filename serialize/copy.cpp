#include "copy.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstring>

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

}  // namespace tensorbucket::detail
