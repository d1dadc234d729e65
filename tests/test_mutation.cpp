// Mutation: flip, overwrite, truncate and extend bytes of encoded manifests and frames. Every
// result must be a typed rejection, or a bucket that verifies, round-trips and whose views
// stay inside the payload. Never a crash, an untyped exception, or a stray read (the
// sanitizer run of this suite proves the last).
#include <gtest/gtest.h>

#include <cstring>

#include "support.hpp"

namespace tensorbucket {
namespace {

std::vector<std::byte> mutate(std::vector<std::byte> bytes, std::mt19937_64& rng) {
  auto position = [&] { return rng() % bytes.size(); };
  switch (rng() % 5) {
    case 0:  // flip a few bits
      for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) {
        bytes[position()] ^= std::byte{static_cast<unsigned char>(1u << (rng() % 8))};
      }
      break;
    case 1:  // overwrite a word with a value that counts and sizes like to break on
      if (bytes.size() >= 8) {
        constexpr std::uint64_t kInteresting[] = {0, 1, 255, 256, 1ull << 31, 1ull << 63,
                                                  ~0ull, kMaxEntries + 1, kMaxNameBytes + 1};
        auto value = kInteresting[rng() % std::size(kInteresting)];
        std::memcpy(bytes.data() + rng() % (bytes.size() - 7), &value, 8);
      }
      break;
    case 2:  // one random byte
      bytes[position()] = static_cast<std::byte>(rng());
      break;
    case 3:  // truncate
      bytes.resize(rng() % bytes.size());
      break;
    default:  // extend
      for (int i = 0, n = 1 + static_cast<int>(rng() % 16); i < n; ++i) {
        bytes.push_back(static_cast<std::byte>(rng()));
      }
  }
  return bytes;
}

void expect_views_inside(const BucketView& view, std::span<const std::byte> payload) {
  for (std::size_t i = 0; i < view.size(); ++i) {
    auto bytes = view[i].bytes;
    ASSERT_GE(bytes.data(), payload.data());
    ASSERT_LE(bytes.data() + bytes.size(), payload.data() + payload.size());
  }
}

struct Outcome {
  std::size_t accepted = 0;
  std::size_t rejected = 0;

  // A typed Error is a rejection; anything else escapes and fails the test.
  template <class Attempt>
  void run(Attempt&& attempt) {
    try {
      attempt();
      ++accepted;
    } catch (const Error&) {
      ++rejected;
    }
  }
  // Both outcomes must occur, or the mutations are not exercising the decoder.
  void expect_both(std::uint64_t iterations) const {
    EXPECT_GT(rejected, iterations / 2);
    EXPECT_GT(accepted, 0u);
  }
};

TEST(Mutation, ManifestBytesDecodeOrRejectTyped) {
  auto seed = test::fuzz_seed(7);
  auto iterations = test::fuzz_iterations(4000);
  std::mt19937_64 rng(seed);
  Outcome outcome;
  for (std::uint64_t i = 0; i < iterations; ++i) {
    auto bucket = test::make_random_bucket(rng, 12);
    auto packed = bucket.builder.pack();
    auto original = encode_manifest(bucket.builder.manifest());
    auto bytes = mutate(original, rng);
    outcome.run([&] {
      auto manifest = decode_manifest(bytes);
      verify_manifest(manifest, packed.payload.size());
      ASSERT_EQ(decode_manifest(encode_manifest(manifest)), manifest) << "iteration " << i;
      auto view = BucketView::open(encode_frame(manifest, packed.payload.span()),
                                   packed.payload.span());
      expect_views_inside(view, packed.payload.span());
    });
  }
  outcome.expect_both(iterations);
}

TEST(Mutation, FramesOpenOrRejectTyped) {
  auto seed = test::fuzz_seed(11);
  auto iterations = test::fuzz_iterations(4000);
  std::mt19937_64 rng(seed);
  Outcome outcome;
  for (std::uint64_t i = 0; i < iterations; ++i) {
    auto bucket = test::make_random_bucket(rng, 12);
    auto packed = bucket.builder.pack({.payload_checksum = rng() % 2 == 0});
    // Half the time aim at the header alone: hashes turn most manifest hits into rejections.
    auto frame = packed.frame;
    if (rng() % 2) {
      frame = mutate(frame, rng);
    } else {
      auto header = mutate({frame.begin(), frame.begin() + sizeof(BucketHeader)}, rng);
      header.resize(sizeof(BucketHeader));
      std::copy(header.begin(), header.end(), frame.begin());
    }
    outcome.run([&] {
      auto view = BucketView::open(frame, packed.payload.span());
      ASSERT_EQ(decode_manifest(encode_manifest(view.manifest())), view.manifest());
      expect_views_inside(view, packed.payload.span());
    });
  }
  outcome.expect_both(iterations);
}

}  // namespace
}  // namespace tensorbucket
