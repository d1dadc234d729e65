// tbucket: the command-line face of tensorbucket. Each subcommand lives in its own file and
// returns an exit status from exit_codes.hpp; errors print one line to stderr.
#include <CLI/CLI.hpp>
#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>

#include "commands.hpp"
#include "exit_codes.hpp"
#ifdef TENSORBUCKET_NET
#include "tensorbucket/net.hpp"
#endif

namespace {

constexpr auto kAny = std::numeric_limits<std::uint64_t>::max();

// An error's words on one line, whatever a path given on the command line holds (CLI11 names a
// missing file as it was given).
std::string one_line(std::string_view text) { return tensorbucket::text::message(tensorbucket::text::Escaped{text}); }

// A whole number of decimal digits from `min` to `max` (and a multiple of `step`). Every
// numeric option is read through this: CLI11 on its own took "-1" for 2^64 - 1, went on past
// 2^64 and read "010" as octal 8; the text it converts is the value's plain decimal form.
CLI::Validator whole_number(std::uint64_t min, std::uint64_t max, std::uint64_t step = 1) {
  using tensorbucket::text::message;
  auto wanted = message("a whole number from ", min, " to ", max);
  if (step > 1) wanted += message(", a multiple of ", step);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        std::uint64_t value = 0;
        const char* end = text.data() + text.size();
        auto [stop, error] = std::from_chars(text.data(), end, value);
        if (text.empty() || error != std::errc() || stop != end || value < min || value > max ||
            value % step != 0) {
          return message(tensorbucket::text::Quoted{text}, " is not ", wanted);
        }
        text = std::to_string(value);
        return {};
      },
      // What --help shows after UINT: its range, where there is one.
      max != kAny ? std::to_string(min) + ".." + std::to_string(max)
      : min > 0   ? "at least " + std::to_string(min)
                  : std::string());
}

// The options of a channel the command creates (publish-file, relay), each help line after
// `whose` ("" or "Local channel: ").
void add_channel_options(CLI::App& command, tensorbucket::cli::ChannelOptions& channel, const std::string& whose) {
  command.add_option("--slots", channel.slots, whose + "Slots (buckets in flight)")->transform(whole_number(1, 16));
  command.add_option("--consumers", channel.consumers, whose + "Releases each bucket needs (min_consumers)")
      ->transform(whole_number(0, 64));
  command.add_option("--max-consumers", channel.max_consumers, whose + "Consumer records")->transform(whole_number(1, 64));
  command.add_option("--update-buckets", channel.update_buckets, whose + "`latest`: the most buckets an update has")
      ->transform(whole_number(1, 16));
  command.add_option("--policy", channel.policy, whose + "block or latest")->check(CLI::IsMember({"block", "latest"}));
  command.add_flag("--checksum", channel.checksum, whose + "Hash every payload");
  command.add_option("--device", channel.device, whose + "Where the payloads live: host, cuda, cuda:N");
}

// Every descriptor the hard limit allows (up to 2^20): `publish-file` holds each of its files
// open to the end, and a model's shards may pass the usual soft limit of 1024; serve and relay
// need them most, as UCX's TCP transport holds each connection to its own port until the peer
// speaks, and closes that port for good once the process is out of them (docs/network.md).
// And UCX's log on stderr, beside tbucket's own lines, not on stdout (relay's summary).
void ready_the_process() {
  ::setenv("UCX_LOG_FILE", "stderr", 0);
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  auto most = std::min<rlim_t>(limit.rlim_max, rlim_t{1} << 20);
  if (most <= limit.rlim_cur) return;
  limit.rlim_cur = most;
  ::setrlimit(RLIMIT_NOFILE, &limit);  // a limit left as it was is no error
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tensorbucket;
  ready_the_process();
  CLI::App app{"tbucket: move named tensors between processes as verified zero-copy buckets"};
  app.set_version_flag("--version", "tbucket " TENSORBUCKET_VERSION);
  app.require_subcommand(1);
  // --help shows every option's default; the subcommands inherit it.
  app.option_defaults()->always_capture_default();
  // One line, like every other error of tbucket.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return "tbucket: usage: " + one_line(e.what()) + " (see tbucket --help)\n";
  });

  cli::ProduceOptions produce;
  auto* produce_command = app.add_subcommand("produce", "Create a channel and publish N deterministic buckets");
  produce_command->add_option("--channel", produce.channel, "Channel name")->required();
  produce_command->add_option("--buckets", produce.workload.buckets, "Buckets to publish")
      ->transform(whole_number(1, 1ull << 32));
  produce_command->add_option("--tensors", produce.workload.tensors, "Tensors per bucket")
      ->transform(whole_number(0, 1u << 20));
  produce_command->add_option("--tensor-bytes", produce.workload.tensor_bytes, "Bytes per tensor (a multiple of 8)")
      ->transform(whole_number(8, 1ull << 40, 8));
  produce_command->add_option("--slots", produce.slots, "Slots (buckets in flight)")->transform(whole_number(1, 16));
  produce_command->add_option("--consumers", produce.consumers,
                              "Releases each bucket needs before its slot is reused (min_consumers)")
      ->transform(whole_number(0, 64));
  produce_command->add_option("--max-consumers", produce.max_consumers, "Consumer records")
      ->transform(whole_number(1, 64))
      ->capture_default_str();
  produce_command->add_option("--update-buckets", produce.workload.update_buckets,
                              "Buckets per update: bucket i is bucket i % U of version i / U")
      ->transform(whole_number(1, 16))
      ->capture_default_str();
  produce_command->add_option("--policy", produce.policy,
                              "When every slot is still needed: block (wait, lossless) or latest (reuse the "
                              "oldest slot no consumer leases; needs slots >= (max-consumers + 1) x update-buckets)")
      ->check(CLI::IsMember({"block", "latest"}))
      ->capture_default_str();
  produce_command->add_option("--seed", produce.workload.seed, "Seed of the tensors' bytes")->transform(whole_number(0, kAny));
  produce_command->add_flag("--checksum", produce.checksum, "Hash every payload");
  produce_command->add_flag("--in-place", produce.in_place, "Write tensors straight into shared memory");
  produce_command->add_option("--device", produce.device,
                              "Where the payloads live: host, or cuda:N (a CUDA device of this process; "
                              "its slots are written tensor by tensor from host memory)")
      ->capture_default_str();
  produce_command->add_option("--interval-ms", produce.interval_ms, "Pause between buckets, in milliseconds")
      ->transform(whole_number(0, kAny));
  produce_command->add_option("--timeout-ms", produce.timeout_ms,
                              "Longest wait for a slot, and for the final drain, in milliseconds")
      ->transform(whole_number(0, kAny));
  produce_command->add_flag("--quiet", produce.quiet,
                            "No progress line on stderr (drawn only when stderr is a terminal)");

  cli::ConsumeOptions consume;
  auto* consume_command = app.add_subcommand("consume", "Receive buckets in order and print one line each");
  consume_command->add_option("--channel", consume.channel, "Channel name")->required();
  consume_command->add_option("--buckets", consume.buckets, "Buckets to receive (0: until the producer is gone)")
      ->transform(whole_number(0, kAny));
  consume_command->add_option("--seed", consume.seed, "Seed the producer used")->transform(whole_number(0, kAny));
  consume_command->add_flag("--verify", consume.verify,
                            "Regenerate and compare every byte (of a device bucket, copied back)");
  consume_command->add_option("--device", consume.device,
                              "Refuse a channel whose payloads live elsewhere: host, or cuda (the "
                              "channel's device, found by its UUID)");
  consume_command->add_option("--timeout-ms", consume.timeout_ms,
                              "Longest wait for the channel and for each bucket, in milliseconds")
      ->transform(whole_number(0, kAny));
  consume_command->add_flag("--json", consume.json, "One JSON object per bucket (or update)");
  consume_command->add_flag("--updates", consume.updates,
                            "Receive whole updates, one line each (--buckets then counts updates)");
  consume_command->add_flag("--follow", consume.follow,
                            "When the producer is gone, wait for the channel's next one and go on");
  consume_command->add_flag("--quiet", consume.quiet,
                            "No progress line on stderr (drawn only when stderr is a terminal and stdout "
                            "is not)");

  cli::InspectOptions inspect;
  auto* inspect_command = app.add_subcommand("inspect", "Show a channel's configuration, slots and consumers");
  inspect_command->add_option("--channel", inspect.channel, "Channel name")->required();
  auto* inspect_json = inspect_command->add_flag("--json", inspect.json, "One JSON object");
  inspect_command->add_flag("--watch", inspect.watch,
                            "Print the publish rate and each consumer's lag and lease every interval, "
                            "until the channel is gone or Ctrl+C")
      ->excludes(inspect_json);
  inspect_command->add_option("--interval-ms", inspect.interval_ms, "Time between two --watch refreshes, in milliseconds")
      ->transform(whole_number(10, 3'600'000));

  cli::ListOptions list;
  auto* list_command = app.add_subcommand("list", "Every channel on this host: producer, incarnation, slots, consumers");
  list_command->add_flag("--json", list.json, "One JSON array");

  cli::RemoveOptions remove;
  auto* remove_command = app.add_subcommand("rm", "Remove a dead producer's leftovers from /dev/shm");
  remove_command->add_option("channel", remove.channel, "Channel name")->required();
  remove_command->add_flag("--force", remove.force,
                           "Remove a live producer's names too (for a stuck producer you are about to kill): "
                           "it and its consumers go on with what they mapped, nobody can attach any more, and "
                           "the name is free for a new producer, with which a slot the old one grows meanwhile "
                           "may clash");

  cli::DemoOptions demo;
  auto* demo_command = app.add_subcommand("demo", "A trainer process sends a model update to a server process");
  demo_command->add_option("--layers", demo.layers, "Transformer layers in the model")->transform(whole_number(1, 256));
  demo_command->add_option("--seed", demo.seed, "Seed of the tensors' bytes")->transform(whole_number(0, kAny));

  cli::BenchOptions bench;
  auto* bench_command = app.add_subcommand("bench", "Cross-process handoff figures beside their baselines");
  bench_command->add_flag("--json", bench.json, "One JSON array");
  bench_command->add_option("--repeats", bench.repeats, "Handoffs per small figure")->transform(whole_number(5, 100000));
  auto* bench_size = bench_command->add_option("--tensor-bytes", bench.tensor_bytes,
                            "Only the copy and in-place figures, of 1000 tensors of this many bytes, on the host")
      ->transform(whole_number(8, 1u << 20, 8));
  bench_command->add_option("--device", bench.device,
                            "host, or cuda:N for a device channel's figures on CUDA device N")
      ->capture_default_str()
      ->excludes(bench_size);

  cli::PublishFileOptions publish_file;
  auto* publish_file_command = app.add_subcommand(
      "publish-file", "Publish safetensors files as one update, each read once straight into the slots");
  publish_file_command->add_option("--channel", publish_file.channel, "Channel name")->required();
  publish_file_command->add_option("files", publish_file.files, "FILE.safetensors ...")->required()->check(CLI::ExistingFile);
  publish_file_command->add_option("--bucket-bytes", publish_file.bucket_bytes,
                                   "Split each file into buckets of at most this many bytes (0: one bucket per file)")
      ->transform(whole_number(0, kAny));
  publish_file_command->add_option("--version", publish_file.version,
                                   "The update's version (default: the first file's tensorbucket.version, else 0)")
      ->transform(whole_number(0, kAny));
  add_channel_options(*publish_file_command, publish_file.created, "");
  publish_file_command->add_option("--timeout-ms", publish_file.timeout_ms,
                                   "Longest wait for a free slot, and for consumers to release everything")
      ->transform(whole_number(0, kAny));

  cli::SaveOptions save;
  auto* save_command = app.add_subcommand("save", "Write the updates a channel carries as safetensors files");
  save_command->add_option("--channel", save.channel, "Channel name")->required();
  save_command->add_option("out", save.out, "OUT.safetensors")->required();
  save_command->add_option("--updates", save.updates,
                           "Updates to save; past one, each file is named OUT's stem, -vVERSION, .safetensors")
      ->transform(whole_number(1, kAny));
  save_command->add_flag("--per-bucket", save.per_bucket,
                         "One file per bucket, named OUT's stem, -vVERSION-bINDEX, .safetensors");
  save_command->add_option("--timeout-ms", save.timeout_ms, "Longest wait for the channel and for each update")
      ->transform(whole_number(0, kAny));

#ifdef TENSORBUCKET_NET
  cli::ServeCommandOptions serve;
  auto* serve_command = app.add_subcommand("serve", "Serve a local channel to relays on other hosts (UCX)");
  serve_command->add_option("--channel", serve.channel, "The local channel to serve")->required();
  serve_command->add_option("--listen", serve.listen,
                            "ADDRESS:PORT to listen on, an address of this host ([ADDRESS]:PORT for IPv6); no default")
      ->required();
  serve_command->add_option("--token-file", serve.token_file,
                            "The shared secret: 16-4096 bytes, mode 0600; relays must hold the same")
      ->required();
  serve_command->add_option("--peer-timeout-ms", serve.peer_timeout_ms,
                            "A relay that takes no bucket within this is dropped (it reconnects)")
      ->transform(whole_number(1, net::kLongestTimeout.count()));
  serve_command->add_option("--max-peers", serve.max_peers, "Relays at once")->transform(whole_number(1, net::kMostPeers));
  serve_command->add_option("--timeout-ms", serve.timeout_ms, "Wait for the channel's producer at most this long")
      ->transform(whole_number(0, kAny));

  cli::RelayOptions relay;
  auto* relay_command = app.add_subcommand("relay", "Republish a served channel from another host into a local channel");
  relay_command->add_option("--connect", relay.connect, "HOST:PORT of `tbucket serve`")->required();
  relay_command->add_option("--channel", relay.channel, "The served channel's name")->required();
  relay_command->add_option("--as", relay.as, "The local channel's name (default: the same)");
  relay_command->add_option("--token-file", relay.token_file, "The shared secret, as `tbucket serve` has it")->required();
  add_channel_options(*relay_command, relay.local, "Local channel: ");
  relay_command->add_option("--timeout-ms", relay.timeout_ms,
                            "A local publish waits at most this long (then the link is dropped, to resume at the "
                            "next update); each connect try, this long held to 1-5 s")
      ->transform(whole_number(0, kAny));
  relay_command->add_option("--idle-timeout-ms", relay.idle_timeout_ms, "Silence after which the link counts as dead")
      ->transform(whole_number(100, net::kLongestTimeout.count()));
  relay_command->add_option("--max-bucket-bytes", relay.max_bucket_bytes, "A larger payload drops the link")
      ->transform(whole_number(0, kAny));
  relay_command->add_option("--buckets", relay.buckets, "Stop after relaying this many (0: until a signal)")
      ->transform(whole_number(0, kAny));
  relay_command->add_flag("--quiet", relay.quiet,
                          "No line on each connection; why the link is down is still told, once per reason");
#endif

  // CLI11 answers an unknown command with "A subcommand is required".
  auto named = [&](const CLI::App* command) { return command->get_name() == argv[1]; };
  if (argc > 1 && argv[1][0] != '-' && app.get_subcommands(named).empty()) {
    std::fprintf(stderr, "tbucket: usage: unknown command %s; the commands are produce, consume, "
                 "inspect, list, rm, publish-file, save, %s (see tbucket --help)\n",
                 tensorbucket::text::message(tensorbucket::text::Quoted{argv[1]}).c_str(),
#ifdef TENSORBUCKET_NET
                 "demo, bench, serve and relay"
#else
                 "demo and bench (serve and relay need a build with UCX)"
#endif
    );
    return cli::kUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? cli::kOk : cli::kUsage;
  }

  try {
    if (*produce_command) return cli::run_produce(produce);
    if (*consume_command) return cli::run_consume(consume);
    if (*inspect_command) return cli::run_inspect(inspect);
    if (*list_command) return cli::run_list(list);
    if (*remove_command) return cli::run_remove(remove);
    if (*demo_command) return cli::run_demo(demo);
    if (*bench_command) return cli::run_bench(bench);
    if (*publish_file_command) return cli::run_publish_file(publish_file);
    if (*save_command) return cli::run_save(save);
#ifdef TENSORBUCKET_NET
    if (*serve_command) return cli::run_serve(serve);
    if (*relay_command) return cli::run_relay(relay);
#endif
  } catch (const Error& e) {
    std::fprintf(stderr, "tbucket: %s: %s\n", to_string(e.code()).data(), one_line(e.what()).c_str());
    return cli::exit_code_for(e.code());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "tbucket: SystemError: not enough memory\n");
    return cli::kOtherError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tbucket: %s\n", one_line(e.what()).c_str());
    return cli::kOtherError;
  }
  return cli::kUsage;
}
