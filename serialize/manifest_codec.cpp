// The manifest's wire form: cereal's portable binary archive (little endian), fields written
// one by one in the order below, counts as u64. We drive the archive by hand rather than
// through cereal's container support because cereal sizes a vector or string from the count
// it reads, before it knows whether the bytes exist; a hostile count would allocate freely.
//
//   u8 little-endian flag (cereal's), u32 format version, u64 version, u32 bucket_index,
//   u32 bucket_count,
//   u64 entry count, per entry: string name, u8 dtype, u64 rank, rank x i64 dims,
//                               u64 byte_offset, u64 byte_length, string group
//   u64 group count, per group: string name, u64 member count, member strings
//   string = u64 byte count + bytes
#include <cereal/archives/portable_binary.hpp>

#include <istream>
#include <ostream>
#include <streambuf>

#include "tensorbucket/error.hpp"
#include "tensorbucket/manifest.hpp"
#include "text.hpp"

namespace tensorbucket {
namespace {

// Smallest encodings, used to refuse counts the remaining bytes cannot hold.
constexpr std::uint64_t kMinEntryBytes = 8 + 1 + 8 + 8 + 8 + 8;
constexpr std::uint64_t kMinGroupBytes = 8 + 8;
constexpr std::uint64_t kMinStringBytes = 8;

// Reads straight from the caller's bytes; never copies them.
class ReadBuffer : public std::streambuf {
 public:
  explicit ReadBuffer(std::span<const std::byte> bytes) {
    // The get area is declared mutable but only ever read.
    auto* begin = const_cast<char*>(reinterpret_cast<const char*>(bytes.data()));
    setg(begin, begin, begin + bytes.size());
  }
  std::uint64_t remaining() const { return static_cast<std::uint64_t>(egptr() - gptr()); }
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
  void write(const std::string& text) {
    write(std::uint64_t{text.size()});
    archive_(cereal::binary_data(text.data(), text.size()));
  }
  void write(const std::vector<std::int64_t>& dims) {
    write(std::uint64_t{dims.size()});
    archive_(cereal::binary_data(dims.data(), dims.size() * sizeof(std::int64_t)));
  }

 private:
  WriteBuffer buffer_;
  std::ostream stream_;
  cereal::PortableBinaryOutputArchive archive_;
};

class Decoder {
 public:
  explicit Decoder(std::span<const std::byte> bytes)
      : buffer_(bytes), stream_(&buffer_), archive_(stream_) {}

  template <class T>
  T read() {
    T value;
    archive_(value);
    return value;
  }

  // A count of items, each at least `min_item_bytes` long, refused before any allocation
  // when above `limit` or when the remaining bytes cannot hold that many items.
  std::uint64_t read_count(std::uint64_t limit, std::uint64_t min_item_bytes, const char* what) {
    auto count = read<std::uint64_t>();
    if (count > limit) {
      text::fail(ErrorCode::ManifestCorrupt, "manifest declares ", count, ' ', what,
                 "; the limit is ", limit);
    }
    if (count > buffer_.remaining() / min_item_bytes) {
      text::fail(ErrorCode::ManifestCorrupt, "manifest declares ", count, ' ', what, " but only ",
                 buffer_.remaining(), " bytes remain");
    }
    return count;
  }

  std::string read_string(const char* what) {
    auto length = read_count(kMaxNameBytes, 1, what);
    std::string text(length, '\0');
    archive_(cereal::binary_data(text.data(), length));
    return text;
  }

  void read_dims(std::vector<std::int64_t>& dims) {
    dims.resize(read_count(kMaxRank, sizeof(std::int64_t), "dims"));
    archive_(cereal::binary_data(dims.data(), dims.size() * sizeof(std::int64_t)));
  }

  void expect_end() {
    if (buffer_.remaining() != 0) {
      text::fail(ErrorCode::ManifestCorrupt, "manifest has ", buffer_.remaining(),
                 " trailing bytes");
    }
  }

 private:
  ReadBuffer buffer_;
  std::istream stream_;
  cereal::PortableBinaryInputArchive archive_;
};

std::size_t estimated_size(const Manifest& manifest) {
  std::size_t size = 64;
  for (const auto& entry : manifest.entries) {
    size += kMinEntryBytes + entry.name.size() + entry.group.size() + 8 * entry.shape.size();
  }
  for (const auto& group : manifest.groups) {
    size += kMinGroupBytes + group.name.size() + kMinStringBytes * group.members.size();
    for (const auto& member : group.members) size += member.size();
  }
  return size;
}

}  // namespace

std::vector<std::byte> encode_manifest(const Manifest& manifest) {
  std::vector<std::byte> out;
  out.reserve(estimated_size(manifest));
  {
    Encoder encoder(out);
    encoder.write(kManifestFormatVersion);
    encoder.write(manifest.version);
    encoder.write(manifest.bucket_index);
    encoder.write(manifest.bucket_count);
    encoder.write(std::uint64_t{manifest.entries.size()});
    for (const auto& entry : manifest.entries) {
      encoder.write(entry.name);
      encoder.write(static_cast<std::uint8_t>(entry.dtype));
      encoder.write(entry.shape);
      encoder.write(entry.byte_offset);
      encoder.write(entry.byte_length);
      encoder.write(entry.group);
    }
    encoder.write(std::uint64_t{manifest.groups.size()});
    for (const auto& group : manifest.groups) {
      encoder.write(group.name);
      encoder.write(std::uint64_t{group.members.size()});
      for (const auto& member : group.members) encoder.write(member);
    }
  }
  return out;
}

Manifest decode_manifest(std::span<const std::byte> bytes) {
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

    manifest.entries.resize(decoder.read_count(kMaxEntries, kMinEntryBytes, "entries"));
    for (auto& entry : manifest.entries) {
      entry.name = decoder.read_string("name bytes");
      entry.dtype = static_cast<DType>(decoder.read<std::uint8_t>());
      decoder.read_dims(entry.shape);
      entry.byte_offset = decoder.read<std::uint64_t>();
      entry.byte_length = decoder.read<std::uint64_t>();
      entry.group = decoder.read_string("group name bytes");
    }

    manifest.groups.resize(decoder.read_count(kMaxGroups, kMinGroupBytes, "groups"));
    for (auto& group : manifest.groups) {
      group.name = decoder.read_string("group name bytes");
      group.members.resize(decoder.read_count(kMaxEntries, kMinStringBytes, "group members"));
      for (auto& member : group.members) member = decoder.read_string("member name bytes");
    }
    decoder.expect_end();
    return manifest;
  } catch (const cereal::Exception& e) {
    // cereal reports a read past the end of the bytes this way.
    text::fail(ErrorCode::ManifestCorrupt, "manifest is truncated: ", e.what());
  }
}

}  // namespace tensorbucket
