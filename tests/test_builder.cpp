// BucketBuilder: layout, packing, the in-place path, and what it refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <numeric>
#include <random>
#include <thread>

#include "serialize/copy.hpp"
#include "support.hpp"

// Every operator new of this program, the library's included, counted; not where a sanitizer
// brings its own.
#if !defined(__SANITIZE_ADDRESS__)
#define TB_COUNTS_ALLOCATIONS 1
namespace {
std::atomic<std::size_t> allocations{0};
}  // namespace
void* operator new(std::size_t size) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
// gcc sees a free() of what `new` returned once these are inlined: they are the pair.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
#endif

namespace tensorbucket {
namespace {

using test::expect_error;

TEST(Builder, LaysEntriesOutAtAlignedOffsets) {
  std::array<float, 3> a{1, 2, 3};
  std::array<std::uint16_t, 300> b{};
  BucketBuilder builder;
  builder.add("a", DType::F32, {3}, a.data()).add("b", DType::BF16, {10, 30}, b.data());
  const auto& m = builder.manifest();
  ASSERT_EQ(m.entries.size(), 2u);
  EXPECT_EQ(m.entries[0].byte_offset, 0u);
  EXPECT_EQ(m.entries[0].byte_length, 12u);
  EXPECT_EQ(m.entries[1].byte_offset, 256u);
  EXPECT_EQ(m.entries[1].byte_length, 600u);
  EXPECT_EQ(builder.payload_bytes(), 1024u);  // 256 + 600 rounded up
}

TEST(Builder, PacksBytesAndZeroesPadding) {
  std::array<std::uint8_t, 5> a{1, 2, 3, 4, 5};
  std::array<std::uint8_t, 2> b{9, 8};
  BucketBuilder builder;
  builder.add("a", DType::U8, {5}, a.data()).add("b", DType::U8, {2}, b.data());
  std::vector<std::byte> payload(builder.payload_bytes(), std::byte{0xAA});
  builder.pack_into(payload);
  EXPECT_EQ(std::memcmp(payload.data(), a.data(), 5), 0);
  EXPECT_EQ(std::memcmp(payload.data() + 256, b.data(), 2), 0);
  EXPECT_TRUE(std::all_of(payload.begin() + 5, payload.begin() + 256,
                          [](std::byte x) { return x == std::byte{0}; }));
  EXPECT_TRUE(std::all_of(payload.begin() + 258, payload.end(),
                          [](std::byte x) { return x == std::byte{0}; }));
}

TEST(Builder, LargeBucketsPackByteForByte) {
  // Past 4 MiB the builder copies with streaming stores; odd sizes exercise the tails.
  std::mt19937_64 rng(9);
  std::vector<std::vector<std::uint8_t>> sources;
  BucketBuilder builder;
  for (std::int64_t bytes : {5'000'001, 63, 6'000'000, 4'194'305, 1, 3'000'017}) {
    auto& source = sources.emplace_back(static_cast<std::size_t>(bytes));
    for (auto& b : source) b = static_cast<std::uint8_t>(rng());
    builder.add("t" + std::to_string(sources.size()), DType::U8, {bytes}, source.data());
  }
  ASSERT_GE(builder.payload_bytes(), 16u << 20);
  AlignedBuffer payload(builder.payload_bytes());
  builder.pack_into(payload.span());
  const auto& entries = builder.manifest().entries;
  for (std::size_t i = 0; i < sources.size(); ++i) {
    EXPECT_EQ(std::memcmp(payload.span().data() + entries[i].byte_offset, sources[i].data(),
                          sources[i].size()),
              0)
        << entries[i].name;
  }
}

TEST(Builder, RefusesTooSmallPayloadBuffer) {
  std::array<float, 100> a{};
  BucketBuilder builder;
  builder.add("a", DType::F32, {100}, a.data());
  std::vector<std::byte> payload(399);
  expect_error(ErrorCode::InvalidArgument, [&] { builder.pack_into(payload); });
}

TEST(Builder, HandsOutWritableSpansForInPlaceProducers) {
  BucketBuilder builder;
  builder.declare("x", DType::I32, {4}).declare("y", DType::F64, {2, 2});
  AlignedBuffer payload(builder.payload_bytes());
  auto spans = builder.entry_spans(payload.span());
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].size(), 16u);
  EXPECT_EQ(spans[1].data(), payload.span().data() + 256);
  std::array<std::int32_t, 4> x{7, 8, 9, 10};
  std::array<double, 4> y{0.5, 1.5, 2.5, 3.5};
  std::memcpy(spans[0].data(), x.data(), 16);
  std::memcpy(spans[1].data(), y.data(), 32);

  auto frame = encode_frame(builder.manifest(), payload.span());
  auto view = BucketView::open(frame, payload.span());
  EXPECT_EQ(std::memcmp(view.find("y")->bytes.data(), y.data(), 32), 0);
  EXPECT_EQ(std::memcmp(view.find("x")->bytes.data(), x.data(), 16), 0);
}

TEST(Builder, PackRefusesDeclaredEntries) {
  BucketBuilder builder;
  builder.declare("x", DType::I32, {4});
  expect_error(ErrorCode::InvalidArgument, [&] { builder.pack(); });
}

TEST(Builder, PackedBucketOpensAsVerifiedViews) {
  std::vector<std::uint16_t> w(64 * 32);
  std::iota(w.begin(), w.end(), 0);
  std::vector<float> s(64, 0.25f);
  BucketBuilder builder;
  builder.version(42).bucket(2, 5);
  builder.add("w", DType::I16, {64, 32}, w.data()).add("s", DType::F32, {64}, s.data());
  builder.group("quant", {"w", "s"});
  auto packed = builder.pack({.payload_checksum = true});
  auto view = BucketView::open(packed.frame, packed.payload.span());
  EXPECT_EQ(view.version(), 42u);
  EXPECT_EQ(view.bucket_index(), 2u);
  EXPECT_EQ(view.bucket_count(), 5u);
  EXPECT_EQ(view.find("s")->group, "quant");
  EXPECT_EQ(std::memcmp(view.find("w")->bytes.data(), w.data(), w.size() * 2), 0);
}

// The kept encoding follows every change: restamped for identity, re-encoded for layout.
TEST(Builder, EncodedManifestFollowsEveryChange) {
  std::vector<float> data(4);
  BucketBuilder builder;
  builder.add("a", DType::F32, {4}, data.data());
  auto first = std::vector<std::byte>(builder.encoded_manifest().begin(), builder.encoded_manifest().end());
  EXPECT_EQ(first, encode_manifest(builder.manifest()));
  builder.version(9).bucket(1, 3);
  EXPECT_NE(std::vector<std::byte>(builder.encoded_manifest().begin(), builder.encoded_manifest().end()), first);
  auto restamped = decode_manifest(builder.encoded_manifest());
  EXPECT_EQ(restamped, builder.manifest());
  EXPECT_EQ(restamped.version, 9u);
  EXPECT_EQ(restamped.bucket_index, 1u);
  builder.add("b", DType::F32, {4}, data.data());
  EXPECT_EQ(decode_manifest(builder.encoded_manifest()), builder.manifest());
  builder.group("g", {"a", "b"});
  EXPECT_EQ(decode_manifest(builder.encoded_manifest()), builder.manifest());
  builder.group("h", {"missing"});  // the kept encoding no longer vouches for the groups
  expect_error(ErrorCode::IncompleteGroup, [&] { builder.encoded_manifest(); });
  expect_error(ErrorCode::IncompleteGroup, [&] { builder.manifest(); });
}

TEST(Builder, RefusesDuplicateName) {
  float x = 0;
  BucketBuilder builder;
  builder.add("x", DType::F32, {}, &x);
  auto message = expect_error(ErrorCode::DuplicateName, [&] { builder.add("x", DType::F32, {}, &x); });
  EXPECT_NE(message.find("'x'"), std::string::npos);
  EXPECT_EQ(builder.manifest().entries.size(), 1u);
}

// The name index grows as entries come: every name stays found, and a repeat of any is refused
// with nothing added, before and after the index grew past its first table.
TEST(Builder, FindsEveryNameAsTheIndexGrows) {
  BucketBuilder builder;
  std::vector<float> values(5000);
  for (std::size_t i = 0; i < values.size(); ++i) {
    builder.add("model.layers." + std::to_string(i) + ".weight", DType::F32, {}, &values[i]);
    for (std::size_t repeat : {std::size_t{0}, i / 2, i}) {
      expect_error(ErrorCode::DuplicateName, [&] {
        builder.add("model.layers." + std::to_string(repeat) + ".weight", DType::F32, {}, &values[0]);
      });
    }
  }
  ASSERT_EQ(builder.manifest().entries.size(), values.size());
  float moved = 0;
  builder.set_data("model.layers.4321.weight", &moved);
  EXPECT_EQ(builder.entry_sources()[4321], reinterpret_cast<const std::byte*>(&moved));
  expect_error(ErrorCode::InvalidArgument, [&] { builder.set_data("model.layers.5000.weight", &moved); });
}

TEST(Builder, RefusesEmptyName) {
  float x = 0;
  BucketBuilder builder;
  expect_error(ErrorCode::BadName, [&] { builder.add("", DType::F32, {}, &x); });
  EXPECT_TRUE(builder.manifest().entries.empty());
}

TEST(Builder, RefusesOverlongName) {
  float x = 0;
  BucketBuilder builder;
  expect_error(ErrorCode::BadName,
               [&] { builder.add(std::string(kMaxNameBytes + 1, 'n'), DType::F32, {}, &x); });
}

TEST(Builder, RefusesUnknownDtype) {
  float x = 0;
  BucketBuilder builder;
  expect_error(ErrorCode::UnsupportedDtype,
               [&] { builder.add("x", static_cast<DType>(kDTypeCount), {}, &x); });
}

TEST(Builder, RefusesNegativeDim) {
  float x = 0;
  BucketBuilder builder;
  auto message = expect_error(ErrorCode::BadShape, [&] { builder.add("x", DType::F32, {2, -1}, &x); });
  EXPECT_NE(message.find("[2, -1]"), std::string::npos) << message;
}

TEST(Builder, RefusesSizeOverflow) {
  float x = 0;
  BucketBuilder builder;
  expect_error(ErrorCode::BadShape,
               [&] { builder.add("x", DType::F64, {1ll << 31, 1ll << 31, 1ll << 31}, &x); });
  EXPECT_EQ(builder.payload_bytes(), 0u);
}

// Seed 002: a meta tensor (shape but no storage) must not be packed as garbage.
TEST(Builder, Seed002RefusesUnmaterializedEntry) {
  BucketBuilder builder;
  auto message = expect_error(ErrorCode::Unmaterialized,
                              [&] { builder.add("layers.0.weight", DType::BF16, {8, 8}, nullptr); });
  EXPECT_NE(message.find("'layers.0.weight'"), std::string::npos) << message;
  EXPECT_NE(message.find("has no data"), std::string::npos) << message;
  EXPECT_TRUE(builder.manifest().entries.empty());
}

// The wake near the end of a long copy: once, before the last bytes when the copy is due to end
// within the lead (here any lead: an hour), at the last piece when the lead is nothing, and
// inside one large tensor, which is copied in paced pieces.
TEST(Copy, NearEndWakesOnceWithinItsLead) {
  constexpr std::size_t kBytes = 8u << 20;
  std::vector<std::byte> from(kBytes, std::byte{1}), to(kBytes);
  for (auto [lead, before_end] : {std::pair{std::chrono::nanoseconds(std::chrono::hours(1)), true},
                                  std::pair{std::chrono::nanoseconds(0), false}}) {
    std::fill(to.begin(), to.end(), std::byte{0});
    int wakes = 0;
    bool last_byte_written = false;
    detail::NearEnd near_end(kBytes, lead, [&] {
      ++wakes;
      last_byte_written = to.back() == std::byte{1};
    });
    detail::copy_paced(to.data(), from.data(), kBytes, false, near_end);
    EXPECT_EQ(wakes, 1) << lead.count();
    EXPECT_EQ(last_byte_written, !before_end) << lead.count();
    EXPECT_EQ(to, from);
  }
  detail::NearEnd counts_only(kBytes, std::chrono::hours(1), nullptr);
  detail::copy_paced(to.data(), from.data(), kBytes, true, counts_only);  // no wake to call
  detail::finish_streaming();
  EXPECT_EQ(to, from);
}

// A streaming copy (pages in turn), with each routine this CPU runs and with the one copy_bytes()
// picks, writes every byte of any length to any alignment, and nothing around it: heads before
// the first 64-byte boundary, groups of fewer pages or lines than a full turn, lines and bytes
// past the last page. Off x86-64 there is no routine, and copy_bytes() copies with memcpy.
TEST(Copy, StreamingCopiesEveryByteAtAnyAlignmentAndNothingElse) {
  constexpr std::size_t kPage = 4096, kGuard = 256;
  const std::size_t lengths[] = {0, 1, 63, 64, 65, 200, kPage - 1, kPage, kPage + 1, 3 * kPage + 64,
                                 8 * kPage, 9 * kPage + 17, 17 * kPage + 4031, (1u << 20) + 5};
  std::vector<std::byte> from((1u << 20) + 5 + 64);
  for (std::size_t i = 0; i < from.size(); ++i) from[i] = static_cast<std::byte>(i * 131 + i / 251);
  AlignedBuffer to(from.size() + 2 * kGuard);
  auto routines = detail::streaming_routines();  // every one this CPU runs, and the one copy_bytes() picks
#if defined(__x86_64__)
  ASSERT_FALSE(routines.empty());
  EXPECT_EQ(routines.back(), "sse2");  // every x86-64 CPU runs it
#endif
  EXPECT_THROW(detail::stream_with("mmx", to.span().data(), from.data(), 64), Error);
  routines.emplace_back();
  for (auto routine : routines) {
    for (auto length : lengths) {
      for (std::size_t to_offset : {0u, 1u, 16u, 61u}) {
        for (std::size_t from_offset : {0u, 7u}) {
          std::fill(to.span().begin(), to.span().end(), std::byte{0xee});
          auto* destination = to.span().data() + kGuard + to_offset;
          if (routine.empty()) {
            detail::copy_bytes(destination, from.data() + from_offset, length, true);
          } else {
            detail::stream_with(routine, destination, from.data() + from_offset, length);
          }
          detail::finish_streaming();
          auto where = std::string(routine.empty() ? "copy_bytes" : routine) + ", length " + std::to_string(length) +
                       ", to +" + std::to_string(to_offset) + ", from +" + std::to_string(from_offset);
          ASSERT_TRUE(std::equal(destination, destination + length, from.data() + from_offset)) << where;
          auto untouched = [](auto first, auto last) {
            return std::all_of(first, last, [](std::byte b) { return b == std::byte{0xee}; });
          };
          ASSERT_TRUE(untouched(to.span().data(), destination)) << where;
          ASSERT_TRUE(untouched(destination + length, to.span().data() + to.span().size())) << where;
        }
      }
    }
  }
}

// Payloads from streaming_from() up to kStreamingBytes stream untimed, padding included: the
// bytes of 896-byte entries (128 bytes of padding after each) and zeroes between them, over a
// payload that held other bytes.
TEST(Copy, MidSizePayloadsStreamEntriesAndPadding) {
  constexpr std::int64_t kTensorBytes = 896;
  auto from = detail::streaming_from();
  ASSERT_LE(from, detail::kStreamingBytes);
  auto count = std::max<std::uint64_t>(from / 1024 + 1, 2);
  std::vector<std::vector<std::byte>> tensors;
  BucketBuilder builder;
  for (std::uint64_t t = 0; t < count; ++t) {
    tensors.emplace_back(kTensorBytes, static_cast<std::byte>(t % 250 + 1));
    builder.add("t" + std::to_string(t), DType::U8, {kTensorBytes}, tensors.back().data());
  }
  AlignedBuffer payload(builder.payload_bytes());
  if (from < detail::kStreamingBytes && std::getenv("TENSORBUCKET_LARGE_COPIES") == nullptr) {
    EXPECT_GE(builder.payload_bytes(), from);
    EXPECT_LT(builder.payload_bytes(), detail::kStreamingBytes);
    EXPECT_TRUE(detail::streams(payload.span()));
  }
  std::fill(payload.span().begin(), payload.span().end(), std::byte{0xee});
  builder.pack_into(payload.span());
  const auto& entries = builder.manifest().entries;
  std::vector<std::byte> expected(builder.payload_bytes());
  for (std::size_t t = 0; t < entries.size(); ++t) {
    ASSERT_EQ(entries[t].byte_offset % 1024, 0u);  // 128 bytes of padding after each
    std::copy(tensors[t].begin(), tensors[t].end(), expected.begin() + static_cast<std::ptrdiff_t>(entries[t].byte_offset));
  }
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), payload.span().begin()));
}

// Payloads past kStreamingBytes: the first packs alternate streaming and memcpy, timed, and the
// process keeps the faster. Every pack, a trial or not, copies the same bytes and zeroes the
// padding between entries.
TEST(Copy, LargePayloadsChooseTheirRoutineByMeasurementAndPackTheSameBytes) {
  constexpr std::int64_t kTensorBytes = (1 << 20) + 3;  // leaves padding before the next entry
  std::vector<std::vector<std::byte>> tensors;
  BucketBuilder builder;
  for (int t = 0; t < 5; ++t) {
    tensors.emplace_back(kTensorBytes, static_cast<std::byte>(t + 1));
    builder.add("t" + std::to_string(t), DType::U8, {kTensorBytes}, tensors.back().data());
  }
  ASSERT_GE(builder.payload_bytes(), detail::kStreamingBytes);
  std::vector<std::byte> expected(builder.payload_bytes());
  const auto& entries = builder.manifest().entries;
  for (std::size_t t = 0; t < entries.size(); ++t) {
    std::copy(tensors[t].begin(), tensors[t].end(), expected.begin() + static_cast<std::ptrdiff_t>(entries[t].byte_offset));
  }
  AlignedBuffer payload(builder.payload_bytes());
  for (int pack = 0; pack < 2 * detail::kCopyTrials + 2; ++pack) {
    std::fill(payload.span().begin(), payload.span().end(), std::byte{0xee});
    builder.pack_into(payload.span());
    ASSERT_TRUE(std::equal(expected.begin(), expected.end(), payload.span().begin())) << "pack " << pack;
  }
  std::string chosen = detail::large_copies();
  EXPECT_TRUE(chosen == "streaming" || chosen == "memcpy") << chosen;
}

// A kept builder follows a tensor that moved, without a new layout or a new encoding.
TEST(Builder, SetDataMovesAnEntryAndKeepsItsEncoding) {
  std::array<std::uint32_t, 4> first{1, 2, 3, 4}, moved{5, 6, 7, 8};
  std::array<std::uint8_t, 2> in_place{};
  BucketBuilder builder;
  builder.add("w", DType::U32, {4}, first.data()).declare("later", DType::U8, {2});
  static_cast<void>(builder.encoded_manifest());
  auto encoding = builder.encoding_id();
  builder.set_data("w", moved.data());
  EXPECT_EQ(builder.encoding_id(), encoding);
  ASSERT_EQ(builder.entry_sources()[0], reinterpret_cast<const std::byte*>(moved.data()));

  auto message = expect_error(ErrorCode::InvalidArgument, [&] { builder.set_data("v", moved.data()); });
  EXPECT_NE(message.find("no entry 'v'"), std::string::npos) << message;
  message = expect_error(ErrorCode::InvalidArgument, [&] { builder.set_data("later", in_place.data()); });
  EXPECT_NE(message.find("declared for in-place writing"), std::string::npos) << message;
  message = expect_error(ErrorCode::Unmaterialized, [&] { builder.set_data("w", nullptr); });
  EXPECT_NE(message.find("'w' of U32 [4]"), std::string::npos) << message;
  EXPECT_EQ(builder.entry_sources()[0], reinterpret_cast<const std::byte*>(moved.data()));  // refused: unchanged
  // An empty tensor, added without data, takes any address, null included; packing reads the
  // moved entry's new bytes.
  BucketBuilder with_empty;
  with_empty.add("w", DType::U32, {4}, first.data()).add("empty", DType::F32, {0}, nullptr);
  with_empty.set_data("empty", moved.data()).set_data("empty", nullptr).set_data("w", moved.data());
  auto packed = with_empty.pack();
  EXPECT_EQ(std::memcmp(packed.payload.span().data(), moved.data(), sizeof moved), 0);
}

TEST(Builder, ReportsBadShapeBeforeMissingData) {
  BucketBuilder builder;
  expect_error(ErrorCode::BadShape, [&] { builder.add("x", DType::F32, {-2}, nullptr); });
}

TEST(Builder, AcceptsEmptyTensorWithoutData) {
  BucketBuilder builder;
  builder.add("empty", DType::F32, {0, 16}, nullptr);
  EXPECT_EQ(builder.manifest().entries[0].byte_length, 0u);
}

TEST(Builder, RefusesIncompleteGroup) {
  float w = 0;
  BucketBuilder builder;
  builder.add("w", DType::F32, {}, &w).group("quant", {"w", "w.scales"});
  auto message = expect_error(ErrorCode::IncompleteGroup, [&] { builder.pack(); });
  EXPECT_NE(message.find("group 'quant' is missing member 'w.scales'"), std::string::npos);
}

TEST(Builder, GroupMayBeDeclaredBeforeItsMembers) {
  float w = 0, s = 0;
  BucketBuilder builder;
  builder.group("quant", {"w", "s"}).add("w", DType::F32, {}, &w).add("s", DType::F32, {}, &s);
  EXPECT_EQ(builder.manifest().entries[1].group, "quant");
  EXPECT_NO_THROW(builder.pack());
}

TEST(Builder, RefusesEntryInTwoGroups) {
  float w = 0;
  BucketBuilder builder;
  builder.add("w", DType::F32, {}, &w).group("a", {"w"});
  expect_error(ErrorCode::InvalidArgument, [&] { builder.group("b", {"w"}); });
  EXPECT_EQ(builder.manifest().groups.size(), 1u);
}

TEST(Builder, RefusesOneEntryPastTheLimitNamingIt) {
  BucketBuilder builder;
  for (std::uint64_t i = 0; i < kMaxEntries; ++i) builder.declare("e" + std::to_string(i), DType::U8, {0});
  auto message = expect_error(ErrorCode::InvalidArgument, [&] { builder.declare("last", DType::U8, {0}); });
  EXPECT_NE(message.find("'last'"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(kMaxEntries)), std::string::npos) << message;
  EXPECT_EQ(builder.manifest().entries.size(), kMaxEntries);
}

// The loop a trainer writes first: a new builder every step. Model-like names are longer than
// a std::string holds inline.
std::string step_name(std::size_t i) { return "model.layers." + std::to_string(i / 8) + ".mlp.proj_" + std::to_string(i % 8) + ".weight"; }

TEST(Builder, ANewBuilderPerStepAllocatesNothingPerEntryOnceAStepHasRun) {
#ifndef TB_COUNTS_ALLOCATIONS
  GTEST_SKIP() << "a sanitizer's allocator replaces the counting one";
#else
  constexpr std::size_t kEntries = 1000;
  std::vector<std::string> names;
  for (std::size_t i = 0; i < kEntries; ++i) names.push_back(step_name(i));
  std::vector<std::uint16_t> source(kEntries * 32);
  std::size_t last_step = 0;
  for (int step = 0; step < 3; ++step) {
    auto before = allocations.load();
    BucketBuilder builder;
    builder.version(step);
    for (std::size_t i = 0; i < kEntries; ++i) builder.add(names[i], DType::BF16, {4, 8}, source.data() + i * 32);
    ASSERT_FALSE(builder.encoded_manifest().empty());
    last_step = allocations.load() - before;
  }
  // The encoding's own columns remain: a handful per step, none per entry.
  EXPECT_LT(last_step, 16u) << last_step << " allocations in a step of " << kEntries << " entries";
#endif
}

TEST(Builder, ABuilderMadeAfterAnotherKeepsNothingOfIt) {
  std::vector<std::uint8_t> bytes(4096, 7);
  {
    BucketBuilder first;
    for (std::size_t i = 0; i < 100; ++i) first.add(step_name(i), DType::U8, {40}, bytes.data());
    first.group("pair", {step_name(0), step_name(1)});
    ASSERT_FALSE(first.encoded_manifest().empty());
  }
  BucketBuilder second;
  second.version(9).add("b", DType::F32, {2, 3}, bytes.data()).declare("c", DType::U8, {300});
  Manifest expected;
  expected.version = 9;
  expected.entries = {{"b", DType::F32, {2, 3}, 0, 24, ""}, {"c", DType::U8, {300}, 256, 300, ""}};
  EXPECT_EQ(second.manifest(), expected);
  EXPECT_EQ(decode_manifest(second.encoded_manifest()), expected);
  EXPECT_EQ(second.payload_bytes(), 768u);
  ASSERT_EQ(second.entry_sources().size(), 2u);
  EXPECT_EQ(second.entry_sources()[0], reinterpret_cast<const std::byte*>(bytes.data()));
  EXPECT_EQ(second.entry_sources()[1], nullptr);
  // The first builder's names are not in the second's index; its own are, once each.
  expect_error(ErrorCode::InvalidArgument, [&] { second.set_data(step_name(0), bytes.data()); });
  expect_error(ErrorCode::DuplicateName, [&] { second.add("b", DType::U8, {1}, bytes.data()); });
  EXPECT_NO_THROW(second.add(step_name(0), DType::U8, {1}, bytes.data()));
  EXPECT_EQ(second.manifest().entries.back().group, "");
}

// A layout as a builder lays it out, computed here on its own: what every builder must hold,
// whatever the builder before it on the thread held.
struct Planned {
  std::string name;
  DType dtype;
  Shape shape;
};

Manifest laid_out(std::uint64_t version, const std::vector<Planned>& plan) {
  Manifest manifest;
  manifest.version = version;
  std::uint64_t end = 0;
  for (const auto& entry : plan) {
    auto offset = (end + kPayloadAlignment - 1) / kPayloadAlignment * kPayloadAlignment;
    auto length = *checked_byte_length(entry.dtype, entry.shape);
    manifest.entries.push_back({entry.name, entry.dtype, entry.shape, offset, length, ""});
    end = offset + length;
  }
  return manifest;
}

// Builds `plan` in a new builder and checks everything it answers against laid_out().
std::uint64_t build_and_check(std::uint64_t version, const std::vector<Planned>& plan,
                              const std::vector<std::string>& absent = {}) {
  static const std::vector<std::byte> bytes(1 << 16, std::byte{3});
  BucketBuilder builder;
  builder.version(version);
  for (const auto& entry : plan) builder.add(entry.name, entry.dtype, entry.shape, bytes.data());
  auto expected = laid_out(version, plan);
  EXPECT_EQ(builder.manifest(), expected) << "version " << version;
  EXPECT_EQ(decode_manifest(builder.encoded_manifest()), expected) << "version " << version;
  EXPECT_EQ(builder.entry_sources().size(), plan.size());
  for (const auto& entry : plan) {
    EXPECT_NO_THROW(builder.set_data(entry.name, bytes.data())) << entry.name;
  }
  for (const auto& name : absent) {
    expect_error(ErrorCode::InvalidArgument, [&] { builder.set_data(name, bytes.data()); });
  }
  if (!plan.empty()) {
    expect_error(ErrorCode::DuplicateName, [&] { builder.add(plan.front().name, DType::U8, {1}, bytes.data()); });
    expect_error(ErrorCode::DuplicateName, [&] { builder.add(plan.back().name, DType::U8, {1}, bytes.data()); });
  }
  return builder.encoding_id();
}

std::vector<Planned> model_plan(std::size_t entries) {
  std::vector<Planned> plan;
  for (std::size_t i = 0; i < entries; ++i) plan.push_back({step_name(i), DType::BF16, {4, 8}});
  return plan;
}

TEST(Builder, ANewBuilderRepeatingTheLastLayoutHoldsExactlyItsOwn) {
  auto plan = model_plan(50);
  auto first = build_and_check(1, plan);
  // The same layout again reuses the encoding, restamped.
  EXPECT_EQ(build_and_check(2, plan), first);

  auto reshaped = plan;
  reshaped[20].shape = {4, 9};  // every later offset moves
  EXPECT_NE(build_and_check(3, reshaped), first);
  auto retyped = plan;
  retyped[0].dtype = DType::F32;
  build_and_check(4, retyped);
  auto renamed = plan;
  renamed[49].name = "renamed";
  build_and_check(5, renamed, {step_name(49)});
  build_and_check(6, plan, {"renamed"});

  auto shorter = plan;
  shorter.resize(30);
  build_and_check(7, shorter, {step_name(30), step_name(49)});
  auto longer = plan;
  longer.push_back({"one.more", DType::F16, {3}});
  build_and_check(8, longer);
  build_and_check(9, plan, {"one.more"});
  build_and_check(10, {});
  build_and_check(11, plan);
}

// While a new builder repeats the last layout, that layout's entries past the ones added so
// far are still in place: nothing that reads the builder may see them.
TEST(Builder, ABuilderPartWayThroughARepeatShowsOnlyItsOwnEntries) {
  auto plan = model_plan(20);
  build_and_check(1, plan);
  static const std::vector<std::byte> bytes(1 << 16, std::byte{3});
  auto first_part = [&](BucketBuilder& builder, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) builder.add(plan[i].name, plan[i].dtype, plan[i].shape, bytes.data());
  };
  std::vector<Planned> head(plan.begin(), plan.begin() + 8);
  {
    BucketBuilder builder;
    first_part(builder, 8);
    // Read before manifest(): a name of the rest is not the builder's, nor are its bytes.
    expect_error(ErrorCode::InvalidArgument, [&] { builder.set_data(plan[12].name, bytes.data()); });
    std::vector<std::byte> payload(builder.payload_bytes());
    EXPECT_EQ(builder.entry_spans(payload).size(), 8u);
    EXPECT_EQ(builder.manifest(), laid_out(0, head));
  }
  {
    BucketBuilder builder;
    first_part(builder, 8);
    EXPECT_EQ(builder.entry_sources().size(), 8u);
    std::vector<std::byte> payload(builder.payload_bytes());
    EXPECT_EQ(builder.entry_spans(payload).size(), 8u);
    // Adding more after a read goes on from the entries added, not from the last layout's.
    builder.add(plan[8].name, plan[8].dtype, plan[8].shape, bytes.data());
    EXPECT_EQ(builder.manifest().entries.size(), 9u);
  }
  {
    BucketBuilder builder;
    first_part(builder, 8);
    // A copy part-way holds what the original does; each goes on its own way.
    BucketBuilder copy = builder;
    copy.add("only.in.the.copy", DType::U8, {3}, bytes.data());
    first_part(builder, 0);
    auto with_one_more = head;
    with_one_more.push_back({"only.in.the.copy", DType::U8, {3}});
    EXPECT_EQ(copy.manifest(), laid_out(0, with_one_more));
    EXPECT_EQ(builder.manifest(), laid_out(0, head));
    EXPECT_EQ(decode_manifest(builder.encoded_manifest()), laid_out(0, head));
  }
  {
    BucketBuilder builder;
    first_part(builder, 8);
    // Moved part-way: the new owner goes on with the repeat, and the moved-from builder is a
    // new one, which builds whatever it is given from scratch.
    BucketBuilder owner = std::move(builder);
    for (std::size_t i = 8; i < plan.size(); ++i) owner.add(plan[i].name, plan[i].dtype, plan[i].shape, bytes.data());
    builder.add("after.the.move", DType::U8, {3}, bytes.data());
    EXPECT_EQ(builder.manifest(), laid_out(0, {{"after.the.move", DType::U8, {3}}}));
    EXPECT_EQ(builder.payload_bytes(), kPayloadAlignment);
    EXPECT_EQ(owner.manifest(), laid_out(0, plan));
    BucketBuilder assigned;
    assigned = std::move(owner);
    EXPECT_EQ(assigned.manifest(), laid_out(0, plan));
    EXPECT_TRUE(owner.manifest().entries.empty());
    EXPECT_EQ(owner.payload_bytes(), 0u);
  }
  {
    BucketBuilder builder;
    first_part(builder, 8);
  }  // destroyed part-way, never read: it leaves its own 8 entries, indexed
  build_and_check(2, head, {plan[12].name});
  build_and_check(3, plan);
}

// A name may point into the builder's own entries (a prefix of one, say): it is read before
// the entries move. On a thread of its own, whose first builder's entries start with no room.
TEST(Builder, ANameTakenFromTheBuildersOwnEntriesIsCopiedBeforeTheyMove) {
  const std::string first = "weight.of.a.long.name.0";
  std::vector<std::string> names;
  std::thread([&] {
    float x[1] = {};
    BucketBuilder builder;
    builder.add(first, DType::F32, {1}, x);
    while (builder.manifest().entries.back().name.size() > 1) {
      const auto& last = builder.manifest().entries.back().name;
      builder.add(std::string_view(last).substr(0, last.size() - 1), DType::F32, {1}, x);
    }
    for (const auto& entry : builder.manifest().entries) names.push_back(entry.name);
  }).join();
  ASSERT_EQ(names.size(), first.size());
  for (std::size_t i = 0; i < names.size(); ++i) EXPECT_EQ(names[i], first.substr(0, first.size() - i));
}

TEST(Builder, AGroupStopsTheRepeatAndArrives) {
  auto plan = model_plan(10);
  build_and_check(1, plan);
  std::vector<float> bytes(64);
  for (bool group_first : {true, false}) {
    BucketBuilder builder;
    if (group_first) builder.group("pair", {step_name(0), step_name(1)});
    for (const auto& entry : plan) builder.add(entry.name, entry.dtype, entry.shape, bytes.data());
    if (!group_first) builder.group("pair", {step_name(0), step_name(1)});
    auto expected = laid_out(0, plan);
    expected.entries[0].group = expected.entries[1].group = "pair";
    expected.groups = {{"pair", {step_name(0), step_name(1)}}};
    EXPECT_EQ(builder.manifest(), expected);
    EXPECT_EQ(decode_manifest(builder.encoded_manifest()), expected);
  }
  build_and_check(2, plan);
}

// Layouts that drift from one builder to the next the ways a trainer's do, at random.
TEST(Builder, NewBuildersOfDriftingLayoutsEachHoldTheirOwn) {
  std::mt19937 random(43);
  auto plan = model_plan(40);
  std::vector<std::string> gone;
  for (std::uint64_t version = 1; version <= 300; ++version) {
    auto at = [&] { return plan.empty() ? 0 : random() % plan.size(); };
    switch (random() % 6) {
      case 0:  // the same again
        break;
      case 1:
        if (!plan.empty()) plan[at()].shape = {static_cast<std::int64_t>(random() % 300)};
        break;
      case 2:
        if (!plan.empty()) plan[at()].dtype = random() % 2 ? DType::F32 : DType::U8;
        break;
      case 3:
        if (!plan.empty()) {
          auto i = at();
          gone.push_back(plan[i].name);
          plan.erase(plan.begin() + static_cast<std::ptrdiff_t>(i));
        }
        break;
      default: {
        auto name = "added." + std::to_string(version);
        plan.insert(plan.begin() + static_cast<std::ptrdiff_t>(at()), {name, DType::F16, {2, 3}});
        break;
      }
    }
    std::vector<std::string> absent;
    for (const auto& name : gone) {
      if (std::none_of(plan.begin(), plan.end(), [&](const Planned& p) { return p.name == name; })) absent.push_back(name);
    }
    build_and_check(version, plan, absent);
    if (::testing::Test::HasFailure()) FAIL() << "at version " << version;
  }
}

TEST(Builder, RefusesBucketIndexPastCount) {
  BucketBuilder builder;
  expect_error(ErrorCode::InvalidArgument, [&] { builder.bucket(4, 4); });
}

}  // namespace
}  // namespace tensorbucket
