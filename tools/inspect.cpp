#include <algorithm>
#include <cstdio>
#include <ctime>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "commands.hpp"
#include "exit_codes.hpp"

namespace tensorbucket::cli {
namespace {

struct ManifestSummary {
  std::uint64_t bytes = 0;
  std::map<std::string_view, std::size_t> dtypes;
};

ManifestSummary summarize(const Manifest& manifest) {
  ManifestSummary summary;
  for (const auto& entry : manifest.entries) {
    summary.bytes += entry.byte_length;
    ++summary.dtypes[dtype_name(entry.dtype)];
  }
  return summary;
}

// How far a consumer is behind the producer: what was published past its next one (0 when
// a peer wrote a value ahead of the producer's).
std::uint64_t lag(std::uint64_t published, std::uint64_t next) { return published > next ? published - next : 0; }

void print_json(const ChannelInfo& info) {
  std::ostringstream out;
  out << "{\"channel\":\"" << info.channel << "\",\"control_segment\":\"" << info.control_segment
      << "\",\"slots\":" << info.slots << ",\"max_consumers\":" << info.max_consumers
      << ",\"min_consumers\":" << info.min_consumers
      << ",\"payload_checksum\":" << (info.payload_checksum ? "true" : "false")
      << ",\"location\":\"" << info.location << "\",\"policy\":\"" << info.policy
      << "\",\"update_buckets\":" << info.update_buckets
      << ",\"producer\":{\"pid\":" << info.producer_pid << ",\"incarnation\":" << info.producer_incarnation
      << ",\"pid_elsewhere\":" << (info.producer_pid_elsewhere ? "true" : "false")
      << ",\"alive\":" << (info.producer_alive ? "true" : "false") << "},\"closed\":"
      << (info.closed ? "true" : "false") << ",\"published\":" << info.published << ",\"updates\":" << info.updates
      << ",\"slot_states\":[";
  for (std::size_t s = 0; s < info.slot_states.size(); ++s) {
    const auto& slot = info.slot_states[s];
    out << (s ? "," : "") << "{\"slot\":" << s << ",\"generation\":" << slot.generation
        << ",\"bucket\":" << (slot.bucket ? std::to_string(*slot.bucket) : "null")
        << ",\"release_count\":" << slot.release_count << ",\"segment\":\"" << slot.segment
        << "\",\"segment_bytes\":" << slot.segment_bytes << ",\"epoch\":" << slot.epoch
        << ",\"payload_capacity\":" << slot.payload_capacity;
    if (slot.version) {
      out << ",\"version\":" << *slot.version << ",\"bucket_index\":" << slot.bucket_index
          << ",\"bucket_count\":" << slot.bucket_count << ",\"published_ns\":" << slot.published_ns;
    }
    out << "}";
  }
  out << "],\"consumers\":[";
  for (std::size_t c = 0; c < info.consumers.size(); ++c) {
    const auto& consumer = info.consumers[c];
    out << (c ? "," : "") << "{\"record\":" << consumer.record << ",\"pid\":" << consumer.pid
        << ",\"pid_elsewhere\":" << (consumer.pid_elsewhere ? "true" : "false")
        << ",\"alive\":" << (consumer.alive ? "true" : "false")
        << ",\"next_bucket\":" << consumer.next_bucket << ",\"lag_buckets\":" << lag(info.published, consumer.next_bucket)
        << ",\"lag_updates\":" << lag(info.updates, consumer.next_update) << ",\"held_slots\":" << consumer.held_slots
        << "}";
  }
  out << "],\"newest_manifest\":";
  if (info.newest_manifest) {
    auto summary = summarize(*info.newest_manifest);
    out << "{\"version\":" << info.newest_manifest->version
        << ",\"bucket_index\":" << info.newest_manifest->bucket_index
        << ",\"bucket_count\":" << info.newest_manifest->bucket_count
        << ",\"entries\":" << info.newest_manifest->entries.size()
        << ",\"groups\":" << info.newest_manifest->groups.size() << ",\"bytes\":" << summary.bytes
        << ",\"dtypes\":{";
    bool first = true;
    for (auto [name, count] : summary.dtypes) {
      out << (first ? "" : ",") << "\"" << name << "\":" << count;
      first = false;
    }
    out << "}}";
  } else {
    out << "null";
  }
  out << "}";
  std::printf("%s\n", out.str().c_str());
}

// After a pid that is one in another pid namespace (a container's), which ours cannot see.
constexpr const char* kElsewhere = " (in another pid namespace)";

void print_text(const ChannelInfo& info) {
  std::printf("channel %s (control segment %s)\n", info.channel.c_str(), info.control_segment.c_str());
  std::printf("  config     %u slots, up to %u consumers, min_consumers %u, payload checksums %s, policy %s, "
              "up to %u buckets per update\n",
              info.slots, info.max_consumers, info.min_consumers, info.payload_checksum ? "on" : "off",
              info.policy.c_str(), info.update_buckets);
  std::printf("  payloads   %s\n", info.location == "host" ? "in host shared memory" : ("on " + info.location).c_str());
  std::printf("  producer   pid %d%s, incarnation %016llx, %s%s, %llu buckets published, %llu updates begun\n",
              info.producer_pid, info.producer_pid_elsewhere ? kElsewhere : "",
              static_cast<unsigned long long>(info.producer_incarnation), info.producer_alive ? "alive" : "gone",
              info.closed ? ", closed" : "", static_cast<unsigned long long>(info.published),
              static_cast<unsigned long long>(info.updates));
  for (std::size_t s = 0; s < info.slot_states.size(); ++s) {
    const auto& slot = info.slot_states[s];
    std::string state = slot.generation == 0 ? "empty"
                        : slot.bucket        ? "bucket " + std::to_string(*slot.bucket)
                                             : "being written";
    if (slot.bucket && slot.version) {
      state += " (version " + std::to_string(*slot.version) + ", bucket index " + std::to_string(slot.bucket_index) +
               " of " + std::to_string(slot.bucket_count) + ")";
    }
    std::printf("  slot %zu     %s (generation %llu), %u releases, epoch %llu, %llu payload bytes, %s (%llu bytes)\n",
                s, state.c_str(), static_cast<unsigned long long>(slot.generation), slot.release_count,
                static_cast<unsigned long long>(slot.epoch), static_cast<unsigned long long>(slot.payload_capacity),
                slot.segment.empty() ? "no segment" : slot.segment.c_str(),
                static_cast<unsigned long long>(slot.segment_bytes));
  }
  if (info.consumers.empty()) std::printf("  consumers  none\n");
  for (const auto& consumer : info.consumers) {
    std::printf("  consumer   record %u: pid %d%s, %s, next bucket %llu, %llu buckets and %llu updates behind, "
                "leases 0x%x\n",
                consumer.record, consumer.pid, consumer.pid_elsewhere ? kElsewhere : "",
                consumer.alive ? "alive" : "gone", static_cast<unsigned long long>(consumer.next_bucket),
                static_cast<unsigned long long>(lag(info.published, consumer.next_bucket)),
                static_cast<unsigned long long>(lag(info.updates, consumer.next_update)), consumer.held_slots);
  }
  if (info.newest_manifest) {
    auto summary = summarize(*info.newest_manifest);
    std::printf("  newest     version %llu, bucket index %u of %u, %zu entries, %zu groups, %llu bytes:",
                static_cast<unsigned long long>(info.newest_manifest->version),
                info.newest_manifest->bucket_index, info.newest_manifest->bucket_count,
                info.newest_manifest->entries.size(), info.newest_manifest->groups.size(),
                static_cast<unsigned long long>(summary.bytes));
    for (auto [name, count] : summary.dtypes) std::printf(" %zu %s", count, std::string(name).c_str());
    std::printf("\n");
  }
}

// What a consumer's leases hold, for --watch: "holds bucket 12 (published 0.4 s ago)", its
// oldest, which it has held at most that long.
std::string leases_of(const ChannelInfo& info, const ChannelInfo::Consumer& consumer, std::uint64_t now_ns) {
  std::optional<std::size_t> oldest;
  for (std::size_t s = 0; s < info.slot_states.size(); ++s) {
    const auto& slot = info.slot_states[s];
    if ((consumer.held_slots >> s & 1u) == 0 || !slot.bucket) continue;
    if (!oldest || *slot.bucket < *info.slot_states[*oldest].bucket) oldest = s;
  }
  if (!oldest) return "holds nothing";
  const auto& slot = info.slot_states[*oldest];
  std::string text = "holds bucket " + std::to_string(*slot.bucket);
  if (slot.published_ns != 0 && slot.published_ns <= now_ns) {
    char age[48];
    std::snprintf(age, sizeof age, " (published %.1f s ago)", static_cast<double>(now_ns - slot.published_ns) / 1e9);
    text += age;
  }
  return text;
}

// One refresh of --watch, in plain lines that read the same in a terminal and in a log: the
// time, what was published since the refresh before (as rates), each consumer's lag and lease.
void print_watch(const ChannelInfo& info, const std::optional<ChannelInfo>& before, double seconds) {
  auto u = [](std::uint64_t value) { return static_cast<unsigned long long>(value); };
  char clock[16];
  auto wall = std::time(nullptr);
  std::tm local{};
  std::strftime(clock, sizeof clock, "%H:%M:%S", ::localtime_r(&wall, &local));
  // A new producer of the name starts counting again.
  bool same_producer = before && before->producer_incarnation == info.producer_incarnation &&
                       before->published <= info.published;
  // Rates from the second refresh on: the first has nothing to compare with.
  std::string rates;
  if (same_producer && seconds > 0) {
    double rate = static_cast<double>(info.published - before->published) / seconds;
    double bucket_bytes = info.newest_manifest ? static_cast<double>(summarize(*info.newest_manifest).bytes) : 0;
    char text[64];
    std::snprintf(text, sizeof text, "; %.1f buckets/s, %.1f MiB/s", rate, rate * bucket_bytes / (1 << 20));
    rates = text;
  }
  // Consumers as `tbucket list` counts them: the records of live processes (a dead one's
  // record is listed below until it is freed).
  auto alive = std::count_if(info.consumers.begin(), info.consumers.end(), [](const auto& c) { return c.alive; });
  std::printf("%s %s: %llu buckets, %llu updates published%s; producer pid %d %s%s; %zu consumers\n", clock,
              info.channel.c_str(), u(info.published), u(info.updates), rates.c_str(), info.producer_pid,
              info.producer_alive ? "alive" : "gone", info.closed ? ", closed" : "", static_cast<std::size_t>(alive));
  auto now_ns = monotonic_ns();
  for (const auto& consumer : info.consumers) {
    std::printf("  consumer record %u, pid %d%s, %s: %llu buckets and %llu updates behind, %s\n", consumer.record,
                consumer.pid, consumer.pid_elsewhere ? kElsewhere : "", consumer.alive ? "alive" : "gone",
                u(lag(info.published, consumer.next_bucket)), u(lag(info.updates, consumer.next_update)),
                leases_of(info, consumer, now_ns).c_str());
  }
  std::fflush(stdout);
}

// --watch: a refresh every interval until the channel is gone (exit 0) or its producer died
// (exit 4: its leftovers stay until removed), or Ctrl+C (exit 0: watching changes nothing).
int watch(const InspectOptions& options) {
  install_stop_handlers();
  std::optional<ChannelInfo> before;
  auto last = std::chrono::steady_clock::now();
  for (;;) {
    std::optional<ChannelInfo> info;
    try {
      info = inspect_channel(options.channel);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ChannelMissing || !before) throw;
      std::printf("channel %s is gone\n", options.channel.c_str());
      return kOk;
    }
    auto now = std::chrono::steady_clock::now();
    print_watch(*info, before, std::chrono::duration<double>(now - last).count());
    if (!info->producer_alive) {
      std::printf("producer pid %d of channel %s is gone; its leftovers stay until `tbucket rm %s` or its next "
                  "producer\n", info->producer_pid, options.channel.c_str(), options.channel.c_str());
      return kProducerGone;
    }
    before = std::move(info);
    last = now;
    pause(options.interval_ms);
    if (stop_signal() != 0) return kOk;
  }
}

}  // namespace

int run_inspect(const InspectOptions& options) {
  if (options.watch) return watch(options);
  auto info = inspect_channel(options.channel);
  options.json ? print_json(info) : print_text(info);
  return kOk;
}

}  // namespace tensorbucket::cli
