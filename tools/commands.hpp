// The tbucket subcommands. Each returns an exit status from exit_codes.hpp and prints
// errors as one line on stderr; tbucket.cpp parses the command line into these options.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/text.hpp"
#include "exit_codes.hpp"
#include "tensorbucket/tensorbucket.hpp"
#include "workload.hpp"

namespace tensorbucket::cli {

struct ProduceOptions {
  std::string channel;
  Workload workload;
  std::uint32_t slots = 2;
  std::uint32_t consumers = 1;  // min_consumers
  std::uint32_t max_consumers = 8;
  std::string policy = "block";  // or latest
  bool checksum = false;
  bool in_place = false;
  std::string device = "host";  // where the payloads live: host, cuda, cuda:N
  std::uint64_t interval_ms = 0;
  std::uint64_t timeout_ms = 10000;
  bool quiet = false;  // no progress line, even on a terminal
};

struct ConsumeOptions {
  std::string channel;
  std::uint64_t buckets = 0;  // 0: until the producer is gone; updates with `updates`
  std::uint64_t seed = 1;
  bool verify = false;
  bool updates = false;  // whole updates (next_update), one line each
  bool follow = false;   // go on with the channel's next producer after one is gone
  std::string device;  // empty: wherever the channel has them; else host, cuda, cuda:N
  std::uint64_t timeout_ms = 10000;
  bool json = false;
  bool quiet = false;  // no progress line, even on a terminal
};

struct InspectOptions {
  std::string channel;
  bool json = false;
  bool watch = false;  // redraw every interval_ms until the channel is gone or a signal
  std::uint64_t interval_ms = 1000;
};

struct ListOptions {
  bool json = false;
};

struct RemoveOptions {
  std::string channel;
  bool force = false;
};

struct DemoOptions {
  std::uint32_t layers = 8;
  std::uint64_t seed = 1;
};

struct BenchOptions {
  bool json = false;
  std::uint32_t repeats = 50;
  std::string device = "host";  // cuda:N: the device channel's figures instead
  std::uint64_t tensor_bytes = 0;  // not 0: only the copy and in-place figures, 1000 tensors of this size
};

// The channel a command creates and publishes into, as publish-file and relay take it
// (produce's counts its buckets per update in its workload).
struct ChannelOptions {
  std::uint32_t slots = 2;
  std::uint32_t consumers = 1;  // min_consumers
  std::uint32_t max_consumers = 8;
  std::uint32_t update_buckets = 1;
  std::string policy = "block";  // or latest
  bool checksum = false;
  std::string device = "host";  // host, cuda, cuda:N

  PublisherOptions publisher() const {
    return {.slots = slots,
            .max_consumers = max_consumers,
            .min_consumers = consumers,
            .payload_checksum = checksum,
            .location = PayloadLocation::parse(device),
            .policy = parse_overflow_policy(policy),
            .update_buckets = update_buckets};
  }
};

// `tbucket publish-file` and `tbucket save`: safetensors files in and out (files.cpp).
struct PublishFileOptions {
  std::string channel;
  std::vector<std::string> files;
  std::uint64_t bucket_bytes = 0;  // 0: one bucket per file
  std::optional<std::uint64_t> version;  // none: the first file's tensorbucket.version, else 0
  ChannelOptions created;
  std::uint64_t timeout_ms = 10000;
};

struct SaveOptions {
  std::string channel;
  std::string out;
  std::uint64_t updates = 1;
  bool per_bucket = false;  // one file per bucket instead of one per update
  std::uint64_t timeout_ms = 10000;
};

// `tbucket serve` and `tbucket relay` (built where UCX is: network.cpp).
struct ServeCommandOptions {
  std::string channel;
  std::string listen;  // ADDRESS:PORT, no default
  std::string token_file;
  std::uint64_t peer_timeout_ms = 10000;
  std::uint32_t max_peers = 16;
  std::uint64_t timeout_ms = 10000;  // for the channel to appear
};

struct RelayOptions {
  std::string connect;  // HOST:PORT
  std::string channel;  // the served channel's name
  std::string as;       // the local channel's; empty: the same name
  std::string token_file;
  ChannelOptions local;
  std::uint64_t timeout_ms = 10000;       // a local publish; also the first connect
  std::uint64_t idle_timeout_ms = 5000;   // silence after which the link counts as dead
  std::uint64_t max_bucket_bytes = 64ull << 30;
  std::uint64_t buckets = 0;  // stop after relaying this many; 0: until a signal
  bool quiet = false;
};

int run_publish_file(const PublishFileOptions& options);
int run_save(const SaveOptions& options);
int run_serve(const ServeCommandOptions& options);
int run_relay(const RelayOptions& options);

int run_produce(const ProduceOptions& options);
int run_consume(const ConsumeOptions& options);
int run_inspect(const InspectOptions& options);
int run_list(const ListOptions& options);
int run_remove(const RemoveOptions& options);
int run_demo(const DemoOptions& options);
int run_bench(const BenchOptions& options);

// SIGINT / SIGTERM (and SIGPIPE, unless ignored when inherited) set a flag that the
// long-running commands poll between bounded waits, so they close the channel (removing its
// segments) before exiting.
void install_stop_handlers();
int stop_signal();  // 0 while running

// Says on stderr that a stop signal ended the command ("tbucket: stopped by signal 15; `what`")
// and returns the status for it, 128 + the signal.
int stopped(std::string_view what = {});

// Says on stderr "tbucket: Timeout: " and the message `parts` make, and returns kTimeout.
template <class... Parts>
int timed_out(const Parts&... parts) {
  std::fprintf(stderr, "tbucket: Timeout: %s\n", text::message(parts...).c_str());
  return kTimeout;
}

// The timeout of a publisher's drain(): what it waited for.
inline int not_drained(const Publisher& publisher, std::uint64_t timeout_ms) {
  return timed_out("consumers did not release every bucket of ", text::Quoted{publisher.channel()}, " within ",
                   timeout_ms, " ms; waiting for ", publisher.waiting_for());
}

// An option's milliseconds as a timeout: from ~32 years (UINT64_MAX included), no limit.
inline std::chrono::milliseconds as_timeout(std::uint64_t timeout_ms) {
  return std::chrono::milliseconds(std::min<std::uint64_t>(timeout_ms, std::chrono::milliseconds::max().count()));
}

// A wait of `timeout_ms` (UINT64_MAX, the default: no limit) that a stop signal interrupts.
inline Deadline until_stopped(std::uint64_t timeout_ms = UINT64_MAX) {
  return Deadline::after(as_timeout(timeout_ms)).unless([] { return stop_signal() != 0; });
}

// Sleeps `interval_ms`, or until a stop signal.
inline void pause(std::uint64_t interval_ms) {
  auto deadline = until_stopped(interval_ms);
  for (auto now = Deadline::Clock::now(); !deadline.passed(now) && !deadline.interrupted(now);
       now = Deadline::Clock::now()) {
    std::this_thread::sleep_for(deadline.next_sleep(Deadline::kAskEvery, now));
  }
}

// What attach() or create() returns; nothing when a stop signal interrupted its wait for a
// producer (ChannelMissing then) or for another process removing a dead one's leftovers
// (ChannelExists).
template <class Open>
auto unless_stopped(Open&& open) -> std::optional<decltype(open())> {
  try {
    return open();
  } catch (const Error& e) {
    if ((e.code() != ErrorCode::ChannelMissing && e.code() != ErrorCode::ChannelExists) || stop_signal() == 0) throw;
    return std::nullopt;
  }
}

// How long a new channel waits for another process removing a dead producer's leftovers
// under its name (Publisher::create), unless a stop signal comes first.
inline Deadline removal_wait() { return until_stopped(10'000); }

}  // namespace tensorbucket::cli
