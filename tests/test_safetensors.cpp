// safetensors files (safetensors.hpp): the header parser against hostile headers, each refusal
// typed and naming the entry; files published into a channel and saved back, byte for byte.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tensorbucket/tensorbucket.hpp"

using namespace tensorbucket;
namespace st = tensorbucket::safetensors;

namespace {

std::vector<std::byte> file_of(const std::string& json, std::size_t data_bytes, std::byte fill = std::byte{0}) {
  std::vector<std::byte> file(8 + json.size() + data_bytes, fill);
  for (int i = 0; i < 8; ++i) file[i] = static_cast<std::byte>(static_cast<std::uint64_t>(json.size()) >> (8 * i));
  std::memcpy(file.data() + 8, json.data(), json.size());
  return file;
}

st::FileHeader parse(const std::string& json, std::size_t data_bytes) {
  auto file = file_of(json, data_bytes);
  return st::parse_header(file, file.size(), "model.safetensors");
}

// The code and message of parsing `json` before `data_bytes` of data.
std::pair<ErrorCode, std::string> refusal(const std::string& json, std::size_t data_bytes = 64) {
  try {
    parse(json, data_bytes);
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  ADD_FAILURE() << "accepted: " << json;
  return {ErrorCode::InvalidArgument, ""};
}

std::string tensor(const std::string& dtype, const std::string& shape, std::uint64_t begin, std::uint64_t end) {
  return "{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" + std::to_string(begin) + "," +
         std::to_string(end) + "]}";
}

class TempDir {
 public:
  TempDir() : path_(std::filesystem::temp_directory_path() / ("tbst-" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  std::size_t files() const {
    return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator(path_), {}));
  }

 private:
  std::filesystem::path path_;
};

void write_file(const std::string& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::byte> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes(std::istreambuf_iterator<char>(in), {});
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

std::string channel_name(const char* test) { return "tbst-" + std::to_string(::getpid()) + "-" + test; }

}  // namespace

TEST(SafetensorsHeader, ParsesTensorsInFileOrderWithMetadata) {
  auto header = parse("{\"__metadata__\":{\"format\":\"pt\",\"step\":\"12\"},\"b\":" + tensor("BF16", "[3]", 16, 22) +
                          ",\"a\":" + tensor("F32", "[2,2]", 0, 16) + ",\"e\":" + tensor("I64", "[0,5]", 22, 22) +
                          ",\"s\":" + tensor("U8", "[]", 22, 23) + "}    ",
                      23);
  ASSERT_EQ(header.tensors.size(), 4u);
  EXPECT_EQ(header.tensors[0].name, "a");
  EXPECT_EQ(header.tensors[0].dtype, DType::F32);
  EXPECT_EQ(header.tensors[0].shape, (Shape{2, 2}));
  EXPECT_EQ(header.tensors[1].name, "b");
  EXPECT_EQ(header.tensors[1].end, 22u);
  EXPECT_EQ(header.tensors[3].name, "s");
  EXPECT_TRUE(header.tensors[3].shape.empty());
  ASSERT_EQ(header.metadata.size(), 2u);
  EXPECT_EQ(header.metadata[1], (std::pair<std::string, std::string>{"step", "12"}));
  EXPECT_EQ(header.data_bytes, 23u);
}

TEST(SafetensorsHeader, EveryHostileHeaderIsRefusedNamingTheEntry) {
  struct Case {
    std::string json;
    ErrorCode code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"[1,2]", ErrorCode::HeaderCorrupt, "an array where the header's object is due"},
      {"{\"w\":" + tensor("F32", "[2]", 0, 8), ErrorCode::HeaderCorrupt, "does not parse"},
      {"{\"w\":" + tensor("F32", "[2]", 0, 8) + "} trailing", ErrorCode::HeaderCorrupt, "does not parse"},
      {"{\"w\":" + tensor("C64", "[1]", 0, 8) + "}", ErrorCode::UnsupportedDtype, "tensor 'w' has dtype 'C64'"},
      {"{\"w\":" + tensor("F32", "[-2]", 0, 8) + "}", ErrorCode::BadShape, "tensor 'w' has a negative dim"},
      {"{\"w\":" + tensor("F32", "[3]", 0, 8) + "}", ErrorCode::BadShape, "'w' is F32 [3], 12 bytes"},
      {"{\"w\":" + tensor("F32", "[4611686018427387904,8]", 0, 8) + "}", ErrorCode::BadShape, "too large"},
      {"{\"w\":" + tensor("U8", "[2]", 8, 6) + "}", ErrorCode::OutOfBounds, "'w' begins at 8 after its end"},
      {"{\"w\":" + tensor("U8", "[8]", 60, 68) + "}", ErrorCode::OutOfBounds, "'w' ends at byte 68 of the data, which has 64"},
      {"{\"a\":" + tensor("U8", "[8]", 0, 8) + ",\"b\":" + tensor("U8", "[4]", 4, 8) + "}", ErrorCode::Overlap,
       "tensors 'a' [0, 8) and 'b' [4, 8) overlap"},
      {"{\"a\":" + tensor("U8", "[1]", 0, 1) + ",\"a\":" + tensor("U8", "[1]", 1, 2) + "}", ErrorCode::DuplicateName,
       "entry 'a' appears twice"},
      {"{\"\":" + tensor("U8", "[1]", 0, 1) + "}", ErrorCode::BadName, "must be 1 to 1024 bytes"},
      {"{\"" + std::string(1025, 'n') + "\":" + tensor("U8", "[1]", 0, 1) + "}", ErrorCode::BadName, "not 1025"},
      {"{\"w\":{\"dtype\":\"U8\",\"shape\":[1]}}", ErrorCode::HeaderCorrupt, "'w' lacks data_offsets"},
      {"{\"w\":{\"dtype\":\"U8\",\"dtype\":\"U8\"}}", ErrorCode::DuplicateName, "'w' has dtype twice"},
      {"{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"extra\":1}}", ErrorCode::HeaderCorrupt,
       "unknown field 'extra'"},
      {"{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", ErrorCode::HeaderCorrupt, "more than 2"},
      {"{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0.5,1]}}", ErrorCode::HeaderCorrupt, "0.5"},
      {"{\"w\":{\"dtype\":\"U8\",\"shape\":[[1]],\"data_offsets\":[0,1]}}", ErrorCode::HeaderCorrupt,
       "an array where a dim is due in tensor 'w'"},
      {"{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,1]}}", ErrorCode::HeaderCorrupt, "a number where a dtype name"},
      {"{\"w\":{\"dtype\":\"U8\",\"shape\":\"1\",\"data_offsets\":[0,1]}}", ErrorCode::HeaderCorrupt,
       "a string where a shape array is due in tensor 'w'"},
      {"{\"__metadata__\":{\"k\":1}}", ErrorCode::HeaderCorrupt, "a number where a metadata string is due in __metadata__"},
      {"{\"w\":" + std::string(100000, '[') + "}", ErrorCode::HeaderCorrupt, "an array where a tensor's object is due"},
      {"{\"a\\nb\":5}", ErrorCode::HeaderCorrupt, "a number where a tensor's object is due in tensor 'a\\x0ab'"},
      {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", ErrorCode::DuplicateName, "__metadata__ has 'k' twice"},
      {"{\"" + std::string(5 << 20, 'x') + "\":1}", ErrorCode::BadName, "must be 1 to 1024 bytes, not 5242880"},
      {"{\"w\":{\"dtype\":\"" + std::string(5 << 20, 'Q') + "\"}}", ErrorCode::UnsupportedDtype, "has dtype 'QQQ"},
      {"{\"w\":{\"dtype\":\"U8\",\"shape\":[1" + std::string(5 << 20, '0') + ".5]}}", ErrorCode::HeaderCorrupt,
       "number overflow parsing '10000"},
      // The parser's input would end at a NUL, and skip a byte-order mark: refused before it.
      {"{\"w\":" + tensor("U8", "[8]", 0, 8) + "}" + std::string(1, '\0') + "garbage", ErrorCode::HeaderCorrupt,
       "holds a NUL byte at its byte 53"},
      {"{\"w\":" + tensor("U8", "[8]", 0, 8) + "}" + std::string(5, '\0'), ErrorCode::HeaderCorrupt, "NUL byte"},
      {"\xEF\xBB\xBF{\"w\":" + tensor("U8", "[8]", 0, 8) + "}", ErrorCode::HeaderCorrupt, "byte-order mark"},
      // Every byte of the data is one tensor's, as the safetensors package reads a file.
      {"{\"a\":" + tensor("U8", "[8]", 0, 8) + ",\"b\":" + tensor("U8", "[48]", 16, 64) + "}", ErrorCode::HeaderCorrupt,
       "bytes [8, 16) of the data, before tensor 'b', belong to no tensor"},
      {"{\"a\":" + tensor("U8", "[8]", 0, 8) + "}", ErrorCode::HeaderCorrupt,
       "bytes [8, 64) of the data, past the last tensor, belong to no tensor"},
      {"{\"a\":" + tensor("U8", "[64]", 0, 64) + ",\"e\":" + tensor("U8", "[0]", 4, 4) + "}", ErrorCode::Overlap,
       "tensors 'a' [0, 64) and 'e' [4, 4) overlap"},
  };
  for (const auto& c : cases) {
    auto [code, message] = refusal(c.json);
    EXPECT_EQ(code, c.code) << c.json.substr(0, 200) << " -> " << message;
    EXPECT_NE(message.find(c.says), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_LT(message.size(), 1000u) << "a hostile header's bytes are cut in messages";
    EXPECT_EQ(message.rfind("model.safetensors: ", 0), 0u) << message;
  }
}

TEST(SafetensorsHeader, TooManyDimsAndBadLengthsAreRefusedBeforeAnyAllocation) {
  std::string dims = "[1";
  for (int i = 0; i < 64; ++i) dims += ",1";
  EXPECT_EQ(refusal("{\"w\":" + tensor("U8", dims + "]", 0, 1) + "}").first, ErrorCode::BadShape);

  std::vector<std::byte> short_file(5);
  EXPECT_THROW(st::parse_header(short_file, short_file.size()), Error);
  auto file = file_of("{}", 0);
  file[7] = std::byte{1};  // a length of 2^56 + 2
  try {
    st::parse_header(file, file.size());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::HeaderCorrupt);
    EXPECT_NE(std::string(e.what()).find("past the limit"), std::string::npos) << e.what();
  }
  file = file_of("{}", 0);
  file[0] = std::byte{40};  // longer than the file
  EXPECT_THROW(st::parse_header(file, file.size()), Error);
  EXPECT_NO_THROW(st::parse_header(file_of("{}", 0), 10));
}

TEST(SafetensorsFile, PublishedFilesArriveAsOneVerifiedUpdateAndSaveBackByteForByte) {
  TempDir dir;
  // Two files; the data in odd places (tensors out of name order, an empty one).
  std::vector<std::byte> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 7 + 3);
  auto first = file_of("{\"__metadata__\":{\"tensorbucket.version\":\"77\"},\"z\":" + tensor("F32", "[10]", 0, 40) +
                           ",\"a\":" + tensor("U16", "[3,5]", 40, 70) + ",\"e\":" + tensor("F64", "[0]", 70, 70) + "}",
                       0);
  first.insert(first.end(), data.begin(), data.begin() + 40);       // z
  first.insert(first.end(), data.begin() + 48, data.begin() + 78);  // a
  auto second = file_of("{\"big\":" + tensor("U8", "[900]", 0, 900) + ",\"one\":" + tensor("BF16", "[]", 900, 902) + "}", 0);
  second.insert(second.end(), data.begin() + 100, data.begin() + 1000);  // big
  second.insert(second.end(), data.begin(), data.begin() + 2);            // one
  write_file(dir / "first.safetensors", first);
  write_file(dir / "second.safetensors", second);

  auto channel = channel_name("roundtrip");
  auto publisher = Publisher::create(channel, {.slots = 4, .min_consumers = 0});
  auto subscriber = Subscriber::attach(channel, std::chrono::seconds(5), {.whole_updates = true});
  std::vector<std::string> paths = {dir / "first.safetensors", dir / "second.safetensors"};
  auto published = st::publish_files(publisher, paths, {.bucket_bytes = 512});
  EXPECT_EQ(published.version, 77u);  // from the first file's metadata
  EXPECT_EQ(published.buckets, 3u);   // first; big (900 > 512); one
  EXPECT_EQ(published.published, 3u);

  auto update = subscriber.next_update(std::chrono::seconds(5));
  ASSERT_TRUE(update);
  ASSERT_EQ(update->buckets().size(), 3u);
  EXPECT_EQ(update->version(), 77u);
  std::vector<const BucketView*> views;
  for (const auto& bucket : update->buckets()) views.push_back(&bucket.view());
  auto z = views[0]->find("z");
  ASSERT_TRUE(z);
  EXPECT_EQ(std::memcmp(z->bytes.data(), data.data(), 40), 0);
  auto a = views[0]->find("a");
  ASSERT_TRUE(a);
  EXPECT_EQ(std::memcmp(a->bytes.data(), data.data() + 48, 30), 0);
  EXPECT_EQ(views[1]->size(), 1u);
  EXPECT_EQ(std::memcmp(views[1]->find("big")->bytes.data(), second.data() + second.size() - 902, 900), 0);

  st::save(views, dir / "saved.safetensors");
  auto saved = st::read_header(dir / "saved.safetensors");
  ASSERT_EQ(saved.tensors.size(), 5u);
  auto bytes = read_file(dir / "saved.safetensors");
  std::uint64_t at = 0;
  for (const auto& tensor : saved.tensors) {  // contiguous, as the safetensors package requires
    EXPECT_EQ(tensor.begin, at) << tensor.name;
    at = tensor.end;
    auto view = views[0]->find(tensor.name) ? views[0]->find(tensor.name)
                : views[1]->find(tensor.name) ? views[1]->find(tensor.name)
                                              : views[2]->find(tensor.name);
    ASSERT_TRUE(view) << tensor.name;
    EXPECT_EQ(view->dtype, tensor.dtype);
    EXPECT_TRUE(std::equal(view->shape.begin(), view->shape.end(), tensor.shape.begin(), tensor.shape.end()));
    EXPECT_EQ(std::memcmp(bytes.data() + saved.data_offset + tensor.begin, view->bytes.data(), view->bytes.size()), 0);
  }
  EXPECT_EQ(at, saved.data_bytes);
  EXPECT_EQ(saved.data_offset % 8, 0u);
  EXPECT_EQ(saved.metadata, (std::vector<std::pair<std::string, std::string>>{{"tensorbucket.version", "77"},
                                                                              {"tensorbucket.bucket_count", "3"}}));
  EXPECT_EQ(dir.files(), 3u);  // no temporary left
}

TEST(SafetensorsFile, ABadFileAmongSeveralPublishesNothing) {
  TempDir dir;
  write_file(dir / "good.safetensors", file_of("{\"w\":" + tensor("U8", "[4]", 0, 4) + "}", 4));
  write_file(dir / "bad.safetensors", file_of("{\"w\":" + tensor("U8", "[4]", 0, 8) + "}", 8));
  write_file(dir / "dup.safetensors", file_of("{\"w\":" + tensor("U8", "[4]", 0, 4) + "}", 4));
  auto channel = channel_name("bad");
  auto publisher = Publisher::create(channel, {.slots = 2, .min_consumers = 0});
  std::vector<std::string> bad = {dir / "good.safetensors", dir / "bad.safetensors"};
  try {
    st::publish_files(publisher, bad);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::BadShape);
    EXPECT_NE(std::string(e.what()).find("bad.safetensors': tensor 'w'"), std::string::npos) << e.what();
  }
  std::vector<std::string> twice = {dir / "good.safetensors", dir / "dup.safetensors"};
  try {
    st::publish_files(publisher, twice);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::DuplicateName);
    EXPECT_NE(std::string(e.what()).find("dup.safetensors': tensor 'w' is in an earlier file too"), std::string::npos);
  }
  // Paths are quoted, control characters escaped: an error stays one line.
  std::vector<std::string> missing = {dir / "absent\n.safetensors"};
  try {
    st::publish_files(publisher, missing);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::SystemError);
    std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_NE(what.find("cannot open '" + (dir / "absent\\x0a.safetensors") + "': No such file"),
              std::string::npos)
        << what;
  }
  EXPECT_EQ(publisher.published(), 0u);
}

TEST(SafetensorsFile, ATruncatedFileIsRefusedWholeAndASaveThatFailsLeavesNothing) {
  TempDir dir;
  auto file = file_of("{\"w\":" + tensor("U8", "[4096]", 0, 4096) + "}", 4096);
  write_file(dir / "w.safetensors", file);
  auto header = st::read_header(dir / "w.safetensors");
  EXPECT_EQ(header.tensors.size(), 1u);
  // Truncated after a look: publish_files reads the header again and refuses it whole.
  std::filesystem::resize_file(dir / "w.safetensors", file.size() - 100);
  auto channel = channel_name("shrank");
  auto publisher = Publisher::create(channel, {.slots = 2, .min_consumers = 0});
  std::vector<std::string> paths = {dir / "w.safetensors"};
  try {
    st::publish_files(publisher, paths);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::OutOfBounds) << e.what();
  }
  EXPECT_EQ(publisher.published(), 0u);

  BucketBuilder builder;
  std::vector<std::byte> bytes(16);
  builder.add("ok", DType::U8, {16}, bytes.data());
  builder.add(std::string("\xff\xfe", 2), DType::U8, {16}, bytes.data());  // not UTF-8
  auto packed = builder.pack();
  auto view = BucketView::open(packed.frame, packed.payload.span());
  const BucketView* one[] = {&view};
  try {
    st::save(one, dir / "out.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::BadName);
  }
  EXPECT_THROW(st::save(one, dir / "no-such-folder/out.safetensors"), Error);
  BucketBuilder reserved;
  reserved.add("__metadata__", DType::U8, {16}, bytes.data());
  auto packed_reserved = reserved.pack();
  auto reserved_view = BucketView::open(packed_reserved.frame, packed_reserved.payload.span());
  const BucketView* named_metadata[] = {&reserved_view};
  try {
    st::save(named_metadata, dir / "out.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::BadName);
  }
  EXPECT_EQ(dir.files(), 1u);  // only w.safetensors
}

// Weights kept private stay private: a save takes the mode of the file it replaces, and a new
// file what the umask leaves of 0666, as open() makes one; a name as long as the filesystem
// takes is saved too (the temporary name beside it stays within NAME_MAX).
TEST(SafetensorsFile, ASaveKeepsTheModeItReplacesOrHonoursTheUmaskWhateverTheNamesLength) {
  TempDir dir;
  BucketBuilder builder;
  std::vector<std::byte> bytes(16);
  builder.add("w", DType::U8, {16}, bytes.data());
  auto packed = builder.pack();
  auto view = BucketView::open(packed.frame, packed.payload.span());
  const BucketView* one[] = {&view};
  auto mode_of = [](const std::filesystem::path& path) {
    struct stat status {};
    EXPECT_EQ(::stat(path.c_str(), &status), 0);
    return status.st_mode & 07777;
  };
  auto mask = ::umask(077);
  st::save(one, dir / "private.safetensors");
  ::umask(022);
  st::save(one, dir / "shared.safetensors");
  EXPECT_EQ(mode_of(dir / "private.safetensors"), 0600u);
  EXPECT_EQ(mode_of(dir / "shared.safetensors"), 0644u);
  std::filesystem::permissions(dir / "shared.safetensors", std::filesystem::perms::owner_read |
                                                               std::filesystem::perms::owner_write);
  st::save(one, dir / "shared.safetensors");  // replaced: its 0600 kept, not the umask's 0644
  EXPECT_EQ(mode_of(dir / "shared.safetensors"), 0600u);
  ::umask(mask);
  auto longest = dir / (std::string(255 - 12, 'w') + ".safetensors");  // NAME_MAX, 255 bytes
  st::save(one, longest);
  EXPECT_EQ(st::read_header(longest).tensors.size(), 1u);
  EXPECT_EQ(dir.files(), 3u);  // and no temporary file left
}

// save() replaces a file whole by renaming one over it: a FIFO, a device or a folder would be
// replaced by a private copy of the weights, and a symbolic link (/dev/stdout is one) by the
// file; refused, all of them, and a link is not followed either. A path with a NUL byte, which
// the system would cut short there, is refused too.
TEST(SafetensorsFile, ASaveRefusesWhatIsNotARegularFile) {
  TempDir dir;
  BucketBuilder builder;
  std::vector<std::byte> bytes(16, std::byte{3});
  builder.add("w", DType::U8, {16}, bytes.data());
  auto packed = builder.pack();
  auto view = BucketView::open(packed.frame, packed.payload.span());
  const BucketView* one[] = {&view};
  write_file(dir / "target.safetensors", file_of("{}", 0));
  std::filesystem::create_symlink("target.safetensors", dir / "link.safetensors");
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  std::filesystem::create_symlink("/dev/null", dir / "null");
  std::filesystem::create_directory(dir / "folder");
  for (const char* name : {"link.safetensors", "fifo", "null", "folder"}) {
    try {
      st::save(one, dir / name);
      FAIL() << name;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("cannot save to"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "link.safetensors"));
  EXPECT_EQ(st::read_header(dir / "target.safetensors").tensors.size(), 0u);  // as it was
  struct stat status {};
  ASSERT_EQ(::lstat((dir / "fifo").c_str(), &status), 0);
  EXPECT_TRUE(S_ISFIFO(status.st_mode));
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "null"));
  EXPECT_TRUE(std::filesystem::is_directory(dir / "folder"));

  auto cut = (dir / "target.safetensors") + std::string(1, '\0') + ".bak";
  for (auto attempt : std::initializer_list<std::function<void()>>{
           [&] { st::save(one, cut); }, [&] { st::read_header(cut); },
           [&] {
             auto publisher = Publisher::create(channel_name("nul"), {.min_consumers = 0});
             std::vector<std::string> paths = {cut};
             st::publish_files(publisher, paths, {});
           }}) {
    try {
      attempt();
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("NUL"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(dir.files(), 5u);  // and no temporary file left
}

// A rewrite in place that keeps the size and the modification time still moves ctime; a hard
// link added with it used to excuse that (only a link dropped, by a rename over the name, may).
TEST(SafetensorsFile, AFileRewrittenInPlaceAsALinkIsAddedIsNotPublished) {
  TempDir dir;
  auto path = dir / "w.safetensors";
  write_file(path, file_of("{\"a\":" + tensor("U8", "[64]", 0, 64) + "}", 64));
  auto publisher = Publisher::create(channel_name("linked"), {.slots = 2, .min_consumers = 0});
  std::vector<std::string> paths = {path};
  bool rewritten = false;
  auto rewrite = [&] {
    if (!rewritten) {
      // Past the clock tick the file was written in: a kernel without fine-grained file
      // times (before 6.13) dates both in the same 4-10 ms.
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      struct stat before {};
      EXPECT_EQ(::stat(path.c_str(), &before), 0);
      int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      std::byte seven{7};
      EXPECT_EQ(::pwrite(fd, &seven, 1, static_cast<off_t>(before.st_size - 1)), 1);
      timespec times[2] = {before.st_atim, before.st_mtim};
      EXPECT_EQ(::futimens(fd, times), 0);  // rsync --inplace -t: the time put back
      ::close(fd);
      std::filesystem::create_hard_link(path, dir / "kept.safetensors");
      rewritten = true;
    }
    return false;
  };
  try {
    st::publish_files(publisher, paths, {.interrupted = rewrite});
    FAIL() << "published a file rewritten meanwhile";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::SystemError);
    EXPECT_NE(std::string(e.what()).find("changed while it was read"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(rewritten);
  EXPECT_EQ(publisher.published(), 0u);
}

TEST(SafetensorsFile, AFileOnTmpfsWrittenThroughAMappingWhileItIsReadIsNotPublished) {
  // /dev/shm is tmpfs, which dates no write made through a shared mapping: the size and times
  // stay as they were, and only the bytes tell.
  auto path = "/dev/shm/tbst-" + std::to_string(::getpid()) + "-mapped.safetensors";
  struct Removed {
    std::string path;
    ~Removed() { std::filesystem::remove(path); }
  } removed{path};
  write_file(path, file_of("{\"a\":" + tensor("U8", "[64]", 0, 64) + ",\"b\":" + tensor("U8", "[64]", 64, 128) + "}", 128));
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  auto size = std::filesystem::file_size(path);
  auto* mapped = static_cast<std::byte*>(::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  ASSERT_NE(mapped, MAP_FAILED);
  // A first write makes the mapping writable (a fault, which dates the file); the writes after
  // it fault no more, and date nothing.
  mapped[size - 1] = std::byte{0};
  auto publisher = Publisher::create(channel_name("mapped"), {.slots = 2, .min_consumers = 0});
  std::vector<std::string> paths = {path};
  struct stat before {};
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  bool written = false;
  // Asked after each read, the first time after tensor "a": its last byte changes in the file.
  auto write = [&] {
    if (!written) mapped[size - 128 + 63] = std::byte{0x5a};
    written = true;
    return false;
  };
  try {
    st::publish_files(publisher, paths, {.interrupted = write});
    FAIL() << "published a file written meanwhile";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::SystemError);
    EXPECT_NE(std::string(e.what()).find("changed while it was read (tensor 'a'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(publisher.published(), 0u);
  struct stat after {};
  ASSERT_EQ(::stat(path.c_str(), &after), 0);
  EXPECT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);  // what the size and time test saw: nothing
  EXPECT_EQ(after.st_mtim.tv_sec, before.st_mtim.tv_sec);

  // Unchanged, it is published.
  EXPECT_EQ(st::publish_files(publisher, paths, {}).published, 1u);

  // Its header changed so (a dtype, its tensors' bytes as they were): read again, and the
  // bucket fails. Its bytes alone read the same twice.
  auto header = std::string_view(reinterpret_cast<const char*>(mapped) + 8, size - 8 - 128);
  auto dtype = header.find("\"U8\"");
  ASSERT_NE(dtype, std::string_view::npos);
  bool retyped = false;
  auto retype = [&] {
    if (!retyped) mapped[8 + dtype + 1] = std::byte{'I'};  // "I8"
    retyped = true;
    return false;
  };
  try {
    st::publish_files(publisher, paths, {.interrupted = retype});
    FAIL() << "published a file whose header changed meanwhile";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::SystemError);
    EXPECT_NE(std::string(e.what()).find("changed while it was read (its header"), std::string::npos) << e.what();
  }
  EXPECT_EQ(publisher.published(), 1u);
  ::munmap(mapped, size);
}

TEST(SafetensorsFile, AFileRewrittenWhileItIsReadIsNotPublished) {
  TempDir dir;
  auto path = dir / "w.safetensors";
  write_file(path, file_of("{\"a\":" + tensor("U8", "[64]", 0, 64) + ",\"b\":" + tensor("U8", "[64]", 64, 128) + "}", 128));
  auto channel = channel_name("rewritten");
  auto publisher = Publisher::create(channel, {.slots = 2, .min_consumers = 0});
  std::vector<std::string> paths = {path};
  bool rewritten = false;
  // Asked after each read: the trainer saves its next checkpoint over the file meanwhile.
  auto rewrite = [&] {
    if (!rewritten) {
      write_file(path, file_of("{\"a\":" + tensor("U8", "[64]", 0, 64) + ",\"b\":" + tensor("U8", "[64]", 64, 128) + "}", 128,
                               std::byte{7}));
      std::filesystem::last_write_time(path, std::filesystem::file_time_type::clock::now() + std::chrono::hours(1));
      rewritten = true;
    }
    return false;
  };
  try {
    st::publish_files(publisher, paths, {.interrupted = rewrite});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::SystemError);
    EXPECT_NE(std::string(e.what()).find("changed while it was read"), std::string::npos) << e.what();
  }
  EXPECT_EQ(publisher.published(), 0u);

  // Its name replaced meanwhile (a rename over it, as a trainer saves a checkpoint whole): the
  // file read never changed, and is published.
  write_file(path, file_of("{\"a\":" + tensor("U8", "[64]", 0, 64) + ",\"b\":" + tensor("U8", "[64]", 64, 128) + "}", 128));
  bool replaced = false;
  auto replace = [&] {
    if (!replaced) {
      write_file(dir / "next.safetensors", file_of("{\"c\":" + tensor("U8", "[8]", 0, 8) + "}", 8));
      std::filesystem::rename(dir / "next.safetensors", path);
      replaced = true;
    }
    return false;
  };
  EXPECT_EQ(st::publish_files(publisher, paths, {.interrupted = replace}).published, 1u);
  ASSERT_TRUE(replaced);
  EXPECT_EQ(publisher.published(), 1u);

  // Interrupted between two reads: nothing published, no error.
  auto result = st::publish_files(publisher, paths, {.interrupted = [] { return true; }});
  EXPECT_EQ(result.buckets, 1u);
  EXPECT_EQ(result.published, 0u);
  EXPECT_EQ(publisher.published(), 1u);
}
