// The safetensors header parser: a file is hostile input. nlohmann-json reads the JSON as
// events (its SAX interface), and this state machine accepts only the format's shape, so no
// document is built, nothing nests deeper than the format does, and every count is bounded
// before it grows anything.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <unordered_set>

#include "base/text.hpp"
#include "tensorbucket/safetensors.hpp"

namespace tensorbucket::safetensors {
namespace {

using text::fail;
using Json = nlohmann::json;

// A name or value from the file, quoted and cut to 64 bytes: a hostile header's 100 MB key
// must not become a 100 MB error message.
text::Quoted shown(std::string_view name) { return text::Quoted{name.substr(0, 64)}; }
std::string to_text(text::Quoted name) {
  std::ostringstream out;
  out << name;
  return out.str();
}
std::string cut(std::string text) {
  if (text.size() > 200) text.replace(200, std::string::npos, "...");
  return text;
}

// What the next event may be.
enum class Expect {
  Top,          // the document: an object
  Key,          // a tensor's name, "__metadata__", or the top object's end
  Tensor,       // a tensor's object
  TensorField,  // "dtype", "shape", "data_offsets", or the tensor object's end
  Dtype,        // a string
  Shape,        // an array's start
  Dim,          // a dim or the array's end
  Offsets,      // an array's start
  Offset,       // an offset or the array's end
  Metadata,     // the metadata's object
  MetadataKey,  // a key or the metadata object's end
  MetadataValue,
  Done,
};

class HeaderReader final : public nlohmann::json_sax<Json> {
 public:
  HeaderReader(const std::string& what, std::uint64_t data_bytes, FileHeader& header)
      : what_(what), data_bytes_(data_bytes), header_(header) {}

  bool start_object(std::size_t) override {
    switch (expect_) {
      case Expect::Top: expect_ = Expect::Key; return true;
      case Expect::Tensor:
        tensor_ = {};
        tensor_.name = std::move(key_);
        has_dtype_ = has_shape_ = has_offsets_ = false;
        expect_ = Expect::TensorField;
        return true;
      case Expect::Metadata: expect_ = Expect::MetadataKey; return true;
      default: unexpected("an object");
    }
  }

  bool key(string_t& key) override {
    switch (expect_) {
      case Expect::Key:
        if (key.empty() || key.size() > kMaxNameBytes) {
          fail(ErrorCode::BadName, what_, ": tensor name ", shown(key), " must be 1 to ", kMaxNameBytes, " bytes, not ",
               key.size());
        }
        if (!keys_.insert(key).second) fail(ErrorCode::DuplicateName, what_, ": entry ", shown(key), " appears twice");
        if (key == "__metadata__") {
          expect_ = Expect::Metadata;
          return true;
        }
        if (header_.tensors.size() >= kMaxEntries) {
          fail(ErrorCode::HeaderCorrupt, what_, ": more than ", kMaxEntries, " tensors");
        }
        key_ = std::move(key);
        expect_ = Expect::Tensor;
        return true;
      case Expect::TensorField:
        if (key == "dtype") {
          once(has_dtype_, key);
          expect_ = Expect::Dtype;
        } else if (key == "shape") {
          once(has_shape_, key);
          expect_ = Expect::Shape;
        } else if (key == "data_offsets") {
          once(has_offsets_, key);
          expect_ = Expect::Offsets;
        } else {
          fail(ErrorCode::HeaderCorrupt, what_, ": tensor ", shown(tensor_.name), " has an unknown field ", shown(key),
               " (a tensor has dtype, shape and data_offsets)");
        }
        return true;
      case Expect::MetadataKey:
        if (header_.metadata.size() >= kMaxEntries) {
          fail(ErrorCode::HeaderCorrupt, what_, ": more than ", kMaxEntries, " metadata entries");
        }
        if (!metadata_keys_.insert(key).second) {
          fail(ErrorCode::DuplicateName, what_, ": __metadata__ has ", shown(key), " twice");
        }
        header_.metadata.emplace_back(std::move(key), std::string());
        expect_ = Expect::MetadataValue;
        return true;
      default: unexpected("a key");
    }
  }

  bool string(string_t& value) override {
    if (expect_ == Expect::Dtype) {
      auto dtype = dtype_from_name(value);
      if (!dtype) {
        fail(ErrorCode::UnsupportedDtype, what_, ": tensor ", shown(tensor_.name), " has dtype ", shown(value),
             ", which tensorbucket does not carry (it carries BOOL U8 I8 I16 U16 I32 U32 I64 U64 F16 BF16 F32 F64 "
             "F8_E4M3 F8_E5M2)");
      }
      tensor_.dtype = *dtype;
      expect_ = Expect::TensorField;
      return true;
    }
    if (expect_ == Expect::MetadataValue) {
      header_.metadata.back().second = std::move(value);
      expect_ = Expect::MetadataKey;
      return true;
    }
    unexpected("a string");
  }

  bool start_array(std::size_t) override {
    if (expect_ == Expect::Shape) {
      dims_.clear();
      expect_ = Expect::Dim;
    } else if (expect_ == Expect::Offsets) {
      offsets_ = 0;
      expect_ = Expect::Offset;
    } else {
      unexpected("an array");
    }
    return true;
  }

  bool number_unsigned(number_unsigned_t value) override {
    if (expect_ == Expect::Dim) {
      if (dims_.size() >= kMaxRank) {
        fail(ErrorCode::BadShape, what_, ": tensor ", shown(tensor_.name), " has more than ", kMaxRank, " dims");
      }
      if (value > static_cast<std::uint64_t>(INT64_MAX)) {
        fail(ErrorCode::BadShape, what_, ": tensor ", shown(tensor_.name), " has a dim of ", value);
      }
      dims_.push_back(static_cast<std::int64_t>(value));
      return true;
    }
    if (expect_ == Expect::Offset) {
      if (offsets_ == 2) fail(ErrorCode::HeaderCorrupt, what_, ": tensor ", shown(tensor_.name), " has more than 2 data_offsets");
      (offsets_++ == 0 ? tensor_.begin : tensor_.end) = value;
      return true;
    }
    unexpected("a number");
  }

  bool number_integer(number_integer_t value) override {
    if (value >= 0) return number_unsigned(static_cast<number_unsigned_t>(value));
    if (expect_ == Expect::Dim) {
      fail(ErrorCode::BadShape, what_, ": tensor ", shown(tensor_.name), " has a negative dim, ", value);
    }
    if (expect_ == Expect::Offset) {
      fail(ErrorCode::OutOfBounds, what_, ": tensor ", shown(tensor_.name), " has a negative data offset, ", value);
    }
    unexpected("a number");
  }

  bool end_array() override {
    if (expect_ == Expect::Dim) {
      tensor_.shape.assign(dims_);
    } else if (expect_ == Expect::Offset) {
      if (offsets_ != 2) {
        fail(ErrorCode::HeaderCorrupt, what_, ": tensor ", shown(tensor_.name), " has ", offsets_,
             " data_offsets, not 2 (begin, end)");
      }
    } else {
      unexpected("an array's end");
    }
    expect_ = Expect::TensorField;
    return true;
  }

  bool end_object() override {
    switch (expect_) {
      case Expect::TensorField:
        finish_tensor();
        expect_ = Expect::Key;
        return true;
      case Expect::MetadataKey: expect_ = Expect::Key; return true;
      case Expect::Key: expect_ = Expect::Done; return true;
      default: unexpected("an object's end");
    }
  }

  bool null() override { unexpected("null"); }
  bool boolean(bool) override { unexpected("a boolean"); }
  bool number_float(number_float_t, const string_t& text) override {
    if (expect_ == Expect::Dim || expect_ == Expect::Offset) {
      fail(ErrorCode::HeaderCorrupt, what_, ": tensor ", shown(tensor_.name), " has ", cut(text),
           " where a whole number below 2^64 is due");
    }
    unexpected("a number");
  }
  bool binary(binary_t&) override { unexpected("binary data"); }

  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& error) override {
    // nlohmann's message: "[json.exception.parse_error.101] parse error at line 1, column 5: ..."
    std::string why = error.what();
    if (auto at = why.find("] "); at != std::string::npos) why.erase(0, at + 2);
    fail(ErrorCode::HeaderCorrupt, what_, ": the JSON header does not parse at its byte ", position, ": ",
         text::Quoted{cut(why)});
  }

  bool done() const noexcept { return expect_ == Expect::Done; }

 private:
  [[noreturn]] void unexpected(std::string_view found) const {
    static constexpr std::string_view kDue[] = {
        "the header's object", "a tensor name", "a tensor's object", "a tensor field", "a dtype name",
        "a shape array", "a dim", "a data_offsets array", "an offset", "the metadata's object",
        "a metadata key", "a metadata string", "the header's end"};
    std::string where = expect_ == Expect::Top || expect_ == Expect::Key || expect_ == Expect::Done ? std::string()
                        : expect_ >= Expect::Metadata ? std::string(" in __metadata__")
                                                      : " in tensor " + to_text(shown(expect_ == Expect::Tensor ? key_ : tensor_.name));
    fail(ErrorCode::HeaderCorrupt, what_, ": ", found, " where ", kDue[static_cast<int>(expect_)], " is due", where);
  }

  void once(bool& seen, const std::string& field) {
    if (seen) fail(ErrorCode::DuplicateName, what_, ": tensor ", shown(tensor_.name), " has ", field, " twice");
    seen = true;
  }

  void finish_tensor() {
    const auto& name = tensor_.name;
    if (!has_dtype_ || !has_shape_ || !has_offsets_) {
      fail(ErrorCode::HeaderCorrupt, what_, ": tensor ", shown(name), " lacks ",
           !has_dtype_ ? "dtype" : !has_shape_ ? "shape" : "data_offsets");
    }
    if (tensor_.begin > tensor_.end) {
      fail(ErrorCode::OutOfBounds, what_, ": tensor ", shown(name), " begins at ", tensor_.begin, " after its end, ",
           tensor_.end);
    }
    if (tensor_.end > data_bytes_) {
      fail(ErrorCode::OutOfBounds, what_, ": tensor ", shown(name), " ends at byte ", tensor_.end, " of the data, which has ",
           data_bytes_);
    }
    auto bytes = checked_byte_length(tensor_.dtype, tensor_.shape);
    if (!bytes) {
      fail(ErrorCode::BadShape, what_, ": tensor ", shown(name), " of shape ", text::Dims{tensor_.shape},
           " is too large");
    }
    if (*bytes != tensor_.end - tensor_.begin) {
      fail(ErrorCode::BadShape, what_, ": tensor ", shown(name), " is ", tensor_.dtype, " ", text::Dims{tensor_.shape},
           ", ", *bytes, " bytes, but its data_offsets [", tensor_.begin, ", ", tensor_.end, "] hold ",
           tensor_.end - tensor_.begin);
    }
    header_.tensors.push_back(std::move(tensor_));
  }

  const std::string& what_;
  std::uint64_t data_bytes_;
  FileHeader& header_;
  Expect expect_ = Expect::Top;
  std::unordered_set<std::string> keys_;
  std::unordered_set<std::string> metadata_keys_;
  std::string key_;  // the tensor whose object comes next
  FileTensor tensor_;
  std::vector<std::int64_t> dims_;
  int offsets_ = 0;
  bool has_dtype_ = false, has_shape_ = false, has_offsets_ = false;
};

}  // namespace

FileHeader parse_header(std::span<const std::byte> head, std::uint64_t file_bytes, const std::string& what) {
  if (head.size() < 8 || file_bytes < 8) {
    fail(ErrorCode::HeaderCorrupt, what, ": ", std::min<std::uint64_t>(head.size(), file_bytes),
         " bytes, shorter than the 8-byte header length");
  }
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = length << 8 | static_cast<std::uint8_t>(head[i]);  // little endian
  if (length > kMaxHeaderBytes) {
    fail(ErrorCode::HeaderCorrupt, what, ": a JSON header of ", length, " bytes, past the limit of ", kMaxHeaderBytes);
  }
  if (length > file_bytes - 8 || length > head.size() - 8) {
    fail(ErrorCode::HeaderCorrupt, what, ": a JSON header of ", length, " bytes, in a file of ", file_bytes);
  }
  FileHeader header;
  header.data_offset = 8 + length;
  header.data_bytes = file_bytes - header.data_offset;
  HeaderReader reader(what, header.data_bytes, header);
  auto json = reinterpret_cast<const char*>(head.data()) + 8;
  // nlohmann-json ends its input at a NUL byte and skips a byte-order mark: the format allows
  // neither (the safetensors package refuses both), so neither may hide bytes from the parser.
  if (length >= 3 && std::memcmp(json, "\xEF\xBB\xBF", 3) == 0) {
    fail(ErrorCode::HeaderCorrupt, what, ": the JSON header begins with a UTF-8 byte-order mark");
  }
  if (const auto* nul = static_cast<const char*>(std::memchr(json, 0, length))) {
    fail(ErrorCode::HeaderCorrupt, what, ": the JSON header holds a NUL byte at its byte ", nul - json);
  }
  Json::sax_parse(json, json + length, &reader);
  if (!reader.done()) fail(ErrorCode::HeaderCorrupt, what, ": the JSON header ends early");

  // In file order, each tensor begins where the one before it ended, and the last ends where
  // the file does: as the safetensors package reads a file, which refuses an overlap, a gap
  // and bytes past the last tensor. So every byte of the data is one tensor's.
  std::stable_sort(header.tensors.begin(), header.tensors.end(), [](const FileTensor& a, const FileTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const FileTensor* last = nullptr;
  std::uint64_t end = 0;  // last's
  for (const auto& tensor : header.tensors) {
    if (tensor.begin < end) {
      fail(ErrorCode::Overlap, what, ": tensors ", shown(last->name), " [", last->begin, ", ", last->end, ") and ",
           shown(tensor.name), " [", tensor.begin, ", ", tensor.end, ") overlap");
    }
    if (tensor.begin > end) {
      fail(ErrorCode::HeaderCorrupt, what, ": bytes [", end, ", ", tensor.begin, ") of the data, before tensor ",
           shown(tensor.name), ", belong to no tensor");
    }
    last = &tensor;
    end = tensor.end;
  }
  if (end != header.data_bytes) {
    fail(ErrorCode::HeaderCorrupt, what, ": bytes [", end, ", ", header.data_bytes, ") of the data, past the last tensor, "
         "belong to no tensor");
  }
  return header;
}

}  // namespace tensorbucket::safetensors
