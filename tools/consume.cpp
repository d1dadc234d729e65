#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <optional>
#include <span>
#include <string>

#include "commands.hpp"
#include "exit_codes.hpp"
#include "progress.hpp"

namespace tensorbucket::cli {
namespace {

// What one line reports: a bucket, or a whole update of them.
struct Line {
  std::uint64_t sequence = 0;  // of the (first) bucket
  std::uint64_t version = 0;
  std::uint64_t incarnation = 0;
  std::size_t buckets = 0;
  std::size_t entries = 0;
  std::uint64_t bytes = 0;
  double latency_us = 0;  // from the start of publish of the (first) bucket
  std::string problem;    // what --verify found wrong
};

void add(Line& line, const ReceivedBucket& bucket, const ConsumeOptions& options) {
  const auto& view = bucket.view();
  if (line.buckets++ == 0) {
    line.sequence = bucket.sequence();
    line.version = view.version();
    line.incarnation = bucket.incarnation();
    line.latency_us = static_cast<double>(monotonic_ns() - bucket.publish_start_ns()) / 1000;
  }
  line.entries += view.size();
  for (std::size_t i = 0; i < view.size(); ++i) line.bytes += view[i].bytes.size();
  if (!options.verify || !line.problem.empty()) return;
  // The workload bucket its identity names: a relayed channel numbers its buckets anew.
  auto index = view.version() * view.bucket_count() + view.bucket_index();
  line.problem = view.location().on_host() ? check_bucket(view, options.seed, index)
                                           : check_bucket(view, options.seed, index, bucket.copy_to_host());
}

void print(const Line& line, const ConsumeOptions& options) {
  const char* ok = line.problem.empty() ? "true" : "false";
  auto u = [](std::uint64_t value) { return static_cast<unsigned long long>(value); };
  if (options.json && options.updates) {
    std::printf("{\"version\":%llu,\"buckets\":%zu,\"first_index\":%llu,\"incarnation\":%llu,\"entries\":%zu,"
                "\"bytes\":%llu,\"latency_us\":%.1f,\"ok\":%s}\n",
                u(line.version), line.buckets, u(line.sequence), u(line.incarnation), line.entries, u(line.bytes),
                line.latency_us, ok);
  } else if (options.json) {
    std::printf("{\"index\":%llu,\"version\":%llu,\"entries\":%zu,\"bytes\":%llu,\"latency_us\":%.1f,\"ok\":%s}\n",
                u(line.sequence), u(line.version), line.entries, u(line.bytes), line.latency_us, ok);
  } else {
    auto what = options.updates ? "update " + std::to_string(line.version) + ": " + std::to_string(line.buckets) +
                                      " buckets from " + std::to_string(line.sequence) + ", "
                                : "bucket " + std::to_string(line.sequence) + ": version " +
                                      std::to_string(line.version) + ", ";
    std::printf("%s%zu entries, %llu bytes, %.1f us%s\n", what.c_str(), line.entries, u(line.bytes),
                line.latency_us, options.verify ? (line.problem.empty() ? ", verified" : ", MISMATCH") : "");
  }
  std::fflush(stdout);
}

}  // namespace

int run_consume(const ConsumeOptions& options) {
  install_stop_handlers();
  SubscribeOptions subscribe{.whole_updates = options.updates, .follow_restarts = options.follow};
  if (!options.device.empty()) subscribe.expected_location = PayloadLocation::parse(options.device).kind;
  auto subscriber =
      unless_stopped([&] { return Subscriber::attach(options.channel, until_stopped(options.timeout_ms), subscribe); });
  if (stop_signal() != 0) return stopped("channel left");  // else attached
  // Lines printed to a terminal show the progress themselves.
  Progress progress("consume", !options.quiet && ::isatty(STDOUT_FILENO) == 0);
  for (std::uint64_t received = 0; options.buckets == 0 || received < options.buckets; ++received) {
    Line line;
    try {
      auto deadline = until_stopped(options.timeout_ms);
      if (options.updates) {
        auto update = subscriber->next_update(deadline);
        for (const auto& bucket : update ? update->buckets() : std::span<const ReceivedBucket>{}) add(line, bucket, options);
      } else if (auto bucket = subscriber->next(deadline)) {
        add(line, *bucket, options);
      }
    } catch (const Error& e) {
      progress.finish();
      if (e.code() != ErrorCode::ProducerGone) throw;
      if (!options.follow) {
        if (options.buckets == 0) return kOk;
        throw;
      }
      std::fprintf(stderr, "tbucket: %s; waiting for its next producer\n", e.what());
      --received;
      continue;
    }
    progress.add(line.buckets, line.bytes);
    if (stop_signal() != 0 || line.buckets == 0 || !line.problem.empty()) progress.finish();
    if (stop_signal() != 0) return stopped("channel left");
    if (line.buckets == 0) {
      return timed_out("no ", options.updates ? "whole update" : "bucket", " arrived on ", text::Quoted{options.channel},
                       " within ", options.timeout_ms, " ms");
    }
    print(line, options);
    if (!line.problem.empty()) {
      std::fprintf(stderr, "tbucket: ContentMismatch: %s\n", line.problem.c_str());
      return kVerificationFailed;
    }
  }
  return kOk;
}

}  // namespace tensorbucket::cli
