#include <cstdio>
#include <map>
#include <sstream>

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
          << ",\"bucket_count\":" << slot.bucket_count;
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
    std::printf("  newest     version %llu, bucket %u of %u, %zu entries, %zu groups, %llu bytes:",
                static_cast<unsigned long long>(info.newest_manifest->version),
                info.newest_manifest->bucket_index + 1, info.newest_manifest->bucket_count,
                info.newest_manifest->entries.size(), info.newest_manifest->groups.size(),
                static_cast<unsigned long long>(summary.bytes));
    for (auto [name, count] : summary.dtypes) std::printf(" %zu %s", count, std::string(name).c_str());
    std::printf("\n");
  }
}

}  // namespace

int run_inspect(const InspectOptions& options) {
  auto info = inspect_channel(options.channel);
  options.json ? print_json(info) : print_text(info);
  return kOk;
}

}  // namespace tensorbucket::cli
