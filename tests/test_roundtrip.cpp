// Property: any bucket the builder accepts comes back, after pack -> encode -> decode ->
// verify, as views whose names, dtypes, shapes, groups and bytes equal the inputs, pointing
// into the payload (zero-copy). Fixed seeds; TB_FUZZ_SEED / TB_FUZZ_ITERS explore further.
#include <gtest/gtest.h>

#include <cstring>

#include "support.hpp"

namespace tensorbucket {
namespace {

void expect_round_trip(const test::RandomBucket& bucket, bool payload_checksum) {
  auto packed = bucket.builder.pack({.payload_checksum = payload_checksum});
  auto view = BucketView::open(packed.frame, packed.payload.span());
  const auto& sent = bucket.builder.manifest();
  ASSERT_EQ(view.manifest().entries, sent.entries);
  ASSERT_EQ(view.manifest().groups, sent.groups);
  ASSERT_EQ(view.version(), sent.version);
  ASSERT_EQ(view.bucket_index(), sent.bucket_index);
  ASSERT_EQ(view.bucket_count(), sent.bucket_count);
  ASSERT_EQ(view.size(), bucket.sources.size());
  auto payload = packed.payload.span();
  for (std::size_t i = 0; i < view.size(); ++i) {
    auto tensor = view[i];
    const auto& source = bucket.sources[i];
    ASSERT_EQ(tensor.name, sent.entries[i].name);
    ASSERT_EQ(tensor.dtype, sent.entries[i].dtype);
    ASSERT_TRUE(std::equal(tensor.shape.begin(), tensor.shape.end(),
                           sent.entries[i].shape.begin(), sent.entries[i].shape.end()));
    ASSERT_EQ(tensor.group, sent.entries[i].group);
    ASSERT_EQ(tensor.bytes.size(), source.size());
    ASSERT_TRUE(source.empty() || std::memcmp(tensor.bytes.data(), source.data(), source.size()) == 0)
        << "bytes of entry " << i << " differ";
    ASSERT_GE(tensor.bytes.data(), payload.data());
    ASSERT_LE(tensor.bytes.data() + tensor.bytes.size(), payload.data() + payload.size());
    ASSERT_EQ(view.find(tensor.name)->bytes.data(), tensor.bytes.data());
  }
}

TEST(RoundTrip, EmptyBucket) {
  std::mt19937_64 rng(1);
  expect_round_trip(test::make_random_bucket(rng, 0, true), true);
}

TEST(RoundTrip, FiveThousandEntries) {
  std::mt19937_64 rng(test::fuzz_seed(2));
  expect_round_trip(test::make_random_bucket(rng, 5000, true), false);
}

TEST(RoundTrip, RandomBuckets) {
  auto seed = test::fuzz_seed(20261129);
  auto iterations = test::fuzz_iterations(40);
  for (std::uint64_t i = 0; i < iterations; ++i) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " iteration " + std::to_string(i));
    std::mt19937_64 rng(seed + i);
    auto bucket = test::make_random_bucket(rng, 5000);
    expect_round_trip(bucket, i % 2 == 0);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace tensorbucket
