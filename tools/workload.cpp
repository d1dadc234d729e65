#include "workload.hpp"

#include <cstring>

#include "base/text.hpp"

namespace tensorbucket::cli {
namespace {

constexpr DType kRotation[] = {DType::F32, DType::BF16, DType::I8,  DType::F64,
                               DType::U8,  DType::I32,  DType::F16, DType::U16};

std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void set_bucket_fields(BucketBuilder& builder, const Workload& workload, std::uint64_t index) {
  builder.version(index / workload.update_buckets)
      .bucket(static_cast<std::uint32_t>(index % workload.update_buckets), workload.update_buckets);
}

}  // namespace

std::string tensor_name(std::uint32_t tensor) { return "t" + std::to_string(tensor); }

DType tensor_dtype(std::uint32_t tensor) { return kRotation[tensor % std::size(kRotation)]; }

std::uint64_t tensor_bytes(const Workload& workload) {
  return std::max<std::uint64_t>(8, workload.tensor_bytes / 8 * 8);
}

void fill_tensor(std::span<std::byte> bytes, const Workload& workload, std::uint64_t index,
                 std::uint32_t tensor) {
  auto state = mix(workload.seed * 0x9e3779b97f4a7c15ull ^ mix(index * 1000003 + tensor));
  for (std::size_t at = 0; at < bytes.size(); at += 8) {
    state += 0x9e3779b97f4a7c15ull;
    auto word = mix(state);
    std::memcpy(bytes.data() + at, &word, std::min<std::size_t>(8, bytes.size() - at));
  }
}

SourceBucket make_bucket(const Workload& workload, std::uint64_t index) {
  SourceBucket bucket;
  set_bucket_fields(bucket.builder, workload, index);
  auto bytes = tensor_bytes(workload);
  bucket.tensors.reserve(workload.tensors);
  for (std::uint32_t t = 0; t < workload.tensors; ++t) {
    auto& data = bucket.tensors.emplace_back(bytes);
    fill_tensor(data, workload, index, t);
    auto dtype = tensor_dtype(t);
    bucket.builder.add(tensor_name(t), dtype, {static_cast<std::int64_t>(bytes / itemsize(dtype))},
                       data.data());
  }
  return bucket;
}

void refill_bucket(SourceBucket& bucket, const Workload& workload, std::uint64_t index) {
  set_bucket_fields(bucket.builder, workload, index);
  for (std::uint32_t t = 0; t < workload.tensors; ++t) fill_tensor(bucket.tensors[t], workload, index, t);
}

BucketBuilder make_layout(const Workload& workload, std::uint64_t index) {
  BucketBuilder builder;
  set_bucket_fields(builder, workload, index);
  auto bytes = tensor_bytes(workload);
  for (std::uint32_t t = 0; t < workload.tensors; ++t) {
    auto dtype = tensor_dtype(t);
    builder.declare(tensor_name(t), dtype, {static_cast<std::int64_t>(bytes / itemsize(dtype))});
  }
  return builder;
}

std::string check_bucket(const BucketView& view, std::uint64_t seed, std::uint64_t index,
                         std::span<const std::byte> payload) {
  // Its place in its update, as set_bucket_fields() made it.
  if (view.version() != index / view.bucket_count() || view.bucket_index() != index % view.bucket_count()) {
    return text::message("bucket ", index, " is bucket ", view.bucket_index(), " of ", view.bucket_count(),
                         " of version ", view.version());
  }
  Workload workload{.seed = seed};
  std::vector<std::byte> expected;
  for (std::uint32_t t = 0; t < view.size(); ++t) {
    auto tensor = view.find(tensor_name(t));
    if (!tensor || tensor->dtype != tensor_dtype(t)) return text::message("bucket ", index, " lacks ", tensor_name(t));
    expected.resize(tensor->bytes.size());
    fill_tensor(expected, workload, index, t);
    const auto* bytes = tensor->bytes.data();
    if (!payload.empty()) bytes = payload.data() + view.manifest().entries[*view.position(tensor_name(t))].byte_offset;
    if (std::memcmp(bytes, expected.data(), expected.size()) != 0) {
      return text::message("bucket ", index, " tensor ", tensor_name(t), " differs");
    }
  }
  return {};
}

}  // namespace tensorbucket::cli
