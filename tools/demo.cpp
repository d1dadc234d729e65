#include "commands.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
  for (std::uint32_t layer = 0; layer < options.layers; ++layer) {
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

// One bucket of an update: `tensors` with version `version`, the int8 MLP weights grouped with
// their scales so a server never applies one without the other.
BucketBuilder make_builder(const std::vector<const Tensor*>& tensors, std::uint64_t version,
                           std::uint32_t index, std::uint32_t count) {
  BucketBuilder builder;
  builder.version(version).bucket(index, count);
  const std::string quantized = "mlp.up.qweight";
  for (const auto* t : tensors) {
    builder.add(t->name, t->dtype, t->shape, t->bytes.data());
    if (t->name.ends_with(quantized)) {
      auto prefix = t->name.substr(0, t->name.size() - std::string("qweight").size());
      builder.group(prefix + "quantized", {prefix + "qweight", prefix + "scales"});
    }
  }
  return builder;
}

// The update as buckets: the embeddings, then one bucket per layer, then the final norm.
std::vector<std::vector<const Tensor*>> split_update(const std::vector<Tensor>& model, int layers) {
  std::vector<std::vector<const Tensor*>> buckets(static_cast<std::size_t>(layers) + 2);
  for (const auto& t : model) {
    std::size_t bucket = buckets.size() - 1;
    if (t.name.starts_with("embed.")) bucket = 0;
    if (t.name.starts_with("layers.")) bucket = 1 + std::stoul(t.name.substr(7));
    buckets[bucket].push_back(&t);
  }
  return buckets;
}

// The server process: receives every bucket of the update, checks each tensor byte for byte
// against its own deterministic copy of the model, and reports on `report`.
int serve(const std::string& channel, const DemoOptions& options, int report) {
  auto model = make_model(options);
  auto subscriber = Subscriber::attach(channel, std::chrono::seconds(10));
  auto buckets = split_update(model, options.layers);
  std::vector<double> latencies_us;
  std::size_t verified = 0;
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    auto bucket = subscriber.next(std::chrono::seconds(10));
    if (!bucket) return kTimeout;
    latencies_us.push_back(static_cast<double>(monotonic_ns() - bucket->publish_start_ns()) / 1000);
    const auto& view = bucket->view();
    bool same = view.bucket_index() == b && view.size() == buckets[b].size();
    for (const auto* t : buckets[b]) {
      auto tensor = view.find(t->name);
      same = same && tensor && tensor->bytes.size() == t->bytes.size() &&
             std::memcmp(tensor->bytes.data(), t->bytes.data(), t->bytes.size()) == 0;
    }
    verified += same ? 1 : 0;
  }
  std::sort(latencies_us.begin(), latencies_us.end());
  auto percentile = [&](double p) {
    return latencies_us[static_cast<std::size_t>(p * static_cast<double>(latencies_us.size() - 1))];
  };
  auto line = std::to_string(verified) + " " + std::to_string(percentile(0.5)) + " " +
              std::to_string(percentile(0.99)) + " " + std::to_string(latencies_us.back()) + "\n";
  if (::write(report, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return kOtherError;
  return verified == buckets.size() ? kOk : kVerificationFailed;
}

// Samples a p99 needs to say more than the slowest one does.
constexpr std::size_t kEnoughForP99 = 100;

// The trainer side: publishes the update to a server process it forks, and prints what the
// server saw. False when anything was lost or differed.
bool run_update(const std::vector<Tensor>& model, const DemoOptions& options) {
  auto channel = "tbdemo-" + std::to_string(::getpid());
  auto publisher = Publisher::create(channel, {.slots = 2, .payload_checksum = true});
  int report[2];
  if (::pipe(report) != 0) throw std::runtime_error("pipe failed");
  std::fflush(nullptr);  // or the child would print our buffered output again
  pid_t server = ::fork();
  if (server == 0) {
    int status = kOtherError;
    try {
      status = serve(channel, options, report[1]);
    } catch (const Error& e) {
      std::fprintf(stderr, "tbucket: server: %s: %s\n", to_string(e.code()).data(), e.what());
    }
    std::fflush(nullptr);
    ::_exit(status);
  }
  ::close(report[1]);

  auto buckets = split_update(model, options.layers);
  std::uint64_t bytes = 0;
  auto start = Clock::now();
  bool published = true;
  for (std::size_t b = 0; b < buckets.size() && published; ++b) {
    auto builder = make_builder(buckets[b], 1000, static_cast<std::uint32_t>(b),
                                static_cast<std::uint32_t>(buckets.size()));
    published = publisher.publish(builder, std::chrono::seconds(10));
    bytes += builder.payload_bytes();
  }
  bool drained = published && publisher.drain(std::chrono::seconds(10));
  double update_ms = ms_since(start);
  publisher.close();

  char text[128] = {};
  auto length = ::read(report[0], text, sizeof text - 1);
  ::close(report[0]);
  int status = 0;
  ::waitpid(server, &status, 0);
  std::size_t verified = 0;
  double p50 = 0, p99 = 0, slowest = 0;
  bool reported = length > 0 && std::sscanf(text, "%zu %lf %lf %lf", &verified, &p50, &p99, &slowest) == 4;

  double mib = static_cast<double>(bytes) / (1 << 20);
  std::printf("  channel    %s: 2 slots, payload checksums on, server in process %d\n",
              channel.c_str(), server);
  std::printf("  update     %zu buckets (embeddings, one per layer, final norm), %.1f MiB in %.1f ms, %.2f GiB/s\n",
              buckets.size(), mib, update_ms, mib / 1024 / (update_ms / 1000));
  std::printf("  server     %zu/%zu buckets received in order, every byte verified, zero-copy views\n",
              verified, buckets.size());
  // A p99 of a few dozen samples would only be the slowest one, under another name.
  if (buckets.size() >= kEnoughForP99) {
    std::printf("  handoff    p50 %.0f us, p99 %.0f us over %zu buckets (from the start of publish to verified "
                "views in the server)\n", p50, p99, buckets.size());
  } else {
    std::printf("  handoff    median %.0f us, slowest %.0f us over %zu buckets (from the start of publish to "
                "verified views in the server)\n", p50, slowest, buckets.size());
  }
  return published && drained && reported && verified == buckets.size() &&
         WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Runs `attempt`, what a server is handed in `tried`, which must be refused with `expected`;
// prints what was tried and why it was refused.
bool show_rejection(const char* tried, ErrorCode expected, const std::function<void()>& attempt) {
  std::printf("  %s\n", tried);
  try {
    attempt();
  } catch (const Error& e) {
    bool ok = e.code() == expected;
    std::printf("    %s %s: %s\n", ok ? "refused," : "!! refused for another reason,", to_string(e.code()).data(),
                e.what());
    return ok;
  }
  std::printf("    !! accepted, where it must be refused with %s\n", to_string(expected).data());
  return false;
}

}  // namespace

int run_demo(const DemoOptions& options) {
  auto model = make_model(options);
  std::vector<const Tensor*> everything;
  for (const auto& t : model) everything.push_back(&t);
  auto builder = make_builder(everything, 1000, 0, 1);

  std::printf("tensorbucket demo: a trainer process publishes a model update to a server process\n");
  std::printf("  model      %d layers: %zu tensors in BF16, F32 and I8, %d groups (quantized MLP), %.1f MiB\n",
              options.layers, model.size(), options.layers,
              static_cast<double>(builder.payload_bytes()) / (1 << 20));
  bool ok = run_update(model, options);

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
  std::printf("the whole model as one bucket, in this process:\n");
  std::printf("  bucket     %.1f MiB payload, %zu-byte frame (header + manifest)\n", mib,
              packed.frame.size());
  std::printf("  pack       %.2f ms, %.2f GiB/s, payload xxh3 included\n", pack_ms,
              mib / 1024 / (pack_ms / 1000));
  std::printf("  open       %.2f ms: header, manifest hash, decode, every rule, payload xxh3\n",
              open_ms);
  std::printf("  views      %zu/%zu byte-identical to their source, %s\n", identical, model.size(),
              zero_copy ? "all pointing into the payload (zero-copy)" : "NOT zero-copy");
  ok = ok && identical == model.size() && zero_copy;

  std::printf("what a consumer must refuse, and does:\n");
  ok &= show_rejection("the manifest of the bucket, without its payload:", ErrorCode::MissingPayload,
                       [&] { BucketView::open(packed.frame, {}); });
  ok &= show_rejection("the payload of the bucket, without its manifest:", ErrorCode::MissingManifest,
                       [&] { BucketView::open({}, payload); });
  ok &= show_rejection("a tensor that has a shape but no data (built on the meta device):",
                       ErrorCode::Unmaterialized, [&] {
    BucketBuilder meta;
    meta.add("layers.0.attn.qkv.weight", DType::BF16, {1536, 512}, nullptr);
  });
  ok &= show_rejection("a quantized MLP weight whose scales are left out of the manifest:",
                       ErrorCode::IncompleteGroup, [&] {
    auto manifest = view.manifest();
    std::erase_if(manifest.entries, [](const ManifestEntry& e) { return e.name == "layers.0.mlp.up.scales"; });
    BucketView::open(encode_frame(manifest, payload), payload);
  });
  ok &= show_rejection("the bucket with one bit of its payload flipped:", ErrorCode::ChecksumMismatch, [&] {
    AlignedBuffer copy(payload.size());
    std::memcpy(copy.span().data(), payload.data(), payload.size());
    copy.span()[payload.size() / 2] ^= std::byte{1};
    BucketView::open(packed.frame, copy.span());
  });
  ok &= show_rejection("the bucket, to a server whose model has another final norm and an lm_head:",
                       ErrorCode::ManifestMismatch, [&] {
    auto expected = view.manifest();
    expected.entries.back().shape = {1024};
    expected.entries.push_back({"lm_head.weight", DType::BF16, {4096, 512}, 0, 0, ""});
    BucketView::open(packed.frame, payload, {.expected = &expected});
  });

  std::printf("%s\n", ok ? "demo ok" : "demo FAILED");
  return ok ? kOk : kVerificationFailed;
}

}  // namespace tensorbucket::cli
