// The tbucket subcommands. Each returns an exit status from exit_codes.hpp and prints
// errors as one line on stderr; tbucket.cpp parses the command line into these options.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "workload.hpp"

namespace tensorbucket::cli {

struct ProduceOptions {
  std::string channel;
  Workload workload;
  std::uint32_t slots = 2;
  std::uint32_t consumers = 1;  // min_consumers
  bool checksum = false;
  bool in_place = false;
  std::uint64_t interval_ms = 0;
  std::uint64_t timeout_ms = 10000;
};

struct ConsumeOptions {
  std::string channel;
  std::uint64_t buckets = 0;  // 0: until the producer is gone
  std::uint64_t seed = 1;
  bool verify = false;
  std::uint64_t timeout_ms = 10000;
  bool json = false;
};

struct InspectOptions {
  std::string channel;
  bool json = false;
};

struct DemoOptions {
  int layers = 8;
  std::uint64_t seed = 1;
};

struct BenchOptions {
  bool json = false;
  int repeats = 50;
};

int run_produce(const ProduceOptions& options);
int run_consume(const ConsumeOptions& options);
int run_inspect(const InspectOptions& options);
int run_demo(const DemoOptions& options);
int run_bench(const BenchOptions& options);

// SIGINT / SIGTERM set a flag that the long-running commands poll between bounded waits, so
// they close the channel (removing its segments) before exiting.
void install_stop_handlers();
int stop_signal();  // 0 while running

// Longest single wait, so a stop signal is noticed promptly.
constexpr auto kWaitSlice = std::chrono::milliseconds(50);

// Retries `attempt(slice)` until it succeeds, `timeout_ms` passes, or a stop signal arrives.
// A timeout past what the clock can hold waits without limit.
template <class Attempt>
bool with_deadline(std::uint64_t timeout_ms, Attempt&& attempt) {
  using Clock = std::chrono::steady_clock;
  auto now = Clock::now();
  auto room = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  auto deadline = timeout_ms >= static_cast<std::uint64_t>(room.count())
                      ? Clock::time_point::max()
                      : now + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (attempt(std::clamp(left, std::chrono::milliseconds(0), kWaitSlice))) return true;
    if (stop_signal() != 0 || Clock::now() >= deadline) return false;
  }
}

}  // namespace tensorbucket::cli
