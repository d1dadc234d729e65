#include "demo.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "exit_codes.hpp"
#include "tensorbucket/tensorbucket.hpp"

namespace tensorbucket::cli {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

struct Tensor {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::byte> bytes;
};

// splitmix64: cheap, deterministic bytes per (seed, tensor).
void fill(std::vector<std::byte>& bytes, std::uint64_t state) {
  for (std::size_t i = 0; i < bytes.size(); i += 8) {
    state += 0x9e3779b97f4a7c15ull;
    auto z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(bytes.data() + i, &z, std::min<std::size_t>(8, bytes.size() - i));
  }
}

// A small decoder-only transformer: BF16 matrices, F32 norms, and an int8-quantized MLP
// projection whose scales must travel with it (a group).
std::vector<Tensor> make_model(const DemoOptions& options) {
  constexpr std::int64_t kVocab = 4096, kDim = 512, kHidden = 2048;
  std::vector<Tensor> model;
  auto add = [&](std::string name, DType dtype, Shape shape) {
    Tensor& t = model.emplace_back(Tensor{std::move(name), dtype, std::move(shape), {}});
    t.bytes.resize(*checked_byte_length(t.dtype, t.shape));
    fill(t.bytes, options.seed * 1000003 + model.size());
  };
  add("embed.weight", DType::BF16, {kVocab, kDim});
  for (int layer = 0; layer < options.layers; ++layer) {
    auto prefix = "layers." + std::to_string(layer) + ".";
    add(prefix + "attn_norm.weight", DType::F32, {kDim});
    add(prefix + "attn.qkv.weight", DType::BF16, {3 * kDim, kDim});
    add(prefix + "attn.out.weight", DType::BF16, {kDim, kDim});
    add(prefix + "mlp_norm.weight", DType::F32, {kDim});
    add(prefix + "mlp.up.qweight", DType::I8, {kHidden, kDim});
    add(prefix + "mlp.up.scales", DType::F32, {kHidden});
    add(prefix + "mlp.down.weight", DType::BF16, {kDim, kHidden});
  }
  add("final_norm.weight", DType::F32, {kDim});
  return model;
}

BucketBuilder make_builder(const std::vector<Tensor>& model, int layers) {
  BucketBuilder builder;
  builder.version(1000).bucket(0, 1);
  for (const auto& t : model) builder.add(t.name, t.dtype, t.shape, t.bytes.data());
  for (int layer = 0; layer < layers; ++layer) {
    auto prefix = "layers." + std::to_string(layer) + ".mlp.up.";
    builder.group(prefix + "quantized", {prefix + "qweight", prefix + "scales"});
  }
  return builder;
}

// Runs `attempt`, which must be rejected with `expected`; prints the outcome.
bool show_rejection(const char* label, ErrorCode expected, const std::function<void()>& attempt) {
  try {
    attempt();
  } catch (const Error& e) {
    bool ok = e.code() == expected;
    std::printf("  %-28s %s %s: %s\n", label, ok ? "->" : "!! unexpected", to_string(e.code()).data(),
                e.what());
    return ok;
  }
  std::printf("  %-28s !! accepted, expected %s\n", label, to_string(expected).data());
  return false;
}

}  // namespace

int run_demo(const DemoOptions& options) {
  auto model = make_model(options);
  auto builder = make_builder(model, options.layers);

  auto start = Clock::now();
  auto packed = builder.pack({.payload_checksum = true});
  double pack_ms = ms_since(start);

  start = Clock::now();
  auto view = BucketView::open(packed.frame, packed.payload.span());
  double open_ms = ms_since(start);

  std::size_t identical = 0;
  bool zero_copy = true;
  auto payload = packed.payload.span();
  for (const auto& t : model) {
    auto tensor = view.find(t.name);
    if (tensor && tensor->bytes.size() == t.bytes.size() &&
        std::memcmp(tensor->bytes.data(), t.bytes.data(), t.bytes.size()) == 0) {
      ++identical;
    }
    zero_copy = zero_copy && tensor && tensor->bytes.data() >= payload.data() &&
                tensor->bytes.data() + tensor->bytes.size() <= payload.data() + payload.size();
  }

  double mib = static_cast<double>(payload.size()) / (1 << 20);
  std::printf("tensorbucket demo: a model-shaped bucket, packed, encoded, verified and viewed\n");
  std::printf("  model      %d layers: %zu tensors in BF16, F32 and I8, %zu groups (quantized MLP)\n",
              options.layers, model.size(), view.manifest().groups.size());
  std::printf("  bucket     %.1f MiB payload, %zu-byte frame (header + manifest)\n", mib,
              packed.frame.size());
  std::printf("  pack       %.2f ms, %.2f GiB/s, payload xxh3 included\n", pack_ms,
              mib / 1024 / (pack_ms / 1000));
  std::printf("  open       %.2f ms: header, manifest hash, decode, every rule, payload xxh3\n",
              open_ms);
  std::printf("  views      %zu/%zu byte-identical to their source, %s\n", identical, model.size(),
              zero_copy ? "all pointing into the payload (zero-copy)" : "NOT zero-copy");
  bool ok = identical == model.size() && zero_copy;

  std::printf("rejected, as they must be:\n");
  ok &= show_rejection("seed 000: payload missing", ErrorCode::MissingPayload,
                       [&] { BucketView::open(packed.frame, {}); });
  ok &= show_rejection("seed 001: manifest missing", ErrorCode::MissingManifest,
                       [&] { BucketView::open({}, payload); });
  ok &= show_rejection("seed 002: meta tensor", ErrorCode::Unmaterialized, [&] {
    BucketBuilder meta;
    meta.add("layers.0.attn.qkv.weight", DType::BF16, {1536, 512}, nullptr);
  });
  ok &= show_rejection("seed 003: scales missing", ErrorCode::IncompleteGroup, [&] {
    auto manifest = view.manifest();
    std::erase_if(manifest.entries, [](const ManifestEntry& e) { return e.name == "layers.0.mlp.up.scales"; });
    BucketView::open(encode_frame(manifest, payload), payload);
  });
  ok &= show_rejection("one payload bit flipped", ErrorCode::ChecksumMismatch, [&] {
    AlignedBuffer copy(payload.size());
    std::memcpy(copy.span().data(), payload.data(), payload.size());
    copy.span()[payload.size() / 2] ^= std::byte{1};
    BucketView::open(packed.frame, copy.span());
  });
  ok &= show_rejection("server expects another model", ErrorCode::ManifestMismatch, [&] {
    auto expected = view.manifest();
    expected.entries.back().shape = {1024};
    expected.entries.push_back({"lm_head.weight", DType::BF16, {4096, 512}, 0, 0, ""});
    BucketView::open(packed.frame, payload, {.expected = &expected});
  });

  std::printf("%s\n", ok ? "demo ok" : "demo FAILED");
  return ok ? kOk : kVerificationFailed;
}

}  // namespace tensorbucket::cli
