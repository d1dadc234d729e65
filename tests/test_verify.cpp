// One test per verification rule (docs/format.md) and per seed case: each asserts the exact
// error code, that the message names the culprit, and that no view was produced.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "serialize/block_hash.hpp"
#include "support.hpp"

namespace tensorbucket {
namespace {

using test::expect_error;
using test::expect_rejected;

// Three F32 entries [4] at offsets 0, 256, 512 over a 768-byte payload.
struct Fixture {
  Manifest manifest;
  AlignedBuffer payload{768};

  Fixture() {
    for (int i = 0; i < 3; ++i) {
      manifest.entries.push_back({"w" + std::to_string(i), DType::F32, {4},
                                  256u * static_cast<unsigned>(i), 16, ""});
    }
    std::memset(payload.span().data(), 0x11, payload.size());
  }
  std::vector<std::byte> frame(EncodeOptions options = {}) const {
    return encode_frame(manifest, payload.span(), options);
  }
};

TEST(Verify, AcceptsAWellFormedBucket) {
  Fixture f;
  auto view = BucketView::open(f.frame(), f.payload.span());
  ASSERT_EQ(view.size(), 3u);
  EXPECT_EQ(view[2].bytes.data(), f.payload.span().data() + 512);
  EXPECT_EQ(view.find("w1")->bytes.size(), 16u);
  EXPECT_FALSE(view.find("nope").has_value());
}

// Seed 000: the manifest arrived, the payload did not.
TEST(Verify, Seed000RejectsManifestWithoutPayload) {
  Fixture f;
  auto message = expect_rejected(ErrorCode::MissingPayload, f.frame(), {});
  EXPECT_NE(message.find("768"), std::string::npos) << message;
}

TEST(Verify, RejectsPayloadShorterThanHeaderDeclares) {
  Fixture f;
  auto message = expect_rejected(ErrorCode::MissingPayload, f.frame(), f.payload.span().first(700));
  EXPECT_NE(message.find("700"), std::string::npos) << message;
}

// Seed 001: the payload arrived, the manifest did not.
TEST(Verify, Seed001RejectsPayloadWithoutManifest) {
  Fixture f;
  expect_rejected(ErrorCode::MissingManifest, {}, f.payload.span());
}

TEST(Verify, RejectsHeaderThatDeclaresNoManifest) {
  Fixture f;
  auto frame = f.frame();
  BucketHeader header;
  std::memcpy(&header, frame.data(), sizeof header);
  header.manifest_bytes = 0;
  std::memcpy(frame.data(), &header, sizeof header);
  frame.resize(sizeof header);
  expect_rejected(ErrorCode::MissingManifest, frame, f.payload.span());
}

TEST(Verify, RejectsManifestWhoseHashDiffers) {
  Fixture f;
  auto frame = f.frame();
  frame.back() ^= std::byte{1};
  expect_rejected(ErrorCode::ChecksumMismatch, frame, f.payload.span());
}

TEST(Verify, RejectsPayloadWhoseHashDiffers) {
  Fixture f;
  auto frame = f.frame({.payload_checksum = true});
  f.payload.span()[300] ^= std::byte{0x80};
  auto message = expect_rejected(ErrorCode::ChecksumMismatch, frame, f.payload.span());
  EXPECT_NE(message.find("payload hash"), std::string::npos) << message;
}

TEST(Verify, SkipsPayloadHashWhenAskedTo) {
  Fixture f;
  auto frame = f.frame({.payload_checksum = true});
  f.payload.span()[300] ^= std::byte{0x80};
  EXPECT_NO_THROW(BucketView::open(frame, f.payload.span(), {.check_payload_checksum = false}));
}

// A frame whose payload hash is the block hash, as a device channel's producer writes it.
std::vector<std::byte> with_block_hash(std::vector<std::byte> frame, std::span<const std::byte> payload) {
  BucketHeader header;
  std::memcpy(&header, frame.data(), sizeof header);
  header.flags |= kPayloadChecksum | kPayloadBlockHash;
  header.payload_xxh3 = block_hash::hash_of(payload);
  std::memcpy(frame.data(), &header, sizeof header);
  return frame;
}

TEST(Verify, ChecksABlockHashOfAPayloadInHostMemory) {
  Fixture f;
  auto frame = with_block_hash(f.frame(), f.payload.span());
  auto view = BucketView::open(frame, f.payload.span());
  ASSERT_TRUE(view.payload_checksum());
  EXPECT_TRUE(view.payload_checksum()->block_hash);
  EXPECT_EQ(view.payload_checksum()->value, block_hash::hash_of(f.payload.span()));
  f.payload.span()[767] ^= std::byte{1};
  expect_rejected(ErrorCode::ChecksumMismatch, frame, f.payload.span());
}

TEST(Verify, RejectsTheBlockHashFlagWithoutAPayloadChecksum) {
  Fixture f;
  auto frame = f.frame();
  BucketHeader header;
  std::memcpy(&header, frame.data(), sizeof header);
  header.flags |= kPayloadBlockHash;
  std::memcpy(frame.data(), &header, sizeof header);
  expect_rejected(ErrorCode::HeaderCorrupt, frame, f.payload.span());
}

// Bytes 7i + i / 4099 + 3 (mod 256): no two blocks alike.
std::vector<std::byte> pattern(std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  for (std::size_t i = 0; i < bytes; ++i) out[i] = static_cast<std::byte>(i * 7 + i / 4099 + 3);
  return out;
}

// Pinned: producers, consumers and the kernel (ipc/cuda/block_hash.cu, compared with this on a GPU
// by test_cuda_channel) must agree, so a change here is a change of the format. The values
// were checked against a separate implementation of docs/format.md's definition.
TEST(BlockHash, KnownValues) {
  EXPECT_EQ(block_hash::hash_of({}), xxh3({}));
  EXPECT_EQ(block_hash::hash_of(pattern(1)), 0x0481b60fa4b0a0abull);
  EXPECT_EQ(block_hash::hash_of(pattern(3 * block_hash::kHashBlockBytes + 13)), 0x378b8827ce9bed2aull);
}

TEST(BlockHash, EveryByteCountsWhereverItIs) {
  auto payload = pattern(3 * block_hash::kHashBlockBytes + 13);
  auto original = block_hash::hash_of(payload);
  // The first and last byte of each block and word, and of the partial word at the end.
  for (std::size_t at : {std::size_t{0}, std::size_t{7}, std::size_t{8}, std::size_t{255},
                         std::size_t{block_hash::kHashBlockBytes - 1}, std::size_t{block_hash::kHashBlockBytes},
                         std::size_t{2 * block_hash::kHashBlockBytes + 31 * 8}, payload.size() - 13, payload.size() - 1}) {
    payload[at] ^= std::byte{0x01};
    EXPECT_NE(block_hash::hash_of(payload), original) << "byte " << at;
    payload[at] ^= std::byte{0x01};
  }
  // Blocks in another order, and a zero byte more at the end (the zero padding of the last word).
  auto swapped = payload;
  std::swap_ranges(swapped.begin(), swapped.begin() + block_hash::kHashBlockBytes,
                   swapped.begin() + block_hash::kHashBlockBytes);
  EXPECT_NE(block_hash::hash_of(swapped), original);
  auto longer = payload;
  longer.push_back(std::byte{0});
  EXPECT_NE(block_hash::hash_of(longer), original);
}

TEST(Verify, RejectsDuplicateNames) {
  Fixture f;
  f.manifest.entries[2].name = "w0";
  auto message = expect_rejected(ErrorCode::DuplicateName, f.frame(), f.payload.span());
  EXPECT_NE(message.find("'w0'"), std::string::npos) << message;
}

TEST(Verify, RejectsEmptyName) {
  Fixture f;
  f.manifest.entries[1].name.clear();
  expect_rejected(ErrorCode::BadName, f.frame(), f.payload.span());
}

TEST(Verify, RejectsOverlongName) {
  Fixture f;
  f.manifest.entries[1].name.assign(kMaxNameBytes + 1, 'x');
  // The decoder bounds names before allocating, so this is caught as corrupt bytes.
  expect_rejected(ErrorCode::ManifestCorrupt, f.frame(), f.payload.span());
  expect_error(ErrorCode::BadName, [&] { verify_manifest(f.manifest, 768); });
}

TEST(Verify, RejectsUnknownDtype) {
  Fixture f;
  f.manifest.entries[1].dtype = static_cast<DType>(200);
  auto message = expect_rejected(ErrorCode::UnsupportedDtype, f.frame(), f.payload.span());
  EXPECT_NE(message.find("'w1'"), std::string::npos) << message;
}

TEST(Verify, RejectsNegativeDim) {
  Fixture f;
  f.manifest.entries[0].shape = {-4};
  expect_rejected(ErrorCode::BadShape, f.frame(), f.payload.span());
}

TEST(Verify, RejectsByteLengthThatDisagreesWithShape) {
  Fixture f;
  f.manifest.entries[0].byte_length = 12;
  auto message = expect_rejected(ErrorCode::BadShape, f.frame(), f.payload.span());
  EXPECT_NE(message.find("needs 16 bytes but declares 12"), std::string::npos) << message;
}

TEST(Verify, RejectsShapeWhoseSizeOverflows) {
  Fixture f;
  f.manifest.entries[0].shape = {1ll << 40, 1ll << 40};
  expect_rejected(ErrorCode::BadShape, f.frame(), f.payload.span());
}

TEST(Verify, RejectsTooManyDims) {
  Fixture f;
  f.manifest.entries[0].shape.resize(kMaxRank + 1);
  std::fill(f.manifest.entries[0].shape.begin(), f.manifest.entries[0].shape.end(), 1);
  expect_error(ErrorCode::BadShape, [&] { verify_manifest(f.manifest, 768); });
}

TEST(Verify, RejectsMisalignedOffset) {
  Fixture f;
  f.manifest.entries[1].byte_offset = 260;
  auto message = expect_rejected(ErrorCode::Misaligned, f.frame(), f.payload.span());
  EXPECT_NE(message.find("260"), std::string::npos) << message;
}

TEST(Verify, RejectsEntryEndingPastPayload) {
  Fixture f;
  f.manifest.entries[2].byte_offset = 768;
  auto message = expect_rejected(ErrorCode::OutOfBounds, f.frame(), f.payload.span());
  EXPECT_NE(message.find("'w2'"), std::string::npos) << message;
}

TEST(Verify, RejectsOffsetThatWouldWrapAround) {
  Fixture f;
  f.manifest.entries[2].byte_offset = ~std::uint64_t{0} - 255;
  expect_rejected(ErrorCode::OutOfBounds, f.frame(), f.payload.span());
}

TEST(Verify, RejectsOverlappingEntries) {
  Fixture f;
  f.manifest.entries[1].shape = {128};
  f.manifest.entries[1].byte_length = 512;  // [256, 768) covers w2 at 512
  auto message = expect_rejected(ErrorCode::Overlap, f.frame(), f.payload.span());
  EXPECT_NE(message.find("'w2'"), std::string::npos) << message;
  EXPECT_NE(message.find("'w1'"), std::string::npos) << message;
}

TEST(Verify, RejectsOverlapEvenWhenEntriesAreOutOfOrder) {
  Fixture f;
  std::swap(f.manifest.entries[0], f.manifest.entries[2]);
  f.manifest.entries[2].byte_offset = 512;  // w0 now sits on w2
  expect_rejected(ErrorCode::Overlap, f.frame(), f.payload.span());
}

TEST(Verify, AcceptsEmptyEntriesSharingAnOffset) {
  Fixture f;
  f.manifest.entries.push_back({"empty", DType::BF16, {0, 3}, 256, 0, ""});
  EXPECT_NO_THROW(BucketView::open(f.frame(), f.payload.span()));
}

// Seed 003: a quantized weight arrived without its scales.
TEST(Verify, Seed003RejectsGroupMissingAMember) {
  Fixture f;
  f.manifest.entries[0].group = "q";
  f.manifest.groups.push_back({"q", {"w0", "w0.scales"}});
  auto message = expect_rejected(ErrorCode::IncompleteGroup, f.frame(), f.payload.span());
  EXPECT_NE(message.find("group 'q' is missing member 'w0.scales'"), std::string::npos) << message;
}

TEST(Verify, RejectsEntryNamingAGroupThatDoesNotListIt) {
  Fixture f;
  f.manifest.entries[1].group = "q";
  f.manifest.entries[0].group = "q";
  f.manifest.groups.push_back({"q", {"w0"}});
  auto message = expect_rejected(ErrorCode::IncompleteGroup, f.frame(), f.payload.span());
  EXPECT_NE(message.find("'w1'"), std::string::npos) << message;
}

TEST(Verify, RejectsEntryListedByTwoGroups) {
  Fixture f;
  f.manifest.entries[0].group = "a";
  f.manifest.groups.push_back({"a", {"w0"}});
  f.manifest.groups.push_back({"b", {"w0"}});
  expect_rejected(ErrorCode::IncompleteGroup, f.frame(), f.payload.span());
}

TEST(Verify, RejectsDuplicateGroupNames) {
  Fixture f;
  f.manifest.groups.push_back({"a", {}});
  f.manifest.groups.push_back({"a", {}});
  expect_rejected(ErrorCode::DuplicateName, f.frame(), f.payload.span());
}

TEST(Verify, RejectsBucketIndexPastCount) {
  Fixture f;
  f.manifest.bucket_index = 3;
  f.manifest.bucket_count = 3;
  expect_rejected(ErrorCode::ManifestCorrupt, f.frame(), f.payload.span());
}

TEST(Verify, AcceptsBucketMatchingExpectedManifest) {
  Fixture f;
  Manifest expected = f.manifest;
  for (auto& entry : expected.entries) entry.byte_offset = 0;  // offsets are not compared
  EXPECT_NO_THROW(BucketView::open(f.frame(), f.payload.span(), {.expected = &expected}));
}

TEST(Verify, AcceptsExpectedManifestInAnotherOrder) {
  Fixture f;
  Manifest expected = f.manifest;
  std::ranges::reverse(expected.entries);
  EXPECT_NO_THROW(BucketView::open(f.frame(), f.payload.span(), {.expected = &expected}));
}

TEST(Verify, ReportsOneDifferenceInAnOtherwiseEqualExpectedManifest) {
  Fixture f;
  Manifest expected = f.manifest;
  expected.entries.back().shape = {1, 2, 3};
  auto message = expect_rejected(ErrorCode::ManifestMismatch, f.frame(), f.payload.span(),
                                 {.expected = &expected});
  auto part = "'" + expected.entries.back().name + "' has shape";
  EXPECT_NE(message.find(part), std::string::npos) << part << " not in: " << message;
}

TEST(Verify, ReportsEveryExpectedManifestDifferenceInOneError) {
  Fixture f;
  Manifest expected;
  expected.entries = {
      {"w0", DType::F32, {2, 2}, 0, 16, ""},   // shape differs
      {"w1", DType::BF16, {4}, 0, 8, ""},      // dtype differs
      {"bias", DType::F32, {4}, 0, 16, ""},    // missing
      {"norm", DType::F32, {4}, 0, 16, ""},    // missing
  };                                           // w2 is unexpected
  auto message = expect_rejected(ErrorCode::ManifestMismatch, f.frame(), f.payload.span(),
                                 {.expected = &expected});
  for (const char* part : {"missing 'bias', 'norm'", "unexpected 'w2'",
                           "'w0' has shape [4], expected [2, 2]",
                           "'w1' has dtype F32, expected BF16"}) {
    EXPECT_NE(message.find(part), std::string::npos) << part << " not in: " << message;
  }
}

// A model's worth of differences: the message leads with the counts and names the first few
// of each kind; details() lists every one, a line each.
TEST(Verify, SummarizesALongExpectedManifestDifferenceAndDetailsEveryOne) {
  Manifest actual, expected;
  for (int i = 0; i < 40; ++i) {
    expected.entries.push_back({"layer" + std::to_string(i), DType::F32, {4}, 0, 16, ""});
    actual.entries.push_back({"module.layer" + std::to_string(i), DType::F32, {4}, 0, 16, ""});
  }
  try {
    check_expected(actual, expected);
    FAIL() << "no error";
  } catch (const Error& e) {
    std::string message = e.what();
    EXPECT_EQ(message.rfind("bucket does not match the expected manifest (40 missing, 40 unexpected): "
                            "missing 'layer0', 'layer1', 'layer2' and 37 more; unexpected 'module.layer0'",
                            0),
              0u)
        << message;
    EXPECT_LT(message.size(), 200u) << message;
    EXPECT_EQ(std::count(e.details().begin(), e.details().end(), '\n'), 80);
    EXPECT_NE(e.details().find("missing 'layer39'\n"), std::string::npos) << e.details();
    EXPECT_NE(e.details().find("unexpected 'module.layer39'\n"), std::string::npos) << e.details();
  }
}

TEST(Verify, RefusesExpectedManifestThatRepeatsAName) {
  Fixture f;
  Manifest expected = f.manifest;
  expected.entries.push_back(expected.entries[0]);
  auto message = expect_rejected(ErrorCode::InvalidArgument, f.frame(), f.payload.span(),
                                 {.expected = &expected});
  EXPECT_NE(message.find("'w0' twice"), std::string::npos) << message;
}

TEST(Verify, MovedFromViewFindsNothing) {
  Fixture f;
  auto view = BucketView::open(f.frame(), f.payload.span());
  auto moved = std::move(view);
  EXPECT_TRUE(moved.find("w0").has_value());
  EXPECT_FALSE(view.find("w0").has_value());  // NOLINT(bugprone-use-after-move): specified
}

TEST(ManifestCache, ReusesAManifestVerifiedBefore) {
  Fixture f;
  ManifestCache cache;
  auto frame = f.frame();
  auto first = BucketView::open(frame, f.payload.span(), {}, &cache);
  auto second = BucketView::open(frame, f.payload.span(), {}, &cache);
  EXPECT_EQ(&first.manifest(), &second.manifest());
  EXPECT_EQ(second.find("w2")->bytes.data(), f.payload.span().data() + 512);
}

TEST(ManifestCache, VerifiesAgainWhenThePayloadSizeDiffers) {
  Fixture f;
  ManifestCache cache;
  BucketView::open(f.frame(), f.payload.span(), {}, &cache);
  // Same manifest bytes, but a header declaring a payload too short for the last entry.
  auto short_frame = encode_frame(f.manifest, f.payload.span().first(520));  // w2 ends at 528
  expect_rejected(ErrorCode::OutOfBounds, short_frame, f.payload.span(), {});
  std::optional<BucketView> view;
  expect_error(ErrorCode::OutOfBounds,
               [&] { view.emplace(BucketView::open(short_frame, f.payload.span(), {}, &cache)); });
  EXPECT_FALSE(view.has_value());
}

// A producer sends the same layout with a new version every step: one layout, many identities.
TEST(ManifestCache, ReusesALayoutAcrossVersionsAndKeepsEachIdentity) {
  Fixture f;
  ManifestCache cache;
  f.manifest.version = 7;
  auto first = BucketView::open(f.frame(), f.payload.span(), {}, &cache);
  f.manifest.version = 8;
  f.manifest.bucket_index = 1;
  f.manifest.bucket_count = 2;
  auto second = BucketView::open(f.frame(), f.payload.span(), {}, &cache);
  EXPECT_EQ(&first.manifest(), &second.manifest());
  EXPECT_EQ(first.version(), 7u);
  EXPECT_EQ(first.bucket_index(), 0u);
  EXPECT_EQ(first.bucket_count(), 1u);
  EXPECT_EQ(second.version(), 8u);
  EXPECT_EQ(second.bucket_index(), 1u);
  EXPECT_EQ(second.bucket_count(), 2u);
  // The layout itself carries no identity, so it cannot be mistaken for either bucket's.
  EXPECT_EQ(second.manifest().version, 0u);
  EXPECT_EQ(second.manifest().bucket_count, 1u);
}

TEST(ManifestCache, StillChecksTheBucketFieldsOnAHit) {
  Fixture f;
  ManifestCache cache;
  BucketView::open(f.frame(), f.payload.span(), {}, &cache);
  f.manifest.bucket_index = 3;
  f.manifest.bucket_count = 2;
  std::optional<BucketView> view;
  expect_error(ErrorCode::ManifestCorrupt,
               [&] { view.emplace(BucketView::open(f.frame(), f.payload.span(), {}, &cache)); });
  EXPECT_FALSE(view.has_value());
}

TEST(ManifestCache, VerifiesAgainWhenTheLayoutDiffers) {
  Fixture f;
  ManifestCache cache;
  auto first = BucketView::open(f.frame(), f.payload.span(), {}, &cache);
  f.manifest.entries[1].name = "v1";
  auto second = BucketView::open(f.frame(), f.payload.span(), {}, &cache);
  EXPECT_NE(&first.manifest(), &second.manifest());
  EXPECT_TRUE(second.find("v1").has_value());
  EXPECT_FALSE(second.find("w1").has_value());
}

TEST(ManifestCache, StillChecksTheExpectedManifestOnAHit) {
  Fixture f;
  ManifestCache cache;
  auto frame = f.frame();
  BucketView::open(frame, f.payload.span(), {}, &cache);
  Manifest expected;
  std::optional<BucketView> view;
  expect_error(ErrorCode::ManifestMismatch, [&] {
    view.emplace(BucketView::open(frame, f.payload.span(), {.expected = &expected}, &cache));
  });
  EXPECT_FALSE(view.has_value());
}

TEST(Verify, ErrorMessagesEscapeControlBytesInNames) {
  Fixture f;
  f.manifest.entries[0].name = std::string("a\nb", 3);
  f.manifest.entries[0].byte_offset = 1;
  auto message = expect_rejected(ErrorCode::Misaligned, f.frame(), f.payload.span());
  EXPECT_NE(message.find("'a\\x0ab'"), std::string::npos) << message;
}

}  // namespace
}  // namespace tensorbucket
