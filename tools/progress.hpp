// Progress of a long produce or consume, for a person watching a terminal: one line on stderr,
// redrawn at most once a second (buckets, bytes, and their rates), ended when the run ends.
// Silent where nobody watches (stderr not a terminal) and with --quiet, so logs and scripts
// see only the results.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace tensorbucket::cli {

class Progress {
 public:
  // `command` names the line ("produce"); `wanted`: the caller's own reasons (not --quiet).
  Progress(std::string command, bool wanted);
  ~Progress() { finish(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Counts `buckets` more buckets of `bytes` in all; redraws when a second has passed.
  void add(std::uint64_t buckets, std::uint64_t bytes);
  // Draws the line a last time and ends it, before anything else is printed on stderr (a
  // later add() draws another).
  void finish();

 private:
  void draw();

  std::string command_;
  bool shown_;
  bool drawn_ = false;
  std::uint64_t buckets_ = 0, bytes_ = 0;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace tensorbucket::cli
