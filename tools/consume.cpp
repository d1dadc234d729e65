#include <cstdio>
#include <ctime>

#include "commands.hpp"
#include "exit_codes.hpp"

namespace tensorbucket::cli {
namespace {

int stopped() {
  std::fprintf(stderr, "tbucket: stopped by signal %d; channel left\n", stop_signal());
  return 128 + stop_signal();
}

std::uint64_t monotonic_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(now.tv_nsec);
}

}  // namespace

int run_consume(const ConsumeOptions& options) {
  install_stop_handlers();
  std::optional<Subscriber> subscriber;
  with_deadline(options.timeout_ms, [&](auto slice) {
    try {
      std::optional<PayloadLocation::Kind> expected;
      if (!options.device.empty()) expected = PayloadLocation::parse(options.device).kind;
      subscriber.emplace(Subscriber::attach(options.channel, slice, expected));
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ChannelMissing) throw;  // not there yet
    }
    return subscriber.has_value();
  });
  if (stop_signal() != 0) return stopped();
  if (!subscriber) {
    throw Error(ErrorCode::ChannelMissing, "channel '" + options.channel + "' did not appear within " +
                                               std::to_string(options.timeout_ms) + " ms");
  }
  for (std::uint64_t received = 0; options.buckets == 0 || received < options.buckets; ++received) {
    std::optional<ReceivedBucket> bucket;
    try {
      with_deadline(options.timeout_ms, [&](auto slice) {
        bucket = subscriber->next(slice);
        return bucket.has_value();
      });
    } catch (const Error& e) {
      if (e.code() == ErrorCode::ProducerGone && options.buckets == 0) return kOk;
      throw;
    }
    if (stop_signal() != 0) return stopped();
    if (!bucket) {
      std::fprintf(stderr, "tbucket: Timeout: no bucket arrived on '%s' within %llu ms\n",
                   options.channel.c_str(), static_cast<unsigned long long>(options.timeout_ms));
      return kTimeout;
    }
    auto latency_us = static_cast<double>(monotonic_ns() - bucket->publish_start_ns()) / 1000;
    const auto& view = bucket->view();
    std::string problem;
    if (options.verify && view.location().on_host()) problem = check_bucket(view, options.seed, bucket->sequence());
    if (options.verify && !view.location().on_host()) {
      problem = check_bucket(view, options.seed, bucket->sequence(), bucket->copy_to_host());
    }
    std::uint64_t bytes = 0;
    for (std::size_t i = 0; i < view.size(); ++i) bytes += view[i].bytes.size();
    if (options.json) {
      std::printf("{\"index\":%llu,\"version\":%llu,\"entries\":%zu,\"bytes\":%llu,\"latency_us\":%.1f,\"ok\":%s}\n",
                  static_cast<unsigned long long>(bucket->sequence()),
                  static_cast<unsigned long long>(view.version()), view.size(),
                  static_cast<unsigned long long>(bytes), latency_us, problem.empty() ? "true" : "false");
    } else {
      std::printf("bucket %llu: version %llu, %zu entries, %llu bytes, %.1f us%s\n",
                  static_cast<unsigned long long>(bucket->sequence()),
                  static_cast<unsigned long long>(view.version()), view.size(),
                  static_cast<unsigned long long>(bytes), latency_us,
                  options.verify ? (problem.empty() ? ", verified" : ", MISMATCH") : "");
    }
    std::fflush(stdout);
    if (!problem.empty()) {
      std::fprintf(stderr, "tbucket: ContentMismatch: %s\n", problem.c_str());
      return kVerificationFailed;
    }
  }
  return kOk;
}

}  // namespace tensorbucket::cli
