// safetensors files in and out: seed a channel from a checkpoint, snapshot what was published.
//
// The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian length N, N
// bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {string: string}}, then the tensors' bytes, offsets counted from the end of the header.
// Dtype names are ours already (dtype.hpp); a file with another dtype is refused.
//
// A file is hostile input, as a manifest is: parse_header() bounds and checks everything
// before anything is read or allocated for the tensors, and each refusal is an Error naming
// the file's entry and the values (the codes of docs/format.md's rules: HeaderCorrupt,
// UnsupportedDtype, BadName, BadShape, OutOfBounds, Overlap, DuplicateName).
//
// Thread safety: free functions over the caller's objects; a Publisher is used by one thread
// at a time (channel.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tensorbucket/bucket.hpp"
#include "tensorbucket/channel.hpp"

namespace tensorbucket::safetensors {

// The longest JSON header read, as the safetensors package limits it.
inline constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;

struct FileTensor {
  std::string name;
  DType dtype = DType::U8;
  Shape shape;
  std::uint64_t begin = 0;  // bytes from the start of the data (after the header)
  std::uint64_t end = 0;
};

struct FileHeader {
  std::vector<FileTensor> tensors;  // in the order of their offsets, as they lie in the file
  std::vector<std::pair<std::string, std::string>> metadata;  // "__metadata__", in file order
  std::uint64_t data_offset = 0;  // where the data starts: 8 + the JSON's length
  std::uint64_t data_bytes = 0;   // the data's length: the rest of the file
};

// Parses a file's first bytes, `head` (at least the 8-byte length and the JSON it announces),
// for a file of `file_bytes` bytes. Errors name `what` (the file) and the entry.
FileHeader parse_header(std::span<const std::byte> head, std::uint64_t file_bytes, const std::string& what = "file");

// Reads and parses the header of the file at `path`. SystemError when it cannot be read.
FileHeader read_header(const std::string& path);

struct PublishFileOptions {
  // The update's version; none: the first file's "tensorbucket.version" metadata (what save()
  // wrote), else 0.
  std::optional<std::uint64_t> version{};
  // 0: one bucket per file. Otherwise each file's tensors are split, in file order, into
  // buckets whose payloads hold at most this many bytes (a larger tensor gets one of its own).
  std::uint64_t bucket_bytes = 0;
  std::chrono::milliseconds timeout{10000};  // each bucket's wait for a free slot
  // Asked while waiting for a slot (Deadline::unless) and between the pieces of a long read:
  // true stops publishing (a signal came), as a timeout does.
  std::function<bool()> interrupted{};
};

struct FilePublish {
  std::uint64_t version = 0;
  std::uint32_t buckets = 0;    // the update's
  std::uint32_t published = 0;  // == buckets, or fewer when a wait timed out or was interrupted
  std::uint64_t bytes = 0;      // the tensors' bytes published
};

// Publishes the files' tensors as one update, each file read once, tensor by tensor, straight
// into the slots (a device channel's through a host buffer of one tensor). Every header is
// read and checked before anything is published. When a wait for a slot times out, or
// options.interrupted says so (between two reads of 64 MiB, 1 MiB on tmpfs), the rest is not
// published and the update stays unfinished (Publisher::waiting_for() says what a timeout
// waited for); consumers of whole updates never see it. SystemError when a file cannot be
// read, or changed since its header was read (size, mtime or ctime; the bucket it was read
// into is not published, those before it were). A file whose name was replaced meanwhile
// (renamed over) did not change: what was opened is read. On tmpfs, which dates no write
// made through a shared mapping, each bucket's bytes are read a second time and compared by
// hash too (about half the speed of one read there). Not seen elsewhere: a write through a
// mapping to a page already written since its last writeback, which dates nothing either.
FilePublish publish_files(Publisher& publisher, std::span<const std::string> paths,
                          const PublishFileOptions& options = {});

// Writes `buckets` (one bucket, or the buckets of one update, in order) as one safetensors
// file at `path`, replacing it: its tensors contiguous in the buckets' order, its
// "__metadata__" the "tensorbucket.version" and "tensorbucket.bucket_count" of the update,
// and, for a single bucket of a split update, its "tensorbucket.bucket_index". Written to a
// temporary file beside `path` and renamed, so a failure leaves nothing (but a process killed
// while writing leaves its hidden `.NAME.tmp-XXXXXXXX`). Its mode is that of the file it
// replaces, else 0666 less the umask, as for any new file. The payloads must be readable on the host
// (copy a device bucket's first: ReceivedBucket::copy_to_host()). BadName for a name that is
// not UTF-8 (the header is JSON) or is "__metadata__"; DuplicateName for a name in two
// buckets; InvalidArgument for a device payload, buckets of different versions, or a header
// past kMaxHeaderBytes; SystemError when the file cannot be written.
void save(std::span<const BucketView* const> buckets, const std::string& path);

// What save() would refuse about `path` itself, for a caller that waits for its buckets first
// (`tbucket save`): InvalidArgument for a NUL byte or for something there that is not a regular
// file, SystemError for a folder that is missing or that this process cannot write in.
void check_save_path(const std::string& path);
// The same, of `path`'s folder alone: for a caller that has yet to name the file.
void check_save_folder(const std::string& path);

}  // namespace tensorbucket::safetensors
