// `tbucket publish-file` and `tbucket save`: a channel seeded from safetensors files, and what
// a channel carries written to them (tensorbucket/safetensors.hpp).
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "commands.hpp"
#include "exit_codes.hpp"
#include "tensorbucket/tensorbucket.hpp"

namespace tensorbucket::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kSuffix = ".safetensors";

// OUT for the one file of a single update; otherwise OUT's stem with the version (and the
// bucket's index) before the suffix: weights-v12.safetensors, weights-v12-b3.safetensors.
// An update whose version came before in this run (publish-file's default is 0) gets "-2",
// "-3", ... after its version, rather than overwrite the earlier one's file.
std::string file_name(const SaveOptions& options, std::uint64_t version, std::optional<std::uint32_t> bucket,
                      std::uint64_t repeat) {
  if (options.updates == 1 && !options.per_bucket) return options.out;
  std::string_view stem = options.out;
  if (stem.ends_with(kSuffix)) stem.remove_suffix(kSuffix.size());
  auto name = std::string(stem) + "-v" + std::to_string(version);
  if (repeat > 1) name += "-" + std::to_string(repeat);
  if (bucket) name += "-b" + std::to_string(*bucket);
  return name + std::string(kSuffix);
}

double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int run_publish_file(const PublishFileOptions& options) {
  install_stop_handlers();
  auto created = unless_stopped(
      [&] { return Publisher::create(options.channel, options.created.publisher(), removal_wait()); });
  if (!created) return stopped("no channel was created");
  auto& publisher = *created;
  auto start = Clock::now();
  auto published = safetensors::publish_files(
      publisher, options.files,
      {.version = options.version,
       .bucket_bytes = options.bucket_bytes,
       .timeout = as_timeout(options.timeout_ms),
       .interrupted = [] { return stop_signal() != 0; }});
  if (stop_signal() != 0) return stopped();
  auto seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (published.published < published.buckets) {
    return timed_out("no slot of channel ", text::Quoted{options.channel}, " came free within ", options.timeout_ms,
                     " ms (bucket ", published.published, " of ", published.buckets, "); waiting for ",
                     publisher.waiting_for(), "; the update stays unfinished");
  }
  auto bytes = published.bytes;
  std::printf("published %u buckets of version %llu from %zu files (%.1f MiB of tensors) on channel '%s' in %.3f s: "
              "%.0f MiB/s\n", published.buckets, static_cast<unsigned long long>(published.version),
              options.files.size(), mib(bytes), options.channel.c_str(), seconds, mib(bytes) / seconds);
  std::fflush(stdout);
  bool drained = publisher.drain(until_stopped(options.timeout_ms));
  if (stop_signal() != 0) return stopped();
  if (!drained) return not_drained(publisher, options.timeout_ms);
  return kOk;
}

int run_save(const SaveOptions& options) {
  install_stop_handlers();
  // Before an update is waited for and taken: OUT, or where names made from it (their
  // versions yet to come) will be.
  if (options.updates == 1 && !options.per_bucket) {
    safetensors::check_save_path(options.out);
  } else {
    safetensors::check_save_folder(options.out);
  }
  // Following the channel's producers: publish-file publishes one update and leaves.
  auto subscriber = unless_stopped([&] {
    return Subscriber::attach(options.channel, until_stopped(options.timeout_ms),
                              {.whole_updates = true, .follow_restarts = true});
  });
  std::map<std::uint64_t, std::uint64_t> seen;  // updates saved, by version
  for (std::uint64_t saved = 0; saved < options.updates && stop_signal() == 0; ++saved) {
    std::optional<ReceivedUpdate> update;
    for (auto deadline = until_stopped(options.timeout_ms); !update && !deadline.passed() && stop_signal() == 0;) {
      try {
        update = subscriber->next_update(deadline);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::ProducerGone) throw;  // the next producer's updates come next
      }
    }
    if (stop_signal() != 0) break;
    if (!update) {
      return timed_out("no whole update arrived on ", text::Quoted{options.channel}, " within ", options.timeout_ms, " ms");
    }
    // Views of the payloads on the host: a device bucket's copied back first.
    std::vector<std::vector<std::byte>> copies;
    std::vector<BucketView> views;
    for (const auto& bucket : update->buckets()) {
      if (bucket.view().location().on_host()) {
        views.push_back(bucket.view());
      } else {
        copies.push_back(bucket.copy_to_host());
        views.push_back(BucketView::open(bucket.view().frame(), copies.back()));
      }
    }
    auto write = [&](std::span<const BucketView* const> buckets, const std::string& path) {
      safetensors::save(buckets, path);
      std::uint64_t bytes = 0;
      std::size_t tensors = 0;
      for (const auto* bucket : buckets) {
        tensors += bucket->size();
        for (std::size_t i = 0; i < bucket->size(); ++i) bytes += (*bucket)[i].bytes.size();
      }
      std::printf("saved version %llu (%zu tensors, %.1f MiB) to %s\n",
                  static_cast<unsigned long long>(update->version()), tensors, mib(bytes), path.c_str());
      std::fflush(stdout);
    };
    auto repeat = ++seen[update->version()];
    if (options.per_bucket) {
      for (const auto& view : views) {
        const BucketView* one[] = {&view};
        write(one, file_name(options, update->version(), view.bucket_index(), repeat));
      }
    } else {
      std::vector<const BucketView*> all;
      for (const auto& view : views) all.push_back(&view);
      write(all, file_name(options, update->version(), std::nullopt, repeat));
    }
  }
  if (stop_signal() != 0) return stopped();
  return kOk;
}

}  // namespace tensorbucket::cli
