// The manifest's wire form: cereal's portable binary archive, little endian, laid out in
// columns: the fixed fields of every entry as one block of u64 records, then every name in one
// blob, then every dim in one block. Columns let the decoder check every length against the
// limits and the remaining bytes before it allocates anything, and then read the blocks in
// place: no per-field stream calls and no temporary copies (both showed up as the bulk of
// decoding 10k entries). We drive the archive by hand rather than through cereal's container
// support because cereal sizes a vector or string from the count it reads, before it knows
// whether the bytes exist.
//
//   u8  little-endian flag (cereal's; must be 1)
//   u32 format version, u64 version, u32 bucket_index, u32 bucket_count
//   u64 entry count N
//   N x {u64 dtype, u64 rank, u64 byte_offset, u64 byte_length, u64 name bytes, u64 group bytes}
//   entry names, concatenated; entry group names, concatenated; every dim as i64, concatenated
//   u64 group count G
//   G x {u64 name bytes, u64 member count}
//   group names, concatenated; member name lengths as u64; member names, concatenated
#include <cereal/archives/portable_binary.hpp>

#include <bit>
#include <cstring>
#include <istream>
#include <ostream>
#include <streambuf>

#include "identity.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/manifest.hpp"
#include "base/text.hpp"

namespace tensorbucket {
namespace {

constexpr std::size_t kEntryFields = 6;
constexpr std::size_t kGroupFields = 2;

// Reads straight from the caller's bytes; never copies them.
class ReadBuffer : public std::streambuf {
 public:
  explicit ReadBuffer(std::span<const std::byte> bytes) {
    // The get area is declared mutable but only ever read.
    auto* begin = const_cast<char*>(reinterpret_cast<const char*>(bytes.data()));
    setg(begin, begin, begin + bytes.size());
  }
  std::uint64_t remaining() const { return static_cast<std::uint64_t>(egptr() - gptr()); }

  // The next `size` bytes, in place; the caller checked that they remain.
  const std::byte* take(std::uint64_t size) {
    const auto* at = reinterpret_cast<const std::byte*>(gptr());
    setg(eback(), gptr() + size, egptr());
    return at;
  }
};

class WriteBuffer : public std::streambuf {
 public:
  explicit WriteBuffer(std::vector<std::byte>& out) : out_(out) {}

 protected:
  std::streamsize xsputn(const char* bytes, std::streamsize count) override {
    auto* begin = reinterpret_cast<const std::byte*>(bytes);
    out_.insert(out_.end(), begin, begin + count);
    return count;
  }
  int_type overflow(int_type c) override {
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      out_.push_back(static_cast<std::byte>(traits_type::to_char_type(c)));
    }
    return traits_type::not_eof(c);
  }

 private:
  std::vector<std::byte>& out_;
};

class Encoder {
 public:
  explicit Encoder(std::vector<std::byte>& out)
      : buffer_(out),
        stream_(&buffer_),
        archive_(stream_, cereal::PortableBinaryOutputArchive::Options::LittleEndian()) {}

  template <class T>
  void write(T value) {
    archive_(value);
  }
  template <class T>
  void write_block(const std::vector<T>& values) {
    archive_(cereal::binary_data(values.data(), values.size() * sizeof(T)));
  }
  void write_blob(const std::string& bytes) {
    archive_(cereal::binary_data(bytes.data(), bytes.size()));
  }

 private:
  WriteBuffer buffer_;
  std::ostream stream_;
  cereal::PortableBinaryOutputArchive archive_;
};

// Little-endian u32 and u64 at a byte offset, as cereal's portable archive writes them.
template <class T>
T to_little_endian(T value) {
  if constexpr (std::endian::native == std::endian::little) return value;
  else if constexpr (sizeof(T) == 8) return __builtin_bswap64(value);
  else return __builtin_bswap32(value);
}
template <class T>
T load_le(const std::byte* at) {
  T value;
  std::memcpy(&value, at, sizeof value);
  return to_little_endian(value);
}
template <class T>
void store_le(std::byte* at, T value) {
  value = to_little_endian(value);
  std::memcpy(at, &value, sizeof value);
}

// A block of little-endian 8-byte words inside the input.
class Words {
 public:
  explicit Words(const std::byte* at) : at_(at) {}
  std::uint64_t operator[](std::size_t i) const { return load_le<std::uint64_t>(at_ + 8 * i); }

 private:
  const std::byte* at_;
};

// Hands out consecutive slices of a blob whose total length was checked.
class Slices {
 public:
  explicit Slices(const std::byte* at) : at_(reinterpret_cast<const char*>(at)) {}
  std::string_view next(std::uint64_t length) {
    std::string_view slice(at_, length);
    at_ += length;
    return slice;
  }

 private:
  const char* at_;
};

class Decoder {
 public:
  explicit Decoder(std::span<const std::byte> bytes)
      : buffer_(bytes), stream_(&buffer_), archive_(stream_) {
    if (bytes[0] != std::byte{1}) {
      text::fail(ErrorCode::ManifestCorrupt, "manifest is not little endian (flag byte ",
                 static_cast<unsigned>(bytes[0]), ')');
    }
  }

  template <class T>
  T read() {
    T value;
    archive_(value);
    return value;
  }

  // A count of items of at least `item_bytes` each, refused when above `limit` or when the
  // remaining bytes cannot hold that many.
  std::uint64_t read_count(std::uint64_t limit, std::uint64_t item_bytes, const char* what) {
    auto count = read<std::uint64_t>();
    if (count > limit) {
      text::fail(ErrorCode::ManifestCorrupt, "manifest declares ", count, ' ', what,
                 "; the limit is ", limit);
    }
    need(count * item_bytes, what);
    return count;
  }

  Words words(std::uint64_t count, const char* what) {
    need(count * 8, what);  // counts are bounded far below 2^61
    return Words(buffer_.take(count * 8));
  }
  Slices blob(std::uint64_t size, const char* what) {
    need(size, what);
    return Slices(buffer_.take(size));
  }

  void expect_end() {
    if (buffer_.remaining() != 0) {
      text::fail(ErrorCode::ManifestCorrupt, "manifest has ", buffer_.remaining(),
                 " trailing bytes");
    }
  }

 private:
  void need(std::uint64_t size, const char* what) {
    if (size > buffer_.remaining()) {
      text::fail(ErrorCode::ManifestCorrupt, "manifest needs ", size, " bytes of ", what,
                 " but only ", buffer_.remaining(), " remain");
    }
  }

  ReadBuffer buffer_;
  std::istream stream_;
  cereal::PortableBinaryInputArchive archive_;
};

std::uint64_t bounded(std::uint64_t value, std::uint64_t limit, const char* what) {
  if (value > limit) {
    text::fail(ErrorCode::ManifestCorrupt, "manifest declares ", value, ' ', what,
               "; the limit is ", limit);
  }
  return value;
}

}  // namespace

std::vector<std::byte> encode_manifest(const Manifest& manifest) {
  // Size every column first so each is filled once, without regrowing.
  std::size_t name_bytes = 0, group_bytes = 0, dim_count = 0;
  for (const auto& entry : manifest.entries) {
    name_bytes += entry.name.size();
    group_bytes += entry.group.size();
    dim_count += entry.shape.size();
  }
  std::vector<std::uint64_t> records(manifest.entries.size() * kEntryFields);
  std::string names, group_names;
  names.reserve(name_bytes);
  group_names.reserve(group_bytes);
  std::vector<std::int64_t> dims;
  dims.reserve(dim_count);
  auto* record = records.data();
  for (const auto& entry : manifest.entries) {
    *record++ = static_cast<std::uint64_t>(entry.dtype);
    *record++ = entry.shape.size();
    *record++ = entry.byte_offset;
    *record++ = entry.byte_length;
    *record++ = entry.name.size();
    *record++ = entry.group.size();
    names += entry.name;
    group_names += entry.group;
    dims.insert(dims.end(), entry.shape.begin(), entry.shape.end());
  }
  std::vector<std::uint64_t> group_records, member_lengths;
  std::string group_own_names, member_names;
  for (const auto& group : manifest.groups) {
    group_records.insert(group_records.end(), {group.name.size(), group.members.size()});
    group_own_names += group.name;
    for (const auto& member : group.members) {
      member_lengths.push_back(member.size());
      member_names += member;
    }
  }

  std::vector<std::byte> out;
  out.reserve(64 + 8 * (records.size() + dims.size() + group_records.size() +
                        member_lengths.size()) +
              names.size() + group_names.size() + group_own_names.size() + member_names.size());
  Encoder encoder(out);
  encoder.write(kManifestFormatVersion);
  encoder.write(manifest.version);
  encoder.write(manifest.bucket_index);
  encoder.write(manifest.bucket_count);
  encoder.write(std::uint64_t{manifest.entries.size()});
  encoder.write_block(records);
  encoder.write_blob(names);
  encoder.write_blob(group_names);
  encoder.write_block(dims);
  encoder.write(std::uint64_t{manifest.groups.size()});
  encoder.write_block(group_records);
  encoder.write_blob(group_own_names);
  encoder.write_block(member_lengths);
  encoder.write_blob(member_names);
  return out;
}

Manifest decode_manifest(std::span<const std::byte> bytes) {
  if (bytes.empty()) text::fail(ErrorCode::ManifestCorrupt, "manifest is empty");
  if (bytes.size() > kMaxManifestBytes) {
    text::fail(ErrorCode::ManifestCorrupt, "manifest has ", bytes.size(),
               " bytes; the limit is ", kMaxManifestBytes);
  }
  try {
    Decoder decoder(bytes);
    auto format_version = decoder.read<std::uint32_t>();
    if (format_version != kManifestFormatVersion) {
      text::fail(ErrorCode::ManifestCorrupt, "manifest format version ", format_version,
                 " is not supported (this build reads version ", kManifestFormatVersion, ')');
    }
    Manifest manifest;
    manifest.version = decoder.read<std::uint64_t>();
    manifest.bucket_index = decoder.read<std::uint32_t>();
    manifest.bucket_count = decoder.read<std::uint32_t>();

    // Entries. Every field is bounded before it is summed, so the sums cannot overflow.
    auto entry_count = decoder.read_count(kMaxEntries, 8 * kEntryFields, "entries");
    auto records = decoder.words(entry_count * kEntryFields, "entry records");
    std::uint64_t name_bytes = 0, group_bytes = 0, dim_count = 0;
    for (std::size_t i = 0; i < entry_count * kEntryFields; i += kEntryFields) {
      bounded(records[i], 0xff, "as a dtype value");
      dim_count += bounded(records[i + 1], kMaxRank, "dims in one entry");
      name_bytes += bounded(records[i + 4], kMaxNameBytes, "bytes in one name");
      group_bytes += bounded(records[i + 5], kMaxNameBytes, "bytes in one group name");
    }
    auto names = decoder.blob(name_bytes, "entry names");
    auto group_names = decoder.blob(group_bytes, "entry group names");
    auto dims = decoder.words(dim_count, "dims");

    manifest.entries.reserve(entry_count);
    std::size_t next_dim = 0;
    for (std::size_t i = 0; i < entry_count; ++i) {
      auto field = [&](std::size_t f) { return records[i * kEntryFields + f]; };
      auto& entry = manifest.entries.emplace_back();
      entry.name = names.next(field(4));
      entry.dtype = static_cast<DType>(field(0));
      entry.shape.resize(field(1));
      for (auto& dim : entry.shape) dim = static_cast<std::int64_t>(dims[next_dim++]);
      entry.byte_offset = field(2);
      entry.byte_length = field(3);
      entry.group = group_names.next(field(5));
    }

    // Groups: the same columns, one level deeper for the member lists.
    auto group_count = decoder.read_count(kMaxGroups, 8 * kGroupFields, "groups");
    auto group_records = decoder.words(group_count * kGroupFields, "group records");
    std::uint64_t own_name_bytes = 0, member_count = 0;
    for (std::size_t i = 0; i < group_count * kGroupFields; i += kGroupFields) {
      own_name_bytes += bounded(group_records[i], kMaxNameBytes, "bytes in one group name");
      member_count += bounded(group_records[i + 1], kMaxEntries, "members in one group");
      bounded(member_count, kMaxEntries, "group members in all");
    }
    auto own_names = decoder.blob(own_name_bytes, "group names");
    auto member_lengths = decoder.words(member_count, "member lengths");
    std::uint64_t member_bytes = 0;
    for (std::size_t i = 0; i < member_count; ++i) {
      member_bytes += bounded(member_lengths[i], kMaxNameBytes, "bytes in one member name");
    }
    auto member_names = decoder.blob(member_bytes, "member names");
    decoder.expect_end();

    manifest.groups.resize(group_count);
    std::size_t next_member = 0;
    for (std::size_t g = 0; g < group_count; ++g) {
      auto& group = manifest.groups[g];
      group.name = own_names.next(group_records[g * kGroupFields]);
      group.members.resize(group_records[g * kGroupFields + 1]);
      for (auto& member : group.members) member = member_names.next(member_lengths[next_member++]);
    }
    return manifest;
  } catch (const cereal::Exception& e) {
    // cereal reports a read past the end of the bytes this way.
    text::fail(ErrorCode::ManifestCorrupt, "manifest is truncated: ", e.what());
  }
}

detail::BucketIdentity detail::read_identity(std::span<const std::byte> encoded) noexcept {
  const auto* at = encoded.data() + kIdentityOffset;
  return {load_le<std::uint64_t>(at), load_le<std::uint32_t>(at + 8), load_le<std::uint32_t>(at + 12)};
}

void detail::stamp_identity(std::span<std::byte> encoded, const BucketIdentity& identity) noexcept {
  auto* at = encoded.data() + kIdentityOffset;
  store_le(at, identity.version);
  store_le(at + 8, identity.bucket_index);
  store_le(at + 12, identity.bucket_count);
}

void detail::check_identity(const BucketIdentity& identity) {
  if (identity.bucket_count == 0 || identity.bucket_index >= identity.bucket_count) {
    text::fail(ErrorCode::ManifestCorrupt, "bucket index ", identity.bucket_index,
               " is not below bucket count ", identity.bucket_count);
  }
}

}  // namespace tensorbucket
