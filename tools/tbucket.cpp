// tbucket: the command-line face of tensorbucket. Each subcommand lives in its own file and
// returns an exit status from exit_codes.hpp; errors print one line to stderr.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "commands.hpp"
#include "exit_codes.hpp"

int main(int argc, char** argv) {
  using namespace tensorbucket;
  CLI::App app{"tbucket: move named tensors between processes as verified zero-copy buckets"};
  app.set_version_flag("--version", "tbucket " TENSORBUCKET_VERSION);
  app.require_subcommand(1);

  cli::ProduceOptions produce;
  auto* produce_command = app.add_subcommand("produce", "Create a channel and publish N deterministic buckets");
  produce_command->add_option("--channel", produce.channel, "Channel name")->required();
  produce_command->add_option("--buckets", produce.workload.buckets, "Buckets to publish")
      ->check(CLI::Range(1ull, 1ull << 32));
  produce_command->add_option("--tensors", produce.workload.tensors, "Tensors per bucket")
      ->check(CLI::Range(0u, 1u << 20));
  produce_command->add_option("--tensor-bytes", produce.workload.tensor_bytes, "Bytes per tensor (multiple of 8)")
      ->check(CLI::Range(8ull, 1ull << 40));
  produce_command->add_option("--slots", produce.slots, "Slots (buckets in flight)")->check(CLI::Range(1, 16));
  produce_command->add_option("--consumers", produce.consumers,
                              "Releases each bucket needs before its slot is reused (min_consumers)")
      ->check(CLI::Range(0, 8));
  produce_command->add_option("--seed", produce.workload.seed, "Seed of the tensors' bytes");
  produce_command->add_flag("--checksum", produce.checksum, "Hash every payload");
  produce_command->add_flag("--in-place", produce.in_place, "Write tensors straight into shared memory");
  produce_command->add_option("--interval-ms", produce.interval_ms, "Pause between buckets");
  produce_command->add_option("--timeout-ms", produce.timeout_ms, "Longest wait for a slot, and for the final drain");

  cli::ConsumeOptions consume;
  auto* consume_command = app.add_subcommand("consume", "Receive buckets in order and print one line each");
  consume_command->add_option("--channel", consume.channel, "Channel name")->required();
  consume_command->add_option("--buckets", consume.buckets, "Buckets to receive (0: until the producer is gone)");
  consume_command->add_option("--seed", consume.seed, "Seed the producer used");
  consume_command->add_flag("--verify", consume.verify, "Regenerate and compare every byte");
  consume_command->add_option("--timeout-ms", consume.timeout_ms, "Longest wait for the channel and for each bucket");
  consume_command->add_flag("--json", consume.json, "One JSON object per bucket");

  cli::InspectOptions inspect;
  auto* inspect_command = app.add_subcommand("inspect", "Show a channel's configuration, slots and consumers");
  inspect_command->add_option("--channel", inspect.channel, "Channel name")->required();
  inspect_command->add_flag("--json", inspect.json, "One JSON object");

  cli::DemoOptions demo;
  auto* demo_command = app.add_subcommand("demo", "A trainer process sends a model update to a server process");
  demo_command->add_option("--layers", demo.layers, "Transformer layers in the model")->check(CLI::Range(1, 256));
  demo_command->add_option("--seed", demo.seed, "Seed of the tensors' bytes");

  cli::BenchOptions bench;
  auto* bench_command = app.add_subcommand("bench", "Cross-process handoff figures beside their baselines");
  bench_command->add_flag("--json", bench.json, "One JSON array");
  bench_command->add_option("--repeats", bench.repeats, "Handoffs per small figure")->check(CLI::Range(5, 100000));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? cli::kOk : cli::kUsage;
  }

  try {
    if (*produce_command) return cli::run_produce(produce);
    if (*consume_command) return cli::run_consume(consume);
    if (*inspect_command) return cli::run_inspect(inspect);
    if (*demo_command) return cli::run_demo(demo);
    if (*bench_command) return cli::run_bench(bench);
  } catch (const Error& e) {
    std::fprintf(stderr, "tbucket: %s: %s\n", to_string(e.code()).data(), e.what());
    return cli::exit_code_for(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tbucket: %s\n", e.what());
    return cli::kOtherError;
  }
  return cli::kUsage;
}
