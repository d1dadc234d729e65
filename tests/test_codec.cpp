// The manifest codec and the header frame: exact round-trips, and hostile bytes refused
// before anything is allocated.
#include <gtest/gtest.h>

#include <cstring>

#include "support.hpp"

namespace tensorbucket {
namespace {

using test::expect_error;

Manifest sample_manifest() {
  Manifest m;
  m.version = 123456789012345ull;
  m.bucket_index = 3;
  m.bucket_count = 40;
  m.entries = {{"embed", DType::BF16, {1024, 64}, 0, 131072, ""},
               {"q.weight", DType::I8, {64, 64}, 131072, 4096, "q"},
               {"q.scales", DType::F32, {64}, 135168, 256, "q"},
               {"scalar", DType::F64, {}, 135424, 8, ""}};
  m.groups = {{"q", {"q.weight", "q.scales"}}};
  return m;
}

void append_u64(std::vector<std::byte>& bytes, std::uint64_t value) {
  auto at = bytes.size();
  bytes.resize(at + 8);
  std::memcpy(bytes.data() + at, &value, 8);
}

// The fixed prefix of an encoding: endianness flag, format version, version, index, count.
std::vector<std::byte> prefix() {
  auto bytes = encode_manifest(Manifest{});
  bytes.resize(1 + 4 + 8 + 4 + 4);
  return bytes;
}

TEST(Dtype, NamesAndSizesFollowSafetensors) {
  EXPECT_EQ(dtype_name(DType::BF16), "BF16");
  EXPECT_EQ(itemsize(DType::BF16), 2u);
  EXPECT_EQ(itemsize(DType::F8_E4M3), 1u);
  EXPECT_EQ(itemsize(DType::U64), 8u);
  for (std::size_t i = 0; i < kDTypeCount; ++i) {
    auto dtype = static_cast<DType>(i);
    EXPECT_EQ(dtype_from_name(dtype_name(dtype)), dtype);
    EXPECT_GT(itemsize(dtype), 0u);
  }
  EXPECT_FALSE(dtype_from_name("float32").has_value());
  EXPECT_FALSE(is_known(static_cast<DType>(kDTypeCount)));
  EXPECT_EQ(itemsize(static_cast<DType>(kDTypeCount)), 0u);
}

TEST(Shape, KeepsFewDimsInlineAndSpillsMany) {
  Shape small{2, 3};
  EXPECT_EQ(small.size(), 2u);
  EXPECT_EQ(small[1], 3);
  Shape big;
  big.resize(Shape::kInlineRank + 2);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::int64_t>(i);
  Shape copy = big;
  EXPECT_EQ(copy, big);
  EXPECT_NE(copy, small);
  big.resize(3);  // back inline, keeping the first dims
  EXPECT_EQ(big, (Shape{0, 1, 2}));
  big.resize(5);  // new dims are zero
  EXPECT_EQ(big, (Shape{0, 1, 2, 0, 0}));
}

TEST(Shape, MovedFromIsEmpty) {
  Shape big;
  big.resize(Shape::kInlineRank + 1);
  Shape moved = std::move(big);
  EXPECT_EQ(moved.size(), Shape::kInlineRank + 1);
  EXPECT_TRUE(big.empty());  // NOLINT(bugprone-use-after-move): the state is specified
  EXPECT_EQ(big.begin(), big.end());
}

TEST(Codec, ManifestRoundTripsExactly) {
  auto m = sample_manifest();
  auto bytes = encode_manifest(m);
  EXPECT_EQ(decode_manifest(bytes), m);
  EXPECT_EQ(encode_manifest(decode_manifest(bytes)), bytes);
}

TEST(Codec, EncodingIsLittleEndianAndVersioned) {
  auto bytes = encode_manifest(Manifest{});
  ASSERT_GE(bytes.size(), 5u);
  EXPECT_EQ(bytes[0], std::byte{1});  // cereal's little-endian flag
  std::uint32_t format_version;
  std::memcpy(&format_version, bytes.data() + 1, 4);
  EXPECT_EQ(format_version, kManifestFormatVersion);
}

TEST(Codec, RejectsEmptyBytes) {
  expect_error(ErrorCode::ManifestCorrupt, [] { decode_manifest({}); });
}

TEST(Codec, RejectsUnknownFormatVersion) {
  auto bytes = encode_manifest(Manifest{});
  bytes[1] = std::byte{99};
  auto message = expect_error(ErrorCode::ManifestCorrupt, [&] { decode_manifest(bytes); });
  EXPECT_NE(message.find("99"), std::string::npos) << message;
}

TEST(Codec, RejectsTrailingBytes) {
  auto bytes = encode_manifest(sample_manifest());
  bytes.push_back(std::byte{0});
  expect_error(ErrorCode::ManifestCorrupt, [&] { decode_manifest(bytes); });
}

TEST(Codec, RejectsEveryTruncation) {
  auto bytes = encode_manifest(sample_manifest());
  for (std::size_t length = 0; length < bytes.size(); ++length) {
    expect_error(ErrorCode::ManifestCorrupt,
                 [&] { decode_manifest(std::span(bytes).first(length)); });
  }
}

TEST(Codec, RefusesHugeEntryCountBeforeAllocating) {
  auto bytes = prefix();
  append_u64(bytes, ~std::uint64_t{0});
  auto message = expect_error(ErrorCode::ManifestCorrupt, [&] { decode_manifest(bytes); });
  EXPECT_NE(message.find("limit"), std::string::npos) << message;
}

TEST(Codec, RefusesEntryCountTheBytesCannotHold) {
  auto bytes = prefix();
  append_u64(bytes, 1000);  // under the limit, but nothing follows
  auto message = expect_error(ErrorCode::ManifestCorrupt, [&] { decode_manifest(bytes); });
  EXPECT_NE(message.find("but only 0 remain"), std::string::npos) << message;
}

TEST(Codec, RefusesHugeNameLengthBeforeAllocating) {
  auto bytes = prefix();
  append_u64(bytes, 1);  // one entry record: dtype, rank, offset, length, name bytes, group bytes
  for (std::uint64_t field : {0ull, 0ull, 0ull, 0ull, 1ull << 40, 0ull}) append_u64(bytes, field);
  bytes.resize(bytes.size() + 64);
  auto message = expect_error(ErrorCode::ManifestCorrupt, [&] { decode_manifest(bytes); });
  EXPECT_NE(message.find("1099511627776 bytes in one name"), std::string::npos) << message;
}

TEST(Codec, RefusesGroupMembersPastTheTotalLimit) {
  auto bytes = prefix();
  append_u64(bytes, 0);  // no entries
  append_u64(bytes, 2);  // two group records {name bytes, member count}, each within limits
  for (std::uint64_t field : {std::uint64_t{1}, kMaxEntries, std::uint64_t{1}, kMaxEntries}) append_u64(bytes, field);
  bytes.resize(bytes.size() + 256);
  auto message = expect_error(ErrorCode::ManifestCorrupt, [&] { decode_manifest(bytes); });
  EXPECT_NE(message.find("group members in all"), std::string::npos) << message;
}

TEST(Codec, RejectsBigEndianFlag) {
  auto bytes = encode_manifest(Manifest{});
  bytes[0] = std::byte{0};
  expect_error(ErrorCode::ManifestCorrupt, [&] { decode_manifest(bytes); });
}

TEST(Header, FrameCarriesSizesAndHashes) {
  auto m = sample_manifest();
  std::vector<std::byte> payload(135680, std::byte{7});
  auto frame = encode_frame(m, payload, {.payload_checksum = true});
  auto header = read_header(frame);
  EXPECT_EQ(header.magic, kHeaderMagic);
  EXPECT_EQ(header.layout_version, kHeaderLayoutVersion);
  EXPECT_EQ(header.flags, kPayloadChecksum);
  EXPECT_EQ(header.payload_bytes, payload.size());
  EXPECT_EQ(header.payload_xxh3, xxh3(payload));
  EXPECT_EQ(header.manifest_bytes, frame.size() - sizeof(BucketHeader));
  EXPECT_EQ(decode_manifest(manifest_bytes(header, frame)), m);
}

TEST(Header, PayloadHashIsZeroWithoutChecksumFlag) {
  std::vector<std::byte> payload(256);
  auto header = read_header(encode_frame(Manifest{}, payload));
  EXPECT_EQ(header.flags, 0);
  EXPECT_EQ(header.payload_xxh3, 0u);
}

class HeaderField : public ::testing::Test {
 protected:
  std::vector<std::byte> frame = encode_frame(sample_manifest(), std::vector<std::byte>(135680));
  BucketHeader header() const {
    BucketHeader h;
    std::memcpy(&h, frame.data(), sizeof h);
    return h;
  }
  void set(const BucketHeader& h) { std::memcpy(frame.data(), &h, sizeof h); }
};

TEST_F(HeaderField, RejectsBadMagic) {
  auto h = header();
  h.magic ^= 1;
  set(h);
  expect_error(ErrorCode::HeaderCorrupt, [&] { read_header(frame); });
}

TEST_F(HeaderField, RejectsUnknownLayoutVersion) {
  auto h = header();
  h.layout_version = 2;
  set(h);
  expect_error(ErrorCode::HeaderCorrupt, [&] { read_header(frame); });
}

TEST_F(HeaderField, RejectsUnknownFlags) {
  auto h = header();
  h.flags = 0x8000;
  set(h);
  expect_error(ErrorCode::HeaderCorrupt, [&] { read_header(frame); });
}

TEST_F(HeaderField, RejectsNonZeroReservedBytes) {
  auto h = header();
  h.reserved[5] = 1;
  set(h);
  expect_error(ErrorCode::HeaderCorrupt, [&] { read_header(frame); });
}

TEST_F(HeaderField, RejectsManifestSizePastLimit) {
  auto h = header();
  h.manifest_bytes = kMaxManifestBytes + 1;
  set(h);
  expect_error(ErrorCode::HeaderCorrupt, [&] { read_header(frame); });
}

TEST_F(HeaderField, RejectsShortFrame) {
  frame.resize(sizeof(BucketHeader) - 1);
  expect_error(ErrorCode::HeaderCorrupt, [&] { read_header(frame); });
}

TEST_F(HeaderField, RejectsTruncatedManifest) {
  frame.pop_back();
  auto h = read_header(frame);
  expect_error(ErrorCode::ManifestCorrupt, [&] { manifest_bytes(h, frame); });
}

}  // namespace
}  // namespace tensorbucket
