// Deterministic buckets: bucket i of a workload is a pure function of (seed, i), so a
// consumer in another process can regenerate and compare every byte. Used by the CLI's
// produce / consume / demo / bench and by the channel tests.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tensorbucket/tensorbucket.hpp"

namespace tensorbucket::cli {

struct Workload {
  std::uint64_t buckets = 10;
  std::uint32_t tensors = 16;
  std::uint64_t tensor_bytes = 4096;  // rounded down to a multiple of 8 (the largest itemsize)
  std::uint64_t seed = 1;
  std::uint32_t update_buckets = 1;  // bucket i is bucket i % update_buckets of version i / update_buckets
};

// Tensor `tensor` of bucket `index`: name "t<tensor>", a dtype rotating through the table,
// shape [bytes / itemsize].
std::string tensor_name(std::uint32_t tensor);
DType tensor_dtype(std::uint32_t tensor);
std::uint64_t tensor_bytes(const Workload& workload);
void fill_tensor(std::span<std::byte> bytes, const Workload& workload, std::uint64_t index,
                 std::uint32_t tensor);

// Bucket `index` for the copy path: owns the bytes its builder points at.
struct SourceBucket {
  std::vector<std::vector<std::byte>> tensors;
  BucketBuilder builder;
};
SourceBucket make_bucket(const Workload& workload, std::uint64_t index);
// Turns bucket `bucket` made by make_bucket() into bucket `index`: new bytes and identity, the
// same builder, so that a producer republishes one kept layout (the fast path).
void refill_bucket(SourceBucket& bucket, const Workload& workload, std::uint64_t index);

// The same layout with every entry declare()d, for the in-place path.
BucketBuilder make_layout(const Workload& workload, std::uint64_t index);

// Empty when `view` is exactly bucket `index` of a workload with `seed` (tensor count and
// sizes are read from the bucket itself); otherwise what differs. With `payload`, the bytes
// are read from it, a host copy of the view's payload (a device bucket's).
std::string check_bucket(const BucketView& view, std::uint64_t seed, std::uint64_t index,
                         std::span<const std::byte> payload = {});

}  // namespace tensorbucket::cli
