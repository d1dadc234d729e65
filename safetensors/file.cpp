// safetensors files read into slots and written from buckets.
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "base/text.hpp"
#include "tensorbucket/header.hpp"
#include "tensorbucket/safetensors.hpp"

namespace tensorbucket::safetensors {
namespace {

using text::fail;
using text::Quoted;

// How a message names a file: quoted, so that a newline in it cannot break the line.
std::string shown(const std::string& path) { return text::message(Quoted{path}); }

// `named`: the file as shown().
[[noreturn]] void fail_errno(const std::string& doing, const std::string& named) {
  fail(ErrorCode::SystemError, doing, " ", named, ": ", std::strerror(errno));
}

// Calls make(name) with hidden names beside `path` (".name.tmp-xxxxxxxx", within NAME_MAX
// however long path's own name is) until it returns true; one that exists is tried again
// under another name (EEXIST), any other failure is SystemError.
template <class Make>
void hidden_beside(const std::string& path, Make&& make) {
  auto where = std::filesystem::path(path);
  auto name = where.filename().string().substr(0, 200);
  std::random_device random;
  for (int attempt = 0; attempt < 100; ++attempt) {
    char suffix[16];
    std::snprintf(suffix, sizeof suffix, ".tmp-%08x", static_cast<unsigned>(random()));
    if (make((where.parent_path() / ("." + name + suffix)).string())) return;
    if (errno != EEXIST) fail_errno("cannot create a file beside", shown(path));
  }
  fail_errno("cannot create a file beside", shown(path));
}

// A file descriptor, closed when done.
class File {
 public:
  // For reading: O_NONBLOCK, so that a FIFO named by mistake fails at size() instead of
  // waiting for a writer (a regular file's reads ignore it).
  explicit File(const std::string& path)
      : path_(path), shown_(shown(path)), fd_(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)) {
    if (fd_ < 0) fail_errno("cannot open", shown_);
  }
  // A new file in `path`'s folder, for writing, made as open() makes a file (0666 less the
  // umask), to be put in place over `path` whole (place()). Unnamed until then where the
  // filesystem can (O_TMPFILE), so that a process killed while writing leaves nothing behind;
  // elsewhere under a hidden name beside it, removed on an error (discard()) but not by a kill.
  struct Beside {};
  File(const std::string& path, Beside) : fd_(-1) {
    auto folder = std::filesystem::path(path).parent_path();
    // Linked into place through /proc (linkat() of the descriptor itself needs a privilege).
    if (::access("/proc/self/fd", X_OK) == 0) {
      fd_ = ::open(folder.empty() ? "." : folder.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0666);
      shown_ = "an unnamed file beside " + shown(path);
    }
    if (fd_ < 0) {
      named_ = true;
      hidden_beside(path, [&](const std::string& hidden) {
        path_ = hidden;
        shown_ = shown(hidden);
        fd_ = ::open(hidden.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        return fd_ >= 0;
      });
    }
    // The mode open() gave it, kept for the end; private until then (it is empty so far).
    created_mode_ = status().st_mode & 07777;
    if (::fchmod(fd_, 0600) != 0) fail_errno("cannot set the mode of", shown_);
  }
  mode_t created_mode() const noexcept { return created_mode_; }

  // Renames the file over `path`; an unnamed one is linked under a hidden name first, which is
  // there for a moment only.
  void place(const std::string& path) {
    if (!named_) {
      auto descriptor = "/proc/self/fd/" + std::to_string(fd_);
      hidden_beside(path, [&](const std::string& hidden) {
        if (::linkat(AT_FDCWD, descriptor.c_str(), AT_FDCWD, hidden.c_str(), AT_SYMLINK_FOLLOW) != 0) return false;
        path_ = hidden;
        shown_ = shown(hidden);
        named_ = true;
        return true;
      });
    }
    if (::rename(path_.c_str(), path.c_str()) != 0) fail_errno("cannot rename " + shown_ + " to", shown(path));
    named_ = false;  // it is `path` now
  }
  // Removes the name a file for writing still has (see Beside).
  void discard() noexcept {
    if (named_) ::unlink(path_.c_str());
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }

  std::uint64_t size() const { return static_cast<std::uint64_t>(status().st_size); }

  // What identifies this version of the file: a file rewritten in place since (a trainer
  // saving its next checkpoint over it) differs in size, mtime or ctime (which a write moves
  // too, and so does a `touch` that sets mtime back). A rename over its name, the usual way to
  // save a file whole, moves the old file's ctime too, but drops its link count and leaves its
  // bytes as they were: that is no change of the file read. A link added moves ctime too, and
  // is no excuse: a rewrite may have come with it.
  struct Version {
    std::uint64_t size;
    timespec modified, changed;
    nlink_t links;
    bool unchanged_since(const Version& before) const {
      auto same = [](timespec a, timespec b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; };
      return size == before.size && same(modified, before.modified) &&
             (same(changed, before.changed) || links < before.links);
    }
  };
  Version version() const {
    auto info = status();
    return {static_cast<std::uint64_t>(info.st_size), info.st_mtim, info.st_ctim, info.st_nlink};
  }

  // Whether writes through a shared mapping leave the file's times as they were: tmpfs (and
  // so /dev/shm) dates none of them, so version() cannot see them there.
  bool undated_writes() const {
    struct statfs info {};
    return ::fstatfs(fd_, &info) == 0 && info.f_type == TMPFS_MAGIC;
  }

  // How messages name it (shown()).
  const std::string& shown_as() const noexcept { return shown_; }
  int descriptor() const noexcept { return fd_; }

  // Exactly `into.size()` bytes from `offset`; SystemError at an early end (the file shrank).
  void read_at(std::span<std::byte> into, std::uint64_t offset) const {
    while (!into.empty()) {
      auto got = ::pread(fd_, into.data(), into.size(), static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail_errno("cannot read", shown_);
      if (got == 0) fail(ErrorCode::SystemError, shown_, " ended at byte ", offset, ": it changed while it was read");
      into = into.subspan(static_cast<std::size_t>(got));
      offset += static_cast<std::uint64_t>(got);
    }
  }

  void write_all(std::span<const std::byte> bytes) const {
    while (!bytes.empty()) {
      auto put = ::write(fd_, bytes.data(), bytes.size());
      if (put < 0 && errno == EINTR) continue;
      if (put < 0) fail_errno("cannot write", shown_);
      bytes = bytes.subspan(static_cast<std::size_t>(put));
    }
  }

  struct stat status() const {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) fail_errno("cannot stat", shown_);
    if (!S_ISREG(info.st_mode)) fail(ErrorCode::SystemError, shown_, " is not a regular file");
    return info;
  }

  void sync() const {
    if (::fsync(fd_) != 0) fail_errno("cannot sync", shown_);
  }

 private:
  std::string path_;
  std::string shown_;
  bool named_ = false;  // a file for writing under a hidden name of ours (see Beside)
  int fd_;
  mode_t created_mode_ = 0;
};

// The header's bytes, its 8-byte length first: what the length says when it is within the
// limits and the file, else those 8 alone (parse_header() refuses them, before anything is
// allocated).
std::vector<std::byte> header_bytes(const File& file, std::uint64_t file_bytes) {
  std::vector<std::byte> head(std::min<std::uint64_t>(8, file_bytes));
  file.read_at(head, 0);
  if (file_bytes >= 8) {
    std::uint64_t length = 0;
    for (int i = 7; i >= 0; --i) length = length << 8 | static_cast<std::uint8_t>(head[i]);
    if (length <= kMaxHeaderBytes && length <= file_bytes - 8) {
      head.resize(8 + length);
      file.read_at(std::span(head).subspan(8), 8);
    }
  }
  return head;
}

FileHeader read_header(const File& file, const std::string& path, std::uint64_t* hash = nullptr) {
  auto file_bytes = file.size();
  auto head = header_bytes(file, file_bytes);
  if (hash != nullptr) *hash = xxh3(head);
  return parse_header(head, file_bytes, shown(path));
}

// InvalidArgument for a path the system would cut short at its NUL byte (Python passes one on).
void check_path(const std::string& path) {
  if (path.find('\0') != std::string::npos) {
    fail(ErrorCode::InvalidArgument, "the path ", Quoted{path}, " holds a NUL byte");
  }
}

// One bucket of a file: the range of its tensors (file order) in the header.
struct Part {
  std::size_t file;
  std::size_t first, last;  // [first, last)
};

std::uint64_t aligned(std::uint64_t bytes) { return (bytes + kPayloadAlignment - 1) / kPayloadAlignment * kPayloadAlignment; }

// The buckets of one file: its tensors, in order, cut where a bucket would pass `budget`.
void split(std::size_t file, const FileHeader& header, std::uint64_t budget, std::vector<Part>& parts) {
  Part part{file, 0, 0};
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < header.tensors.size(); ++i) {
    auto size = aligned(header.tensors[i].end - header.tensors[i].begin);
    if (budget != 0 && part.last > part.first && bytes + size > budget) {
      parts.push_back(part);
      part = {file, i, i};
      bytes = 0;
    }
    part.last = i + 1;
    bytes += size;
  }
  parts.push_back(part);  // a file with no tensors is one empty bucket
}

// The "tensorbucket.version" save() wrote; HeaderCorrupt for one that is not a whole number.
std::optional<std::uint64_t> version_in(const FileHeader& header, const std::string& path) {
  for (const auto& [key, value] : header.metadata) {
    if (key != "tensorbucket.version") continue;
    std::uint64_t version = 0;
    auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), version);
    if (error != std::errc() || end != value.data() + value.size() || value.empty()) {
      fail(ErrorCode::HeaderCorrupt, Quoted{path}, ": __metadata__ tensorbucket.version is ", Quoted{value.substr(0, 64)},
           ", not a whole number below 2^64");
    }
    return version;
  }
  return std::nullopt;
}

// A name as JSON: BadName for bytes that are not UTF-8.
std::string json_string(std::string_view name) {
  try {
    return nlohmann::json(name).dump();
  } catch (const nlohmann::json::type_error&) {
    fail(ErrorCode::BadName, "tensor ", Quoted{name}, " is not UTF-8, which a safetensors header (JSON) needs");
  }
}

// A slot for `layout`, waiting at most options.timeout unless options.interrupted.
std::optional<Reservation> reserve(Publisher& publisher, const BucketBuilder& layout, const PublishFileOptions& options) {
  return publisher.reserve(layout, Deadline::after(options.timeout).unless(options.interrupted));
}

// `path`, where save() may put a file: a regular file (replaced, its mode kept) or nothing.
// InvalidArgument for anything else. Renaming a file over a FIFO, a device or a folder would
// replace that with a private copy of the weights; over a symbolic link (/dev/stdout is one),
// the link itself; and following a link would let whoever can write the folder (/tmp) choose
// which file of the caller's is replaced.
void check_save_target(const std::string& path) {
  struct stat named {};
  if (::lstat(path.c_str(), &named) != 0) {
    if (errno == ENOENT) return;  // a new file (a missing folder fails as it is made)
    fail_errno("cannot stat", shown(path));
  }
  if (S_ISREG(named.st_mode)) return;
  const char* kind = S_ISLNK(named.st_mode)                             ? "a symbolic link (name the file it leads to)"
                     : S_ISDIR(named.st_mode)                           ? "a folder"
                     : S_ISFIFO(named.st_mode)                          ? "a FIFO"
                     : S_ISCHR(named.st_mode) || S_ISBLK(named.st_mode) ? "a device"
                     : S_ISSOCK(named.st_mode)                          ? "a socket"
                                                                        : "not a regular file";
  fail(ErrorCode::InvalidArgument, "cannot save to ", Quoted{path}, ": it is ", kind,
       "; save writes a safetensors file whole, renamed into place");
}

}  // namespace

FileHeader read_header(const std::string& path) {
  check_path(path);
  File file(path);
  return read_header(file, path);
}

FilePublish publish_files(Publisher& publisher, std::span<const std::string> paths, const PublishFileOptions& options) {
  if (paths.empty()) throw Error(ErrorCode::InvalidArgument, "publish_files needs at least one file");
  // Every header first: a bad file publishes nothing.
  for (const auto& path : paths) check_path(path);
  std::vector<std::unique_ptr<File>> files;
  std::vector<File::Version> versions;  // as each header was read
  std::vector<std::uint64_t> header_hashes;  // of each header's bytes
  std::vector<FileHeader> headers;
  std::vector<Part> parts;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    files.push_back(std::make_unique<File>(paths[i]));
    versions.push_back(files.back()->version());
    headers.push_back(read_header(*files.back(), paths[i], &header_hashes.emplace_back()));
    split(i, headers.back(), options.bucket_bytes, parts);
  }
  if (parts.size() > UINT32_MAX) throw Error(ErrorCode::InvalidArgument, "more buckets than an update can count");
  FilePublish result{.version = options.version ? *options.version : version_in(headers.front(), paths.front()).value_or(0),
                     .buckets = static_cast<std::uint32_t>(parts.size())};
  // Every bucket's layout, checked by the builder (names it refuses, names in two files)
  // before the first is published.
  std::vector<BucketBuilder> layouts(parts.size());
  std::unordered_set<std::string_view> names;
  for (std::uint32_t b = 0; b < result.buckets; ++b) {
    const auto& part = parts[b];
    auto& layout = layouts[b];
    layout.version(result.version).bucket(b, result.buckets);
    for (auto i = part.first; i < part.last; ++i) {
      const auto& tensor = headers[part.file].tensors[i];
      if (!names.insert(tensor.name).second) {
        fail(ErrorCode::DuplicateName, Quoted{paths[part.file]}, ": tensor ", Quoted{tensor.name}, " is in an earlier file too");
      }
      layout.declare(tensor.name, tensor.dtype, tensor.shape);
    }
  }

  auto interrupted = [&] { return options.interrupted && options.interrupted(); };
  constexpr std::uint64_t kReadPiece = 64 << 20;  // between two looks at `interrupted`
  std::vector<std::byte> staging;  // a device channel's: one tensor at a time
  bool on_host = publisher.location().on_host();
  // A file whose writes through a mapping version() cannot see is checked by its bytes: each
  // piece hashed as it lands, then read and hashed again once the bucket is read, and its
  // header read again. A piece or header that changed in between fails the bucket. Pieces of
  // 1 MiB there, so that both hashes read from the cache (and the second read is from
  // memory: tmpfs is memory). A tensor's bytes changed so before its bucket's first read are
  // not seen (docs/safetensors.md).
  constexpr std::uint64_t kHashedPiece = 1 << 20;
  std::vector<bool> reread(files.size());
  for (std::size_t i = 0; i < files.size(); ++i) reread[i] = files[i]->undated_writes();
  std::vector<std::uint64_t> piece_hashes;
  std::vector<std::byte> scratch;
  for (std::uint32_t b = 0; b < result.buckets; ++b) {
    const auto& part = parts[b];
    const auto& file = *files[part.file];
    const auto& header = headers[part.file];
    auto reservation = reserve(publisher, layouts[b], options);
    if (!reservation) return result;  // nothing reserved: the update stays unfinished
    auto spans = reservation->entry_spans();
    piece_hashes.clear();
    auto piece_bytes = reread[part.file] ? kHashedPiece : kReadPiece;
    for (auto i = part.first; i < part.last; ++i) {
      const auto& tensor = header.tensors[i];
      auto span = spans[i - part.first];
      auto into = span;
      if (!on_host) {
        staging.resize(span.size());
        into = staging;
      }
      // Straight into the slot (or the staging buffer), in pieces; an interrupted bucket is
      // abandoned with its reservation, never committed.
      for (std::uint64_t at = 0; at < into.size(); at += piece_bytes) {
        auto piece = into.subspan(at, std::min<std::uint64_t>(piece_bytes, into.size() - at));
        file.read_at(piece, header.data_offset + tensor.begin + at);
        if (reread[part.file]) piece_hashes.push_back(xxh3(piece));
        if (interrupted()) return result;
      }
      if (!on_host && !span.empty()) reservation->write(i - part.first, staging.data());  // pageable: taken on return
    }
    if (!file.version().unchanged_since(versions[part.file])) {
      fail(ErrorCode::SystemError, file.shown_as(), " changed while it was read (size or modification time); "
                                                "nothing more of this update was published");
    }
    if (reread[part.file]) {
      if (xxh3(header_bytes(file, file.size())) != header_hashes[part.file]) {
        fail(ErrorCode::SystemError, file.shown_as(),
             " changed while it was read (its header, written through a mapping, which tmpfs does not date); "
             "nothing more of this update was published");
      }
      auto hash = piece_hashes.begin();
      for (auto i = part.first; i < part.last; ++i) {
        const auto& tensor = header.tensors[i];
        auto size = tensor.end - tensor.begin;
        for (std::uint64_t at = 0; at < size; at += piece_bytes) {
          scratch.resize(std::min<std::uint64_t>(piece_bytes, size - at));
          file.read_at(scratch, header.data_offset + tensor.begin + at);
          if (xxh3(scratch) != *hash++) {
            fail(ErrorCode::SystemError, file.shown_as(), " changed while it was read (tensor ", Quoted{tensor.name},
                 ", written through a mapping, which tmpfs does not date); nothing more of this update was published");
          }
        }
      }
    }
    reservation->commit();
    ++result.published;
    for (auto i = part.first; i < part.last; ++i) result.bytes += header.tensors[i].end - header.tensors[i].begin;
    if (b + 1 < result.buckets && interrupted()) return result;
  }
  return result;
}

void check_save_folder(const std::string& path) {
  check_path(path);
  auto folder = std::filesystem::path(path).parent_path();
  if (folder.empty()) folder = ".";
  struct stat info {};
  if (::stat(folder.c_str(), &info) != 0) fail_errno("cannot save in the folder", shown(folder.string()));
  if (!S_ISDIR(info.st_mode)) fail(ErrorCode::SystemError, "cannot save in ", Quoted{folder.string()}, ": not a folder");
  // As the write will be made: with the effective ids and their capabilities (access() asks
  // for the real ids').
  if (::faccessat(AT_FDCWD, folder.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
    fail_errno("cannot save in the folder", shown(folder.string()));
  }
}

void check_save_path(const std::string& path) {
  check_save_folder(path);
  check_save_target(path);
}

void save(std::span<const BucketView* const> buckets, const std::string& path) {
  if (buckets.empty()) throw Error(ErrorCode::InvalidArgument, "save needs at least one bucket");
  check_path(path);
  check_save_target(path);
  const auto& first = *buckets.front();
  for (const auto* bucket : buckets) {
    if (!bucket->location().on_host()) {
      throw Error(ErrorCode::InvalidArgument, "save reads payloads on the host: copy a device bucket's first");
    }
    if (bucket->version() != first.version()) {
      fail(ErrorCode::InvalidArgument, "save writes one update: buckets of versions ", first.version(), " and ",
           bucket->version());
    }
  }
  // The header: every tensor contiguous, in the buckets' order, as the safetensors package
  // requires; padded with spaces to a multiple of 8 bytes, as it writes them.
  std::string json = "{\"__metadata__\":{\"tensorbucket.version\":\"" + std::to_string(first.version()) +
                     "\",\"tensorbucket.bucket_count\":\"" + std::to_string(first.bucket_count()) + "\"";
  if (buckets.size() == 1 && first.bucket_count() > 1) {
    json += ",\"tensorbucket.bucket_index\":\"" + std::to_string(first.bucket_index()) + "\"";
  }
  json += "}";
  std::unordered_set<std::string_view> names;
  std::uint64_t offset = 0;
  for (const auto* bucket : buckets) {
    for (std::size_t i = 0; i < bucket->size(); ++i) {
      auto tensor = (*bucket)[i];
      if (tensor.name == "__metadata__") {
        fail(ErrorCode::BadName, "tensor '__metadata__' cannot be saved: safetensors reserves the name");
      }
      if (!names.insert(tensor.name).second) {
        fail(ErrorCode::DuplicateName, "tensor ", Quoted{tensor.name}, " is in two of the buckets saved");
      }
      json += "," + json_string(tensor.name) + ":{\"dtype\":\"" + std::string(dtype_name(tensor.dtype)) + "\",\"shape\":[";
      for (std::size_t d = 0; d < tensor.shape.size(); ++d) json += (d ? "," : "") + std::to_string(tensor.shape[d]);
      json += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + tensor.bytes.size()) + "]}";
      offset += tensor.bytes.size();
    }
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  if (json.size() > kMaxHeaderBytes) {
    fail(ErrorCode::InvalidArgument, "the header would be ", json.size(), " bytes, past the ", kMaxHeaderBytes,
         " that safetensors readers accept: save fewer tensors per file (tbucket save --per-bucket)");
  }
  std::byte length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>(json.size() >> (8 * i));

  // Beside the target, unnamed (or under a hidden name), then renamed over it: a reader never
  // sees half a file, and a kill while writing leaves none.
  // Its mode is the file's it replaces (weights kept private stay so), or what the umask leaves
  // of 0666, as for any new file.
  File file(path, File::Beside{});
  try {
    file.write_all(length);
    file.write_all(std::as_bytes(std::span(json)));
    for (const auto* bucket : buckets) {
      for (std::size_t i = 0; i < bucket->size(); ++i) file.write_all((*bucket)[i].bytes);
    }
    struct stat replaced {};
    auto mode = ::lstat(path.c_str(), &replaced) == 0 && S_ISREG(replaced.st_mode) ? replaced.st_mode & 07777
                                                                                      : file.created_mode();
    if (::fchmod(file.descriptor(), mode) != 0) fail_errno("cannot set the mode of", file.shown_as());
    file.sync();
    file.place(path);
  } catch (...) {
    file.discard();
    throw;
  }
}

}  // namespace tensorbucket::safetensors
