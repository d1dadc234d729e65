// The LibTorch bridge: torch tensors through a real channel, bit for bit, zero-copy on the
// receiving side, and every refusal with its code.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "support.hpp"
#include "tensorbucket/torch.hpp"
#ifdef TENSORBUCKET_CUDA
#include "device_query.hpp"
#endif

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using torch_bridge::NamedTensors;

std::string channel_for_test() { return test::channel_for_this_test("tbbridge"); }

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  auto left = a.contiguous(), right = b.contiguous();
  return left.scalar_type() == right.scalar_type() && left.sizes() == right.sizes() &&
         (left.nbytes() == 0 || std::memcmp(left.data_ptr(), right.data_ptr(), left.nbytes()) == 0);
}

NamedTensors every_dtype() {
  torch::manual_seed(1);
  return {
      {"bool", torch::randint(0, 2, {7}).to(at::kBool)},
      {"u8", torch::randint(0, 255, {3, 5}).to(at::kByte)},
      {"i8", torch::randint(-128, 127, {9}).to(at::kChar)},
      {"i16", torch::randint(-30000, 30000, {2, 2, 2}).to(at::kShort)},
      {"u16", torch::randint(0, 65535, {5}).to(at::kUInt16)},
      {"i32", torch::randint(-100000, 100000, {11}).to(at::kInt)},
      {"u32", torch::randint(0, 4000000000, {3}).to(at::kUInt32)},
      {"i64", torch::randint(-1000000, 1000000, {4}).to(at::kLong)},
      {"u64", torch::randint(0, 1LL << 62, {2}).to(at::kUInt64)},
      {"f16", torch::randn({6}).to(at::kHalf)},
      {"bf16", torch::randn({3, 3}).to(at::kBFloat16)},
      {"f32", torch::randn({17})},
      {"f64", torch::randn({2, 8}, at::kDouble)},
      {"f8_e4m3", torch::randn({6}).to(at::kFloat8_e4m3fn)},
      {"f8_e5m2", torch::randn({2, 3}).to(at::kFloat8_e5m2)},
      {"scalar", torch::tensor(3.5)},
      {"empty", torch::empty({0, 4})},
  };
}

// Publishes `tensors` (copy or in-place) and receives them on `channel`.
NamedTensors round_trip(const NamedTensors& tensors, bool in_place) {
  auto channel = channel_for_test() + (in_place ? "-i" : "-c");
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  if (in_place) {
    EXPECT_TRUE(torch_bridge::publish_in_place(publisher, tensors, 1s, 7));
  } else {
    auto bucket = torch_bridge::make_bucket(tensors, 7);
    EXPECT_TRUE(publisher.publish(bucket.builder, 1s));
  }
  auto received = subscriber.next(1s);
  EXPECT_TRUE(received.has_value());
  EXPECT_EQ(received->view().version(), 7u);
  // The tensors keep the bucket, and its mapping, alive after the channel objects are gone.
  return torch_bridge::tensors(std::make_shared<const ReceivedBucket>(std::move(*received)));
}

TEST(TorchBridge, EveryDtypeRoundTripsBitExactly) {
  auto sent = every_dtype();
  for (bool in_place : {false, true}) {
    auto received = round_trip(sent, in_place);
    ASSERT_EQ(received.size(), sent.size());
    for (std::size_t i = 0; i < sent.size(); ++i) {
      EXPECT_EQ(received[i].first, sent[i].first);
      EXPECT_TRUE(same_bytes(received[i].second, sent[i].second)) << sent[i].first;
    }
  }
}

TEST(TorchBridge, StridedAndGradTensorsTravelByValue) {
  auto transposed = torch::arange(24, at::kFloat).reshape({4, 6}).t();
  auto sliced = torch::arange(20, at::kLong).slice(0, 1, 20, 3);
  // Contiguous, but starting past the front of their storage: their bytes are read in place.
  auto row = torch::arange(24, at::kDouble).reshape({4, 6})[2];
  auto tail = torch::arange(20, at::kShort).slice(0, 5);
  auto trained = torch::randn({5}, torch::requires_grad());
  // Lazily negated: its stored bytes are not its values.
  auto negated = torch::_neg_view(torch::arange(6, at::kFloat));
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_TRUE(negated.is_neg());
  ASSERT_TRUE(row.is_contiguous() && row.storage_offset() == 12);
  NamedTensors sent{{"transposed", transposed}, {"sliced", sliced}, {"row", row},
                    {"tail", tail},            {"trained", trained}, {"negated", negated}};
  for (bool in_place : {false, true}) {
    auto received = round_trip(sent, in_place);
    for (std::size_t i = 0; i < sent.size(); ++i) {
      EXPECT_TRUE(torch::equal(received[i].second, sent[i].second.detach())) << sent[i].first;
      EXPECT_FALSE(received[i].second.requires_grad());
    }
  }
}

// A trainer's loop: one layout, then every step only the bytes (and the version) change.
TEST(TorchBridge, AKeptLayoutPublishesEveryStepWithItsVersion) {
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  NamedTensors weights{{"w", torch::zeros({8, 4})}, {"b", torch::zeros({4}, at::kDouble)}};
  auto layout = torch_bridge::layout_of(weights);
  std::vector<at::Tensor> in_order{weights[0].second, weights[1].second};
  for (std::uint64_t step = 1; step <= 3; ++step) {
    for (auto& tensor : in_order) tensor.fill_(static_cast<double>(step));  // the optimizer
    ASSERT_TRUE(torch_bridge::publish_in_place(publisher, layout.version(step), in_order, 1s));
    auto received = subscriber.next(1s);
    ASSERT_TRUE(received.has_value());
    EXPECT_EQ(received->view().version(), step);
    auto views = torch_bridge::tensors(std::make_shared<const ReceivedBucket>(std::move(*received)));
    for (std::size_t i = 0; i < views.size(); ++i) {
      EXPECT_TRUE(torch::equal(views[i].second, in_order[i])) << views[i].first << " step " << step;
    }
  }
  EXPECT_TRUE(torch_bridge::fits(torch::ones({8, 4}), layout.manifest().entries[0]));
  EXPECT_FALSE(torch_bridge::fits(torch::ones({4, 8}), layout.manifest().entries[0]));
  EXPECT_FALSE(torch_bridge::fits(torch::ones({32}), layout.manifest().entries[0]));  // same numel
  EXPECT_FALSE(torch_bridge::fits(torch::ones({8, 4, 1}), layout.manifest().entries[0]));
  EXPECT_FALSE(torch_bridge::fits(torch::ones({8}), layout.manifest().entries[0]));  // a prefix
  EXPECT_FALSE(torch_bridge::fits(torch::ones({8, 4}, at::kDouble), layout.manifest().entries[0]));
  EXPECT_FALSE(torch_bridge::fits(torch::empty({8, 4}, at::kMeta), layout.manifest().entries[0]));
  // A tensor that no longer fits is refused before anything is reserved or published.
  std::vector<at::Tensor> reshaped{torch::zeros({4, 8}), weights[1].second};
  auto message = expect_error(ErrorCode::ManifestMismatch, [&] {
    torch_bridge::publish_in_place(publisher, layout, reshaped, 1s);
  });
  EXPECT_NE(message.find("'w'"), std::string::npos) << message;
  expect_error(ErrorCode::ManifestMismatch, [&] {
    torch_bridge::publish_in_place(publisher, layout, std::span(in_order).first(1), 1s);
  });
  EXPECT_EQ(publisher.published(), 3u);
}

// The staged form holds what it copies: the caller's tensors may go (another thread swapping
// them out while the copy runs) and their bytes still arrive, plain or copied by value.
TEST(TorchBridge, StagedTensorsHoldTheirBytesAfterTheCallerLetsGo) {
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  NamedTensors weights{{"plain", torch::arange(64, at::kFloat)},
                       {"transposed", torch::arange(12, at::kInt).reshape({3, 4}).t()},
                       {"empty", torch::zeros({0, 3})}};
  auto layout = torch_bridge::layout_of(weights);
  const auto& entries = layout.manifest().entries;
  NamedTensors expected;
  for (const auto& [name, tensor] : weights) expected.emplace_back(name, tensor.clone());
  torch_bridge::StagedTensors staged;
  EXPECT_FALSE(staged.add(torch::zeros({3, 4}, at::kInt), entries[1]));  // refused, nothing staged
  EXPECT_EQ(staged.size(), 0u);
  for (std::size_t i = 0; i < weights.size(); ++i) ASSERT_TRUE(staged.add(weights[i].second, entries[i]));
  weights.clear();  // the staged tensors are all that is left of them
  // Memory freed now would likely be handed out again here, and overwritten.
  std::vector<at::Tensor> reuse;
  for (const auto& [name, tensor] : expected) reuse.push_back(torch::full_like(tensor, -1));
  ASSERT_TRUE(torch_bridge::publish_in_place(publisher, layout, staged, 1s));
  staged.clear();
  auto received = subscriber.next(1s);
  ASSERT_TRUE(received.has_value());
  auto views = torch_bridge::tensors(std::make_shared<const ReceivedBucket>(std::move(*received)));
  ASSERT_EQ(views.size(), expected.size());
  for (std::size_t i = 0; i < views.size(); ++i) {
    EXPECT_TRUE(same_bytes(views[i].second, expected[i].second)) << views[i].first;
  }
  // Staged against another layout, of another count or with larger entries (whose copy would
  // read past the staged tensors): refused before anything is reserved.
  ASSERT_TRUE(staged.add(expected[0].second, entries[0]));
  expect_error(ErrorCode::ManifestMismatch, [&] { torch_bridge::publish_in_place(publisher, layout, staged, 1s); });
  auto larger = torch_bridge::layout_of({{"plain", torch::zeros({1 << 16})}});
  auto message = expect_error(ErrorCode::ManifestMismatch, [&] { torch_bridge::publish_in_place(publisher, larger, staged, 1s); });
  EXPECT_NE(message.find("'plain'"), std::string::npos) << message;
  EXPECT_EQ(publisher.published(), 1u);
}

// Staged without holding: no storage's count moves, and the bytes still travel.
TEST(TorchBridge, StagedTensorsThatHoldNothingLeaveTheCountsAlone) {
  auto plain = torch::arange(64, at::kFloat);
  auto transposed = torch::arange(12, at::kInt).reshape({3, 4}).t();  // copied by value
  auto layout = torch_bridge::layout_of({{"plain", plain}, {"transposed", transposed}});
  auto counted = plain.storage().use_count();
  torch_bridge::StagedTensors staged(torch_bridge::StagedTensors::Hold::Nothing);
  ASSERT_TRUE(staged.add(plain, layout.manifest().entries[0]));
  ASSERT_TRUE(staged.add(transposed, layout.manifest().entries[1]));
  EXPECT_EQ(plain.storage().use_count(), counted);
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(torch_bridge::publish_in_place(publisher, layout, staged, 1s));
  staged.clear();
  auto received = subscriber.next(1s);
  ASSERT_TRUE(received.has_value());
  auto bucket = std::make_shared<const ReceivedBucket>(std::move(*received));
  EXPECT_TRUE(torch::equal(torch_bridge::tensor(bucket, 0), plain));
  EXPECT_TRUE(torch::equal(torch_bridge::tensor(bucket, 1), transposed));
}

// Writes `tensors` one by one into a reservation of their layout and commits it; each view of
// the bucket received must equal its tensor's values.
void expect_written_one_by_one(const NamedTensors& tensors) {
  auto layout = torch_bridge::layout_of(tensors);
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  auto reservation = publisher.reserve(layout, 1s);
  ASSERT_TRUE(reservation.has_value());
  const auto& entries = layout.manifest().entries;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    ASSERT_TRUE(torch_bridge::write_tensor(*reservation, i, tensors[i].second, entries[i])) << tensors[i].first;
  }
  reservation->commit();
  auto received = subscriber.next(1s);
  ASSERT_TRUE(received.has_value());
  auto views = torch_bridge::tensors(std::make_shared<const ReceivedBucket>(std::move(*received)));
  ASSERT_EQ(views.size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(torch::equal(views[i].second, tensors[i].second.detach().resolve_neg())) << tensors[i].first;
  }
}

// Written tensor by tensor into a reservation: plain bytes and strided ones (copied by value)
// arrive equal, an empty tensor copies nothing.
TEST(TorchBridge, WritesTensorsOneByOneIntoAReservation) {
  expect_written_one_by_one({{"plain", torch::arange(64, at::kFloat)},
                             {"transposed", torch::arange(12, at::kInt).reshape({3, 4}).t()},
                             {"empty", torch::empty({0, 3})}});
}

// write_tensor() reads a plain CPU tensor's bytes straight from its fields; every other kind
// that fits goes the general way. Each arrives with its values: a view at an offset (one
// ending at its storage's very end), a tensor made in inference mode (other dispatch keys), a
// lazily negated one (arriving negated), one that requires grad, a transposed one.
TEST(TorchBridge, WriteTensorSendsTheValuesOfEveryKindThatFits) {
  auto base = torch::arange(100, at::kFloat);
  at::Tensor inference;
  {
    c10::InferenceMode mode;
    inference = torch::arange(64, at::kFloat) * 3;
  }
  auto negated = torch::arange(64, at::kFloat)._neg_view();
  ASSERT_TRUE(negated.is_neg());
  expect_written_one_by_one({{"offset", base.slice(0, 10, 74)},
                             {"at_the_end", base.slice(0, 36, 100)},
                             {"inference", inference},
                             {"negated", negated},
                             {"grad", torch::arange(64, at::kFloat).requires_grad_()},
                             {"transposed", torch::arange(64, at::kFloat).reshape({8, 8}).t()}});
}

// A tensor that no longer fits writes nothing and says so; the reservation dropped publishes
// nothing; an entry of another layout, or past the last, is refused before any copy.
TEST(TorchBridge, WriteTensorRefusesWhatNoLongerFits) {
  auto weight = torch::ones({4, 4});
  auto layout = torch_bridge::layout_of({{"weight", weight}, {"bias", torch::ones({4})}});
  const auto& entries = layout.manifest().entries;
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  {
    auto reservation = publisher.reserve(layout, 1s);
    ASSERT_TRUE(reservation.has_value());
    ASSERT_TRUE(torch_bridge::write_tensor(*reservation, 0, weight, entries[0]));
    EXPECT_FALSE(torch_bridge::write_tensor(*reservation, 1, torch::ones({5}), entries[1]));
    EXPECT_FALSE(torch_bridge::write_tensor(*reservation, 1, torch::ones({4}, at::kDouble), entries[1]));
    EXPECT_FALSE(torch_bridge::write_tensor(*reservation, 1, torch::empty({4}, at::kMeta), entries[1]));
    auto message = expect_error(ErrorCode::ManifestMismatch,
                                [&] { (void)torch_bridge::write_tensor(*reservation, 1, weight, entries[0]); });
    EXPECT_NE(message.find("is not entry 1 of the reservation"), std::string::npos) << message;
    expect_error(ErrorCode::ManifestMismatch, [&] { (void)torch_bridge::write_tensor(*reservation, 2, weight, entries[0]); });
  }
  EXPECT_EQ(publisher.published(), 0u);
  EXPECT_FALSE(subscriber.next(50ms).has_value());
}

TEST(TorchBridge, Seed002RefusesMetaTensors) {
  NamedTensors tensors{{"ok", torch::ones({2})}, {"layers.0.weight", torch::empty({4, 4}, at::kMeta)}};
  auto message = expect_error(ErrorCode::Unmaterialized, [&] { torch_bridge::make_bucket(tensors); });
  EXPECT_NE(message.find("'layers.0.weight'"), std::string::npos) << message;
  EXPECT_NE(message.find("has no data"), std::string::npos) << message;
}

TEST(TorchBridge, RefusesWhatCannotTravelAndPublishesNothing) {
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel);
  auto sparse = torch::eye(3).to_sparse();
  auto quantized = torch::quantize_per_tensor(torch::ones({2}), 0.1, 0, at::kQInt8);
  struct Case {
    const char* name;
    at::Tensor tensor;
    ErrorCode code;
  };
  for (const auto& c : {Case{"undefined", at::Tensor(), ErrorCode::Unmaterialized},
                        Case{"sparse", sparse, ErrorCode::InvalidArgument},
                        Case{"quantized", quantized, ErrorCode::UnsupportedDtype},
                        Case{"complex", torch::ones({2}, at::kComplexFloat), ErrorCode::UnsupportedDtype}}) {
    SCOPED_TRACE(c.name);
    NamedTensors tensors{{"fine", torch::ones({3})}, {c.name, c.tensor}};
    auto message = expect_error(c.code, [&] { torch_bridge::make_bucket(tensors); });
    EXPECT_NE(message.find(std::string("'") + c.name + "'"), std::string::npos) << message;
    expect_error(c.code, [&] { torch_bridge::publish_in_place(publisher, tensors, 100ms); });
  }
  EXPECT_EQ(publisher.published(), 0u);
}

// A tensor whose storage was shrunk under it (untyped_storage().resize_(), as FSDP frees a
// parameter's) reaches past its allocation: refused by name wherever its bytes would be read or
// written, on a first publish, through a kept layout, and as a load's target or source.
TEST(TorchBridge, RefusesATensorThatReachesPastItsStorage) {
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  auto weight = torch::ones({1024});
  auto column = torch::ones({8, 8}).t();  // strided: its reach is computed from the strides
  NamedTensors tensors{{"bias", torch::ones({4})}, {"weight", weight}, {"column", column}};
  auto layout = torch_bridge::layout_of(tensors);
  ASSERT_TRUE(torch_bridge::publish_in_place(publisher, layout, std::vector<at::Tensor>{tensors[0].second, weight, column}, 1s));
  ASSERT_TRUE(subscriber.next(1s).has_value());
  for (auto* shrunk : {&weight, &column}) {
    auto storage = shrunk->storage();
    auto bytes = storage.nbytes();
    storage.unsafeGetStorageImpl()->set_nbytes(16);  // what resize_(16) leaves, without freeing
    EXPECT_FALSE(torch_bridge::fits(*shrunk, layout.manifest().entries[shrunk == &weight ? 1 : 2]));
    auto message = expect_error(ErrorCode::InvalidArgument, [&] { torch_bridge::make_bucket(tensors); });
    EXPECT_NE(message.find("reaches past the end of its storage, which holds 16 bytes"), std::string::npos) << message;
    expect_error(ErrorCode::ManifestMismatch, [&] {
      torch_bridge::publish_in_place(publisher, layout, std::vector<at::Tensor>{tensors[0].second, weight, column}, 1s);
    });
    message = expect_error(ErrorCode::InvalidArgument, [&] { torch_bridge::load_into(tensors, tensors); });
    EXPECT_NE(message.find("reach past the end of their storage"), std::string::npos) << message;
    NamedTensors targets{{"bias", torch::zeros({4})}, {"weight", torch::zeros({1024})}, {"column", torch::zeros({8, 8})}};
    message = expect_error(ErrorCode::InvalidArgument, [&] { torch_bridge::load_into(targets, tensors); });
    EXPECT_NE(message.find("cannot load from tensor"), std::string::npos) << message;
    storage.unsafeGetStorageImpl()->set_nbytes(bytes);
  }
  EXPECT_EQ(publisher.published(), 1u);
  EXPECT_FALSE(subscriber.try_next().has_value());
}

TEST(TorchBridge, ViewsShareSharedMemoryAndHoldTheSlot) {
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  auto bucket = torch_bridge::make_bucket({{"w", torch::randn({64})}});
  ASSERT_TRUE(publisher.publish(bucket.builder, 1s));
  auto next = subscriber.next(1s);
  ASSERT_TRUE(next.has_value());
  auto received = std::make_shared<const ReceivedBucket>(std::move(*next));
  const auto* shared_bytes = received->view()[0].bytes.data();
  auto views = torch_bridge::tensors(std::move(received));
  EXPECT_EQ(views[0].second.data_ptr(), shared_bytes);  // no copy
  auto w = views[0].second;
  views.clear();
  // The last view still holds the lease: the only slot cannot be reused.
  EXPECT_FALSE(publisher.publish(bucket.builder, 30ms));
  w = at::Tensor();
  EXPECT_TRUE(publisher.publish(bucket.builder, 1s));
}

// Views made one at a time share one hold: the slot stays leased while the maker or any view
// lives, wherever the last one dies (here on other threads), and is free after.
TEST(TorchBridge, ViewsMadeOneAtATimeHoldTheSlotUntilTheLastDies) {
  auto channel = channel_for_test();
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  NamedTensors sent{{"a", torch::arange(8, at::kFloat)}, {"b", torch::arange(3, at::kLong)}};
  auto bucket = torch_bridge::make_bucket(sent);
  ASSERT_TRUE(publisher.publish(bucket.builder, 1s));
  auto next = subscriber.next(1s);
  ASSERT_TRUE(next.has_value());
  std::vector<at::Tensor> views;
  {
    torch_bridge::BucketViews made(std::make_shared<const ReceivedBucket>(std::move(*next)));
    EXPECT_THROW((void)made[2], std::out_of_range);
    for (int round = 0; round < 50; ++round) views.push_back(made[round % 2]);
    EXPECT_FALSE(publisher.publish(bucket.builder, 30ms));  // the maker and the views hold it
  }
  EXPECT_FALSE(publisher.publish(bucket.builder, 30ms));  // the views alone
  for (std::size_t i = 0; i < views.size(); ++i) EXPECT_TRUE(torch::equal(views[i], sent[i % 2].second)) << i;
  std::vector<std::thread> letting_go;
  for (int t = 0; t < 2; ++t) {
    letting_go.emplace_back([mine = std::vector<at::Tensor>(views.begin() + t * 25, views.begin() + (t + 1) * 25)]() mutable {
      mine.clear();
    });
  }
  views.clear();
  for (auto& thread : letting_go) thread.join();
  EXPECT_TRUE(publisher.publish(bucket.builder, 1s));
}

struct Net : torch::nn::Module {
  Net() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    norm = register_module("norm", torch::nn::BatchNorm1d(3));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};

// load_into from tensors, and from a bucket's bytes (what a server does with each update):
// the tests below run both ways.
class LoadInto : public ::testing::TestWithParam<bool> {
 protected:
  template <class Targets>  // a module, or NamedTensors
  void load(Targets& targets, const NamedTensors& sent) {
    if (!GetParam()) return torch_bridge::load_into(targets, sent);
    auto packed = torch_bridge::make_bucket(sent).builder.pack();
    torch_bridge::load_into(targets, BucketView::open(packed.frame, packed.payload.span()));
  }
};
INSTANTIATE_TEST_SUITE_P(TorchBridge, LoadInto, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "FromBytes" : "FromTensors"; });

TEST_P(LoadInto, CopiesEveryParameterAndBuffer) {
  torch::manual_seed(2);
  Net trainer, server;
  auto sent = torch_bridge::named_tensors(trainer);
  load(server, sent);
  for (const auto& [name, tensor] : torch_bridge::named_tensors(server)) {
    auto original = std::find_if(sent.begin(), sent.end(), [&](auto& p) { return p.first == name; });
    ASSERT_NE(original, sent.end()) << name;
    EXPECT_TRUE(torch::equal(tensor, original->second)) << name;
  }
  EXPECT_EQ(torch_bridge::expected_manifest(server).entries.size(), sent.size());
}

// A server keeps bit-identical to its trainer with an update split into 1, 4 or 15 buckets:
// next_update() and load_into(module, update) after every step of a real optimizer.
TEST(TorchBridge, AWholeUpdateLoadsStrictlyIntoTheModel) {
  struct Deep : torch::nn::Module {
    Deep() {
      for (int i = 0; i < 8; ++i) layers.push_back(register_module("layer" + std::to_string(i), torch::nn::Linear(6, 6)));
    }
    std::vector<torch::nn::Linear> layers;
  };
  for (std::uint32_t buckets : {1u, 4u, 15u}) {
    SCOPED_TRACE(std::to_string(buckets) + " buckets");
    auto channel = channel_for_test() + "-" + std::to_string(buckets);
    torch::manual_seed(3);
    Deep trainer, server;
    torch::optim::AdamW optimizer(trainer.parameters(), torch::optim::AdamWOptions(1e-2));
    auto tensors = torch_bridge::named_tensors(trainer);  // 16 tensors
    auto publisher = Publisher::create(channel, {.slots = buckets});
    auto subscriber = Subscriber::attach(channel, 1s);
    for (std::uint64_t step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      auto loss = torch::zeros({});
      for (auto& layer : trainer.layers) loss = loss + layer->forward(torch::ones({2, 6})).pow(2).sum();
      loss.backward();
      optimizer.step();
      for (std::uint32_t b = 0; b < buckets; ++b) {
        NamedTensors part(tensors.begin() + b * tensors.size() / buckets,
                          tensors.begin() + (b + 1) * tensors.size() / buckets);
        ASSERT_TRUE(torch_bridge::publish_in_place(publisher, part, 1s, step, b, buckets));
      }
      auto update = subscriber.next_update(1s);
      ASSERT_TRUE(update.has_value());
      EXPECT_EQ(update->buckets().size(), buckets);
      torch_bridge::load_into(server, *update);
      auto loaded = torch_bridge::named_tensors(server);
      for (std::size_t i = 0; i < tensors.size(); ++i) EXPECT_TRUE(same_bytes(loaded[i].second, tensors[i].second));
    }
  }
}

TEST(TorchBridge, OneBucketOfASplitUpdateLoadsThePartItNames) {
  Net server;
  auto before = server.norm->weight.clone();
  NamedTensors part{{"fc.weight", torch::randn({3, 4})}, {"fc.bias", torch::randn({3})}};
  auto packed = torch_bridge::make_bucket(part, 1, 0, 2).builder.pack();
  torch_bridge::load_into(server, BucketView::open(packed.frame, packed.payload.span()));
  EXPECT_TRUE(torch::equal(server.fc->weight, part[0].second));
  EXPECT_TRUE(torch::equal(server.norm->weight, before));  // the other bucket's
  // A name the model lacks is still refused, and nothing is copied.
  NamedTensors stray{{"fc.bias", torch::randn({3})}, {"extra", torch::randn({1})}};
  auto bias = server.fc->bias.clone();
  auto stray_packed = torch_bridge::make_bucket(stray, 1, 1, 2).builder.pack();
  auto message = expect_error(ErrorCode::ManifestMismatch, [&] {
    torch_bridge::load_into(server, BucketView::open(stray_packed.frame, stray_packed.payload.span()));
  });
  EXPECT_NE(message.find("unexpected 'extra'"), std::string::npos) << message;
  EXPECT_EQ(message.find("missing"), std::string::npos) << message;
  EXPECT_TRUE(torch::equal(server.fc->bias, bias));
}

TEST(TorchBridge, AnUpdateMissingATensorLoadsNothing) {
  auto channel = channel_for_test();
  Net trainer, server;
  auto tensors = torch_bridge::named_tensors(trainer);
  auto publisher = Publisher::create(channel, {.slots = 2});
  auto subscriber = Subscriber::attach(channel, 1s);
  NamedTensors first(tensors.begin(), tensors.begin() + 2), second(tensors.begin() + 2, tensors.end() - 1);
  ASSERT_TRUE(torch_bridge::publish_in_place(publisher, first, 1s, 0, 0, 2));
  ASSERT_TRUE(torch_bridge::publish_in_place(publisher, second, 1s, 0, 1, 2));
  auto update = subscriber.next_update(1s);
  ASSERT_TRUE(update.has_value());
  auto before = server.fc->weight.clone();
  auto message = expect_error(ErrorCode::ManifestMismatch, [&] { torch_bridge::load_into(server, *update); });
  EXPECT_NE(message.find("missing '" + tensors.back().first + "'"), std::string::npos) << message;
  EXPECT_TRUE(torch::equal(server.fc->weight, before));
}

// Every manifest dtype becomes a torch tensor, and back (torch 1.13 had no U16, U32, U64, F8).
TEST(TorchBridge, EveryManifestDtypeIsATorchDtype) {
  for (std::size_t i = 0; i < kDTypeCount; ++i) {
    auto dtype = static_cast<DType>(i);
    EXPECT_EQ(torch_bridge::dtype_of(torch_bridge::scalar_type_of(dtype)), dtype) << dtype_name(dtype);
  }
}

// Torch dtypes that have no manifest dtype are refused, naming the entry and the dtype, and
// nothing is built.
TEST(TorchBridge, TorchDtypesWithoutAManifestDtypeAreRefusedNamingThem) {
  for (auto type : {at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz, at::kComplexHalf, at::kComplexFloat}) {
    NamedTensors tensors{{"fine", torch::ones({2})}, {"odd", torch::zeros({3}).to(type)}};
    auto message = expect_error(ErrorCode::UnsupportedDtype,
                                [&] { torch_bridge::make_bucket(tensors); });
    EXPECT_NE(message.find("'odd'"), std::string::npos) << message;
    EXPECT_NE(message.find(c10::toString(type)), std::string::npos) << message;
  }
}

TEST_P(LoadInto, IsStrictAndCopiesNothingOnMismatch) {
  Net server;
  auto before = server.fc->weight.clone();
  NamedTensors wrong{{"fc.weight", torch::randn({4, 3})},   // shape differs
                     {"fc.bias", torch::randn({3}, at::kDouble)},  // dtype differs
                     {"extra", torch::randn({1})}};          // unexpected; the rest missing
  auto message = expect_error(ErrorCode::ManifestMismatch, [&] { load(server, wrong); });
  for (const char* part : {"missing 'norm.weight'", "unexpected 'extra'", "'fc.weight' has shape",
                           "'fc.bias' has dtype F64"}) {
    EXPECT_NE(message.find(part), std::string::npos) << part << " not in: " << message;
  }
  EXPECT_TRUE(torch::equal(server.fc->weight, before));
}

// Loading writes dense targets with memmove: it still bumps each target's version, as copy_ does,
// so autograd refuses a backward through values that changed; and targets of any other kind,
// or sent in another order, load all the same.
TEST_P(LoadInto, BumpsVersionsAndLoadsAnyTarget) {
  auto weight = torch::ones({2, 3}, torch::requires_grad());
  auto saved = (weight * weight).sum();  // keeps weight for its backward
  auto base = torch::zeros({3, 2});
  auto transposed = base.t();             // not contiguous
  auto whole = torch::zeros({4});
  auto half = whole.slice(0, 2);  // contiguous, past the front of its storage
  NamedTensors targets{{"weight", weight}, {"transposed", transposed}, {"half", half}};
  NamedTensors sent{{"weight", torch::full({2, 3}, 2.0f)},
                    {"transposed", torch::arange(6, torch::kFloat).reshape({2, 3})},
                    {"half", torch::full({2}, 5.0f)}};
  auto version = weight._version();
  load(targets, sent);
  EXPECT_EQ(weight._version(), version + 1);
  EXPECT_THROW(saved.backward(), c10::Error);  // "modified by an inplace operation"
  for (std::size_t i = 0; i < targets.size(); ++i) {
    EXPECT_TRUE(torch::equal(targets[i].second, sent[i].second)) << targets[i].first;
  }
  EXPECT_TRUE(torch::equal(base, sent[1].second.t()));
  EXPECT_TRUE(torch::equal(whole, torch::tensor({0.0f, 0.0f, 5.0f, 5.0f})));

  NamedTensors reversed(sent.rbegin(), sent.rend());
  for (auto& [name, tensor] : reversed) tensor = tensor + 1;
  load(targets, reversed);
  for (const auto& [name, tensor] : reversed) {
    auto target = std::find_if(targets.begin(), targets.end(), [&](auto& p) { return p.first == name; });
    EXPECT_TRUE(torch::equal(target->second, tensor)) << name;
  }
}

// copy_ into an inference tensor throws outside InferenceMode: partway through, it left the
// module half loaded. Refused first now, naming them; inside InferenceMode they load.
TEST_P(LoadInto, InferenceTensorsOnlyInInferenceMode) {
  auto normal = torch::zeros({2});
  at::Tensor inference;
  {
    c10::InferenceMode mode;
    inference = torch::zeros({2});
  }
  NamedTensors targets{{"normal", normal}, {"inference", inference}};
  NamedTensors sent{{"normal", torch::ones({2})}, {"inference", torch::ones({2})}};
  auto message = expect_error(ErrorCode::InvalidArgument, [&] { load(targets, sent); });
  EXPECT_NE(message.find("'inference'"), std::string::npos) << message;
  EXPECT_TRUE(torch::equal(normal, torch::zeros({2})));
  {
    c10::InferenceMode mode;
    load(targets, sent);
  }
  EXPECT_TRUE(torch::equal(normal, torch::ones({2})));
  EXPECT_TRUE(torch::equal(inference, torch::ones({2})));
}

// Before, the copy into a meta tensor did nothing and load_into returned as if it had loaded.
TEST_P(LoadInto, RefusesMetaTargetsAndCopiesNothing) {
  auto real = torch::zeros({2});
  NamedTensors targets{{"real", real},
                       {"meta.w", torch::empty({2, 2}, torch::TensorOptions().device(torch::kMeta))},
                       {"meta.b", torch::empty({2}, torch::TensorOptions().device(torch::kMeta))}};
  NamedTensors sent{{"real", torch::ones({2})}, {"meta.w", torch::ones({2, 2})}, {"meta.b", torch::ones({2})}};
  auto message = expect_error(ErrorCode::Unmaterialized, [&] { load(targets, sent); });
  EXPECT_NE(message.find("'meta.w', 'meta.b'"), std::string::npos) << message;
  EXPECT_TRUE(torch::equal(real, torch::zeros({2})));
}

#ifdef TENSORBUCKET_CUDA
// Torch's CUDA runtime and the one nvcc linked us with see the same devices.
TEST(TorchBridge, TorchSeesTheDevicesTheCudaRuntimeSees) {
  auto report = cuda::query_devices();
  if (report.devices.empty()) GTEST_SKIP() << "no CUDA device: " << report.error;
  EXPECT_TRUE(torch::cuda::is_available());
  EXPECT_EQ(torch::cuda::device_count(), report.devices.size());
}
#endif

}  // namespace
}  // namespace tensorbucket
