#include "progress.hpp"

#include <unistd.h>

#include <cstdio>
#include <utility>

namespace tensorbucket::cli {

namespace {
constexpr auto kRedraw = std::chrono::seconds(1);
}  // namespace

Progress::Progress(std::string command, bool wanted)
    : command_(std::move(command)),
      shown_(wanted && ::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void Progress::finish() {
  if (!drawn_) return;
  draw();
  std::fputc('\n', stderr);
  drawn_ = false;
}

void Progress::add(std::uint64_t buckets, std::uint64_t bytes) {
  buckets_ += buckets;
  bytes_ += bytes;
  if (!shown_) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < kRedraw) return;
  last_draw_ = now;
  draw();
}

void Progress::draw() {
  auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  double mib = static_cast<double>(bytes_) / (1 << 20);
  // \r and erase-to-end: the same line, redrawn.
  std::fprintf(stderr, "\rtbucket %s: %llu buckets, %.1f MiB in %.0f s (%.1f buckets/s, %.1f MiB/s)\033[K",
               command_.c_str(), static_cast<unsigned long long>(buckets_), mib, seconds,
               seconds > 0 ? static_cast<double>(buckets_) / seconds : 0.0, seconds > 0 ? mib / seconds : 0.0);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace tensorbucket::cli
