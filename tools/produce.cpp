#include <chrono>
#include <csignal>
#include <optional>
#include <cstdio>
#include <thread>

#include "commands.hpp"
#include "exit_codes.hpp"
#include "progress.hpp"

namespace tensorbucket::cli {
namespace {

using Clock = std::chrono::steady_clock;

// The options' bucket within the format's payload limit: a usage error, not a bad bucket.
void check_payload_limit(const Workload& workload) {
  auto entry_bytes = (tensor_bytes(workload) + kPayloadAlignment - 1) / kPayloadAlignment * kPayloadAlignment;
  // At most 2^20 tensors of 2^40 bytes (the options' ranges): no overflow.
  auto payload_bytes = workload.tensors * entry_bytes;
  if (payload_bytes > kMaxPayloadBytes) {
    text::fail(ErrorCode::InvalidArgument, workload.tensors, " tensors of ", workload.tensor_bytes, " bytes make a ",
               payload_bytes, "-byte payload, past the limit of ", kMaxPayloadBytes);
  }
}

}  // namespace

int run_produce(const ProduceOptions& options) {
  install_stop_handlers();
  const auto& workload = options.workload;
  check_payload_limit(workload);
  auto created = unless_stopped([&] {
    return Publisher::create(options.channel,
                             {.slots = options.slots,
                              .max_consumers = options.max_consumers,
                              .min_consumers = options.consumers,
                              .payload_checksum = options.checksum,
                              .location = PayloadLocation::parse(options.device),
                              .policy = parse_overflow_policy(options.policy),
                              .update_buckets = workload.update_buckets},
                             removal_wait());
  });
  if (!created) return stopped("no channel was created");
  auto& publisher = *created;
  // A device channel's slots are written tensor by tensor from a staging buffer in host
  // memory, copy path or not: a copy from pageable memory has taken its bytes when the call
  // returns, while a bucket's batched copy reads them later in stream order (publish() wants
  // its sources kept until then, and this loop drops each bucket at once).
  bool on_device = !publisher.location().on_host();
  bool in_place = options.in_place || on_device;
  std::vector<std::byte> staging;
  std::optional<SourceBucket> bucket;  // the copy path's: one builder, refilled for each bucket
  if (!in_place) {
    // The copy path makes a private copy of each bucket first. Reserving the first slot
    // (then dropping it: nothing is published) sizes its segment, so that a bucket shared
    // memory cannot hold fails here, before that much memory is allocated for nothing.
    publisher.reserve(make_layout(workload, 0), std::chrono::milliseconds(0));
  }
  std::uint64_t bytes = 0;
  auto start = Clock::now();
  Progress progress("produce", !options.quiet);
  for (std::uint64_t i = 0; i < workload.buckets; ++i) {
    auto bytes_before = bytes;
    bool published = false;
    if (in_place) {
      auto layout = make_layout(workload, i);
      auto reservation = publisher.reserve(layout, until_stopped(options.timeout_ms));
      published = reservation.has_value();
      if (published) {
        for (std::uint32_t t = 0; t < workload.tensors; ++t) {
          if (on_device) {
            staging.resize(reservation->entry_spans()[t].size());
            fill_tensor(staging, workload, i, t);
            reservation->write(t, staging.data());
          } else {
            fill_tensor(reservation->entry_spans()[t], workload, i, t);
          }
        }
        reservation->commit();
        bytes += layout.payload_bytes();
      }
    } else {
      if (bucket) {
        refill_bucket(*bucket, workload, i);
      } else {
        bucket.emplace(make_bucket(workload, i));
      }
      published = publisher.publish(bucket->builder, until_stopped(options.timeout_ms));
      bytes += bucket->builder.payload_bytes();
    }
    progress.add(published ? 1 : 0, bytes - bytes_before);
    if (stop_signal() != 0 || !published) progress.finish();
    if (stop_signal() != 0) return stopped("channel closed");
    if (!published) {
      return timed_out("no slot of channel ", text::Quoted{options.channel}, " came free within ", options.timeout_ms,
                       " ms (bucket ", i, "); waiting for ", publisher.waiting_for());
    }
    if (options.interval_ms != 0) pause(options.interval_ms);
  }
  bool drained = publisher.drain(until_stopped(options.timeout_ms));
  progress.finish();
  if (stop_signal() != 0) return stopped("channel closed");
  if (!drained) return not_drained(publisher, options.timeout_ms);
  auto seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("published %llu buckets, %.1f MiB, on channel '%s' in %.3f s\n",
              static_cast<unsigned long long>(workload.buckets), static_cast<double>(bytes) / (1 << 20),
              options.channel.c_str(), seconds);
  return kOk;
}

namespace {
volatile std::sig_atomic_t received_signal = 0;
extern "C" void on_stop_signal(int signal) { received_signal = signal; }
}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  // A reader of our output gone (`consume | head`, a log collector that died) would kill at
  // once and leave the channel's segments behind: SIGPIPE stops like SIGTERM instead, unless
  // the parent ignores it (a service manager's default), which then writes fail quietly. (UCX
  // sends with MSG_NOSIGNAL, so a peer's reset never raises it; SIGHUP is UCX's, to dump its
  // state, in every command linked with it.)
  struct sigaction inherited {};
  if (sigaction(SIGPIPE, nullptr, &inherited) == 0 && inherited.sa_handler != SIG_IGN) {
    sigaction(SIGPIPE, &action, nullptr);
  }
}

int stop_signal() { return received_signal; }

int stopped(std::string_view what) {
  std::fprintf(stderr, "tbucket: stopped by signal %d%s%.*s\n", stop_signal(), what.empty() ? "" : "; ",
               static_cast<int>(what.size()), what.data());
  return 128 + stop_signal();
}

}  // namespace tensorbucket::cli
