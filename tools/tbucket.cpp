// tbucket: the command-line face of tensorbucket. Each subcommand lives in its own file and
// returns an exit status from exit_codes.hpp; errors print one line to stderr.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "demo.hpp"
#include "exit_codes.hpp"

int main(int argc, char** argv) {
  using namespace tensorbucket;
  CLI::App app{"tbucket: move named tensors between processes as verified zero-copy buckets"};
  app.set_version_flag("--version", "tbucket " TENSORBUCKET_VERSION);
  app.require_subcommand(1);

  cli::DemoOptions demo;
  auto* demo_command = app.add_subcommand("demo", "Pack, encode, verify and view a model-shaped bucket");
  demo_command->add_option("--layers", demo.layers, "Transformer layers in the model")
      ->check(CLI::Range(1, 256));
  demo_command->add_option("--seed", demo.seed, "Seed of the tensors' bytes");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? cli::kOk : cli::kUsage;
  }

  try {
    if (*demo_command) return cli::run_demo(demo);
  } catch (const Error& e) {
    std::fprintf(stderr, "tbucket: %s: %s\n", to_string(e.code()).data(), e.what());
    return cli::exit_code_for(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tbucket: %s\n", e.what());
    return cli::kOtherError;
  }
  return cli::kUsage;
}
