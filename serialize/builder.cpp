#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "tensorbucket/bucket.hpp"
#include "copy.hpp"
#include "identity.hpp"
#include "name_index.hpp"
#include "base/text.hpp"
#include "verify.hpp"

namespace tensorbucket {

using text::Dims;
using text::fail;
using text::Quoted;

namespace {

std::uint64_t align_up(std::uint64_t offset) {
  return (offset + kPayloadAlignment - 1) / kPayloadAlignment * kPayloadAlignment;
}

// What the last builder destroyed on a thread leaves to the next one made there. The loop a
// trainer writes first makes a new builder every step, of the same layout; without this, each
// step grows its vectors anew, allocates a string per long name, checks, indexes and encodes
// the same entries again, and touches fresh pages where glibc handed the last step's large
// vectors back to the kernel (a third of a step's time, measured).
struct Leftovers {
  std::vector<ManifestEntry> layout;  // the last builder's entries
  std::vector<ManifestEntry> spare;   // empty, with capacity
  std::vector<const std::byte*> sources;
  std::vector<std::uint64_t> slots;  // the index of `layout`
  std::vector<std::byte> encoded;    // the encoding of `layout`, or empty
  std::uint64_t encoding_id = 0;

  ~Leftovers() { gone = true; }
  static thread_local bool gone;  // a builder destroyed after its thread's leftovers keeps nothing
};
thread_local bool Leftovers::gone = false;

// A builder of more entries than this frees its storage: a thread keeps ~1.5 MiB for names of
// 60 bytes, 10 MiB at most.
constexpr std::size_t kMaxLeftEntries = 4096;

Leftovers* leftovers() {
  if (Leftovers::gone) return nullptr;
  thread_local Leftovers kept;
  return &kept;
}

bool same_entry(const ManifestEntry& entry, std::string_view name, DType dtype, const Shape& shape) {
  return entry.dtype == dtype && entry.shape == shape && entry.name == name;
}

}  // namespace

// Layouts with groups are neither left nor repeated: they are rare, and their members may be
// named before they are added.
BucketBuilder::~BucketBuilder() {
  try {
    settle();  // the table then indexes this layout
  } catch (...) {  // out of memory: keep nothing
    return;
  }
  auto count = manifest_.entries.size();
  if (count == 0 || count > kMaxLeftEntries || !manifest_.groups.empty()) return;
  auto* left = leftovers();
  if (left == nullptr) return;
  last_.spare.clear();
  sources_.clear();
  left->layout = std::move(manifest_.entries);
  left->spare = std::move(last_.spare);
  left->sources = std::move(sources_);
  left->slots = std::move(entry_slots_);
  left->encoded = std::move(encoded_);  // empty when the builder changed after its last encoding
  left->encoding_id = encoding_id_;
}

void BucketBuilder::take_leftovers() {
  last_.taken = true;
  auto* left = leftovers();
  if (left == nullptr || left->layout.empty() || !manifest_.entries.empty()) return;
  last_.repeating = manifest_.groups.empty();
  if (last_.repeating) {
    manifest_.entries = std::move(left->layout);
    last_.spare = std::move(left->spare);
    last_.spare.clear();
  } else {
    last_.spare = std::move(left->layout);
    manifest_.entries = std::move(left->spare);
    manifest_.entries.clear();
  }
  sources_ = std::move(left->sources);
  sources_.clear();
  entry_slots_ = std::move(left->slots);
  if (!last_.repeating) std::fill(entry_slots_.begin(), entry_slots_.end(), 0);
  last_.encoded = std::move(left->encoded);
  last_.encoding_id = left->encoding_id;
  last_.next_spare = 0;
  last_.repeated = 0;
  // Moved-from vectors are valid but unspecified.
  left->layout.clear();
  left->spare.clear();
  left->sources.clear();
  left->slots.clear();
  left->encoded.clear();
}

// The entries added again so far stay, indexed anew; the rest of the last layout's entries
// give their strings to the names added from here on.
void BucketBuilder::stop_repeating() const {
  auto& entries = manifest_.entries;
  auto rest = entries.begin() + static_cast<std::ptrdiff_t>(last_.repeated);
  // May allocate (room for the spare names): nothing has moved when that throws. The table
  // indexed the last layout, no smaller: index_all() does not allocate.
  last_.spare.assign(std::make_move_iterator(rest), std::make_move_iterator(entries.end()));
  entries.erase(rest, entries.end());
  detail::index_all(entry_slots_, entries);
  last_.repeating = false;
  last_.next_spare = 0;
  last_.encoded.clear();
}

void BucketBuilder::settle() const {
  if (last_.repeating && last_.repeated < manifest_.entries.size()) stop_repeating();
}

AlignedBuffer::AlignedBuffer(std::size_t size_bytes)
    : data_(static_cast<std::byte*>(
          ::operator new[](size_bytes, std::align_val_t{kPayloadAlignment}))),
      size_(size_bytes) {}

void AlignedBuffer::Free::operator()(std::byte* p) const noexcept {
  ::operator delete[](p, std::align_val_t{kPayloadAlignment});
}

// A moved-from builder is a new one: empty, and free to take the last layout over again.
BucketBuilder::BucketBuilder(BucketBuilder&& other) noexcept { *this = std::move(other); }

BucketBuilder& BucketBuilder::operator=(BucketBuilder&& other) noexcept {
  if (this != &other) {
    manifest_ = std::exchange(other.manifest_, {});
    sources_ = std::exchange(other.sources_, {});
    entry_slots_ = std::exchange(other.entry_slots_, {});
    last_ = std::exchange(other.last_, {});
    group_of_member_ = std::exchange(other.group_of_member_, {});
    payload_bytes_ = std::exchange(other.payload_bytes_, 0);
    encoded_ = std::exchange(other.encoded_, {});
    encoding_id_ = std::exchange(other.encoding_id_, 0);
  }
  return *this;
}

BucketBuilder& BucketBuilder::version(std::uint64_t version) {
  manifest_.version = version;
  restamp();
  return *this;
}

BucketBuilder& BucketBuilder::bucket(std::uint32_t index, std::uint32_t count) {
  if (index >= count) {
    fail(ErrorCode::InvalidArgument, "bucket index ", index, " is not below bucket count ",
         count);
  }
  manifest_.bucket_index = index;
  manifest_.bucket_count = count;
  restamp();
  return *this;
}

void BucketBuilder::restamp() noexcept {
  if (!encoded_.empty()) {
    detail::stamp_identity(encoded_, {manifest_.version, manifest_.bucket_index, manifest_.bucket_count});
  }
}

void BucketBuilder::append(std::string_view name, DType dtype, Shape&& shape) {
  if (last_.repeating) {
    auto position = last_.repeated;
    if (position < manifest_.entries.size() && same_entry(manifest_.entries[position], name, dtype, shape)) {
      // Checked, laid out at this same offset and indexed at this position by the last builder.
      encoded_.clear();
      const auto& entry = manifest_.entries[position];
      last_.repeated = position + 1;
      payload_bytes_ = align_up(entry.byte_offset + entry.byte_length);
      if (last_.repeated == manifest_.entries.size() && !last_.encoded.empty()) {
        encoded_ = std::move(last_.encoded);
        encoding_id_ = last_.encoding_id;
        restamp();
      }
      return;
    }
    stop_repeating();
  }
  detail::check_name(name, manifest_.entries.size(), "entry");
  auto hash = detail::name_hash(name);
  if (detail::find_name(entry_slots_, manifest_.entries, name, hash)) {
    fail(ErrorCode::DuplicateName, "entry name ", Quoted{name}, " was already added");
  }
  auto byte_length = detail::check_tensor(name, dtype, shape);
  if (manifest_.entries.size() >= kMaxEntries) {
    fail(ErrorCode::InvalidArgument, "entry ", Quoted{name}, " is one too many: a bucket holds at most ",
         kMaxEntries, " entries; split the update with bucket_index and bucket_count");
  }
  auto byte_offset = align_up(payload_bytes_);
  auto end = align_up(byte_offset + byte_length);
  if (end > kMaxPayloadBytes) {
    fail(ErrorCode::BadShape, "entry ", Quoted{name}, " would end the payload at byte ", end,
         ", past the limit of ", kMaxPayloadBytes);
  }

  std::string group;
  if (!group_of_member_.empty()) {
    if (auto found = group_of_member_.find(std::string(name)); found != group_of_member_.end()) group = found->second;
  }
  // The name is copied before the entries may move: `name` may point into one of them.
  std::string own_name;
  if (last_.next_spare < last_.spare.size()) own_name = std::move(last_.spare[last_.next_spare++].name);
  own_name.assign(name);
  // Made in place: a temporary entry and its move cost as much as the rest of append().
  encoded_.clear();
  auto& entry = manifest_.entries.emplace_back();
  entry.name = std::move(own_name);
  entry.dtype = dtype;
  entry.shape = std::move(shape);
  entry.byte_offset = byte_offset;
  entry.byte_length = byte_length;
  entry.group = std::move(group);
  try {
    detail::index_last(entry_slots_, manifest_.entries.size() - 1, hash);
  } catch (...) {  // out of memory: nothing added
    manifest_.entries.pop_back();
    throw;
  }
  payload_bytes_ = end;
}

// Before append(): the source's push_back after it then cannot throw, so an add() that throws
// adds nothing, and sources_ stays one per entry. The first one takes the last layout over.
void BucketBuilder::make_room_for_a_source() {
  if (!last_.taken) take_leftovers();
  if (sources_.size() == sources_.capacity()) sources_.reserve(std::max<std::size_t>(16, 2 * sources_.capacity()));
}

std::optional<std::size_t> BucketBuilder::find_entry(std::string_view name) const {
  settle();
  return detail::find_name(entry_slots_, manifest_.entries, name);
}

BucketBuilder& BucketBuilder::add(std::string_view name, DType dtype, Shape shape, const void* data) {
  // An invalid shape or dtype is left for append() to report as such.
  if (data == nullptr && checked_byte_length(dtype, shape).value_or(0) != 0) {
    fail(ErrorCode::Unmaterialized, "entry ", Quoted{name}, " of ", dtype, ' ', Dims{shape},
         " has no data (an unmaterialized tensor?)");
  }
  make_room_for_a_source();
  append(name, dtype, std::move(shape));
  sources_.push_back(static_cast<const std::byte*>(data));
  return *this;
}

BucketBuilder& BucketBuilder::declare(std::string_view name, DType dtype, Shape shape) {
  make_room_for_a_source();
  append(name, dtype, std::move(shape));
  sources_.push_back(nullptr);
  return *this;
}

BucketBuilder& BucketBuilder::set_data(std::string_view name, const void* data) {
  auto entry = find_entry(name);
  if (!entry) fail(ErrorCode::InvalidArgument, "the builder has no entry ", Quoted{name});
  const auto& added = manifest_.entries[*entry];
  // An empty entry has no bytes to point at: it takes any address, null included.
  if (sources_[*entry] == nullptr && added.byte_length != 0) {
    fail(ErrorCode::InvalidArgument, "entry ", Quoted{name}, " was declared for in-place writing: it has no data to move");
  }
  if (data == nullptr && added.byte_length != 0) {
    fail(ErrorCode::Unmaterialized, "entry ", Quoted{name}, " of ", added.dtype, ' ', Dims{added.shape},
         " was given no data (an unmaterialized tensor?)");
  }
  sources_[*entry] = static_cast<const std::byte*>(data);
  return *this;
}

BucketBuilder& BucketBuilder::group(std::string name, std::vector<std::string> members) {
  if (last_.repeating) stop_repeating();
  detail::check_name(name, manifest_.groups.size(), "group");
  for (const auto& group : manifest_.groups) {
    if (group.name == name) fail(ErrorCode::DuplicateName, "group ", Quoted{name}, " was already declared");
  }
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (auto taken = group_of_member_.find(members[i]); taken != group_of_member_.end()) {
      fail(ErrorCode::InvalidArgument, "entry ", Quoted{members[i]}, " is already in group ",
           Quoted{taken->second});
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (members[j] == members[i]) {
        fail(ErrorCode::DuplicateName, "group ", Quoted{name}, " lists ", Quoted{members[i]}, " twice");
      }
    }
  }
  encoded_.clear();
  for (const auto& member : members) {
    group_of_member_.emplace(member, name);
    if (auto entry = find_entry(member)) manifest_.entries[*entry].group = name;
  }
  manifest_.groups.push_back({std::move(name), std::move(members)});
  return *this;
}

const Manifest& BucketBuilder::manifest() const {
  settle();
  // A kept encoding was made after this check passed, and nothing changed since.
  if (!encoded_.empty()) return manifest_;
  for (const auto& group : manifest_.groups) {
    for (const auto& member : group.members) {
      if (!find_entry(member)) {
        fail(ErrorCode::IncompleteGroup, "group ", Quoted{group.name}, " is missing member ",
             Quoted{member});
      }
    }
  }
  return manifest_;
}

std::span<const std::byte> BucketBuilder::encoded_manifest() const {
  if (encoded_.empty()) {
    encoded_ = encode_manifest(manifest());
    static std::atomic<std::uint64_t> encodings = 0;
    encoding_id_ = ++encodings;
  }
  return encoded_;
}

void BucketBuilder::pack_into(std::span<std::byte> payload) const {
  if (payload.size() < payload_bytes_) {
    fail(ErrorCode::InvalidArgument, "payload buffer has ", payload.size(), " bytes; the bucket needs ",
         payload_bytes_);
  }
  detail::pack(*this, payload);
}

std::vector<std::span<std::byte>> BucketBuilder::entry_spans(std::span<std::byte> payload) const {
  if (payload.size() < payload_bytes_) {
    fail(ErrorCode::InvalidArgument, "payload buffer has ", payload.size(), " bytes; the bucket needs ",
         payload_bytes_);
  }
  settle();
  // Every entry ends within payload_bytes_, checked above: spans made directly, without
  // subspan()'s checks (a reservation makes 1000 of them every step).
  std::vector<std::span<std::byte>> spans;
  spans.reserve(manifest_.entries.size());
  for (const auto& entry : manifest_.entries) spans.emplace_back(payload.data() + entry.byte_offset, entry.byte_length);
  return spans;
}

PackedBucket BucketBuilder::pack(const EncodeOptions& options) const {
  const auto& checked = manifest();
  PackedBucket packed{{}, AlignedBuffer(payload_bytes_)};
  pack_into(packed.payload.span());
  packed.frame = encode_frame(checked, packed.payload.span(), options);
  return packed;
}

}  // namespace tensorbucket
