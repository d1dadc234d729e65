#pragma once

#include <cstdint>

namespace tensorbucket::cli {

struct DemoOptions {
  int layers = 8;
  std::uint64_t seed = 1;
};

// In-process for now: builds a small transformer's weights, packs, encodes, decodes,
// verifies, compares every view with its source, then shows each seed rejection.
int run_demo(const DemoOptions& options);

}  // namespace tensorbucket::cli
