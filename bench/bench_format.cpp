// In-process costs of the bucket format: encode, decode and verify a manifest of N entries,
// and packing 1000 tensors / 256 MiB against a plain memcpy of the same bytes in the same run.
// Figures and the commands that made them: bench/RESULTS.md.
#include <benchmark/benchmark.h>

#include <cstring>
#include <string>

#include "tensorbucket/tensorbucket.hpp"

namespace tensorbucket {
namespace {

// N model-like entries: long dotted names, BF16 [4, 8], every fourth pair a group.
BucketBuilder model_like(std::size_t entries) {
  BucketBuilder builder;
  for (std::size_t i = 0; i < entries; ++i) {
    builder.declare("model.layers." + std::to_string(i / 8) + ".mlp.proj_" + std::to_string(i % 8) +
                        ".weight",
                    DType::BF16, {4, 8});
  }
  return builder;
}

struct FormatFixture {
  Manifest manifest;
  AlignedBuffer payload;
  std::vector<std::byte> manifest_bytes;
  std::vector<std::byte> frame;

  explicit FormatFixture(std::size_t entries)
      : manifest(model_like(entries).manifest()), payload(model_like(entries).payload_bytes()) {
    std::memset(payload.span().data(), 0, payload.size());
    manifest_bytes = encode_manifest(manifest);
    frame = encode_frame(manifest, payload.span());
  }
};

void BM_Encode(benchmark::State& state) {
  FormatFixture f(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(encode_frame(f.manifest, f.payload.span()));
  state.counters["manifest_bytes"] = static_cast<double>(f.manifest_bytes.size());
}

void BM_Decode(benchmark::State& state) {
  FormatFixture f(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(decode_manifest(f.manifest_bytes));
}

void BM_Verify(benchmark::State& state) {
  FormatFixture f(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) verify_manifest(f.manifest, f.payload.size());
}

// The consumer's whole gate: header, manifest hash, decode, every rule, name index.
void BM_Open(benchmark::State& state) {
  FormatFixture f(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(BucketView::open(f.frame, f.payload.span()));
}

// The target: producer encode + consumer open, together.
void BM_EncodeOpen(benchmark::State& state) {
  FormatFixture f(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) {
    auto frame = encode_frame(f.manifest, f.payload.span());
    benchmark::DoNotOptimize(BucketView::open(frame, f.payload.span()));
  }
}

// The loop a trainer writes first: a new builder every step, N add() calls of model-like names,
// then the manifest's encoding, which a publish needs.
void BM_NewBuilder(benchmark::State& state) {
  auto entries = static_cast<std::size_t>(state.range(0));
  std::vector<std::string> names;
  for (std::size_t i = 0; i < entries; ++i) {
    names.push_back("model.layers." + std::to_string(i / 8) + ".mlp.proj_" + std::to_string(i % 8) + ".weight");
  }
  AlignedBuffer source(entries * 64);
  for (auto _ : state) {
    BucketBuilder builder;
    for (std::size_t i = 0; i < entries; ++i) {
      builder.add(names[i], DType::BF16, {4, 8}, source.span().data() + i * 64);
    }
    benchmark::DoNotOptimize(builder.encoded_manifest().data());
  }
}

constexpr std::size_t kPackTensors = 1000;
constexpr std::size_t kPackBytes = 256u << 20;

struct PackFixture {
  AlignedBuffer source{kPackBytes};
  AlignedBuffer destination{kPackBytes};
  BucketBuilder builder;
  BucketBuilder whole;  // the same bytes as one tensor

  PackFixture() {
    // Touch both buffers first so page faults are not charged to either side.
    std::memset(source.span().data(), 0x5a, kPackBytes);
    std::memset(destination.span().data(), 0, kPackBytes);
    constexpr auto kTensorBytes = kPackBytes / kPackTensors / kPayloadAlignment * kPayloadAlignment;
    for (std::size_t i = 0; i < kPackTensors; ++i) {
      builder.add("t" + std::to_string(i), DType::U8, {static_cast<std::int64_t>(kTensorBytes)},
                  source.span().data() + i * kTensorBytes);
    }
    whole.add("t", DType::U8, {static_cast<std::int64_t>(builder.payload_bytes())}, source.span().data());
  }
};

PackFixture& pack_fixture() {
  static PackFixture fixture;
  return fixture;
}

void BM_Pack_1000Tensors_256MiB(benchmark::State& state) {
  auto& f = pack_fixture();
  for (auto _ : state) {
    f.builder.pack_into(f.destination.span());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * f.builder.payload_bytes()));
}

// The routine a pack of 256 MiB uses is chosen by its first packs (serialize/copy.hpp), here
// the benchmark's first iterations; TENSORBUCKET_LARGE_COPIES names one instead.
void BM_Pack_1Tensor_256MiB(benchmark::State& state) {
  auto& f = pack_fixture();
  for (auto _ : state) {
    f.whole.pack_into(f.destination.span());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * f.whole.payload_bytes()));
}

void BM_Memcpy_256MiB(benchmark::State& state) {
  auto& f = pack_fixture();
  auto bytes = f.builder.payload_bytes();  // the same bytes the pack moves
  for (auto _ : state) {
    std::memcpy(f.destination.span().data(), f.source.span().data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

BENCHMARK(BM_Encode)->Arg(10)->Arg(1000)->Arg(10000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Decode)->Arg(10)->Arg(1000)->Arg(10000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Verify)->Arg(10)->Arg(1000)->Arg(10000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Open)->Arg(10)->Arg(1000)->Arg(10000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_EncodeOpen)->Arg(10)->Arg(1000)->Arg(10000)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_NewBuilder)->Arg(10)->Arg(1000)->Arg(10000)->Unit(benchmark::kMicrosecond);
// Alternate the two so drift on a shared machine hits both alike.
BENCHMARK(BM_Memcpy_256MiB)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Pack_1000Tensors_256MiB)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Pack_1Tensor_256MiB)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tensorbucket

BENCHMARK_MAIN();
