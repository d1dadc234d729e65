#include "support.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>

namespace tensorbucket::test {
namespace {

std::string random_name(std::mt19937_64& rng, std::size_t index) {
  auto base = std::to_string(index);
  switch (rng() % 6) {
    case 0: return "layers." + base + ".weight";
    case 1: return "权重." + base + ".ü·β";  // multi-byte UTF-8
    case 2: return std::string(kMaxNameBytes - base.size(), 'n') + base;  // longest allowed
    case 3: return std::string("raw\0\x01\xff.", 7) + base;  // names are bytes, not text
    default: return "t" + base;
  }
}

Shape random_shape(std::mt19937_64& rng) {
  Shape shape;
  shape.resize(rng() % 5);  // rank 0 is a scalar
  for (auto& dim : shape) dim = static_cast<std::int64_t>(rng() % 8);
  if (!shape.empty() && rng() % 16 == 0) shape[0] = 0;  // an empty tensor
  if (rng() % 64 == 0) shape = {64, 33};                // an occasional larger one
  if (rng() % 32 == 0) {                                // more dims than Shape keeps inline
    shape.resize(Shape::kInlineRank + 1 + rng() % 4);
    std::fill(shape.begin(), shape.end(), 1);
  }
  return shape;
}

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::stoull(value) : fallback;
}

}  // namespace

RandomBucket make_random_bucket(std::mt19937_64& rng, std::size_t max_entries, bool exact) {
  RandomBucket bucket;
  auto count = exact ? max_entries : rng() % (max_entries + 1);
  bucket.sources.reserve(count);
  std::vector<std::string> names;
  for (std::size_t i = 0; i < count; ++i) {
    auto dtype = static_cast<DType>(rng() % kDTypeCount);
    auto shape = random_shape(rng);
    auto bytes = *checked_byte_length(dtype, shape);
    auto& source = bucket.sources.emplace_back(bytes);
    for (auto& b : source) b = static_cast<std::byte>(rng());
    names.push_back(random_name(rng, i));
    bucket.builder.add(names.back(), dtype, std::move(shape), source.data());
  }
  // Group runs of 2-3 neighbours, like a quantized weight with its scales.
  for (std::size_t i = 0; i + 3 <= count; i += 3 + rng() % 5) {
    if (rng() % 3 != 0) continue;
    std::vector<std::string> members(names.begin() + i, names.begin() + i + 2 + rng() % 2);
    bucket.builder.group("group." + std::to_string(i), std::move(members));
  }
  bucket.builder.version(rng()).bucket(static_cast<std::uint32_t>(rng() % 4), 4);
  return bucket;
}

bool wait_until(const std::function<bool()>& condition, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return condition();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

std::string channel_for_this_test(const std::string& prefix) {
  std::string name = prefix + "-" + std::to_string(::getpid()) + "-" +
                     ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(name.begin(), name.end(), '/', '.');  // parameterized tests: "Name/1"
  return name.substr(0, 64);
}

std::uint64_t fuzz_seed(std::uint64_t fallback) { return env_or("TB_FUZZ_SEED", fallback); }
std::uint64_t fuzz_iterations(std::uint64_t fallback) { return env_or("TB_FUZZ_ITERS", fallback); }

}  // namespace tensorbucket::test
