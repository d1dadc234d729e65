// Building a bucket (producer side) and viewing a verified one (consumer side).
//
// BucketBuilder lays named tensors out in one payload at kPayloadAlignment offsets and
// checks each entry as it is added, so a builder never holds an invalid manifest. It does not
// own the tensors' bytes: the pointers given to add() must stay valid until packing is done.
//
// BucketView is the only way to read a received bucket. open() checks both halves (frame and
// payload) and every rule of docs/format.md before it returns; on any failure it throws and no
// view exists. Views are zero-copy: they point into the payload, which must outlive them.
//
// Thread safety: a BucketBuilder is not synchronized (one thread at a time, const members
// included: manifest() and encoded_manifest() keep what they work out). A builder destroyed on
// a thread leaves its storage and layout to the next one made there, which uses the layout (and
// its encoding, with its encoding_id()) only while its entries repeat it; nothing else of it
// shows. A BucketView is immutable after open(); its const members are safe to call from many
// threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tensorbucket/dtype.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/header.hpp"
#include "tensorbucket/manifest.hpp"

namespace tensorbucket {
namespace detail {
struct VerifiedManifest;

// What a builder took over from the last builder destroyed on its thread (serialize/builder.cpp).
struct LastLayout {
  std::vector<ManifestEntry> spare;  // that builder's entries no longer repeated: free strings for names
  std::size_t next_spare = 0;        // the first of `spare` whose name is still free
  std::vector<std::byte> encoded;    // the encoding of that builder's layout, or empty
  std::uint64_t encoding_id = 0;     // of `encoded`
  std::size_t repeated = 0;          // while repeating, the entries added so far
  bool taken = false;      // looked for, at the first add()
  // The builder's entries are still that builder's, in place; the first `repeated` are this
  // one's, added again. Readers see only those: settle() drops the rest into `spare`.
  bool repeating = false;
};
}  // namespace detail

// Where a payload's bytes are: host memory, or the memory of one CUDA device (its ordinal in
// this process: processes may number the same device differently).
struct PayloadLocation {
  enum class Kind : std::uint8_t { Host, Cuda };
  Kind kind = Kind::Host;
  int device = -1;  // the CUDA ordinal; -1 on the host

  static PayloadLocation host() noexcept { return {}; }
  static PayloadLocation cuda(int device) noexcept { return {Kind::Cuda, device}; }
  bool on_host() const noexcept { return kind == Kind::Host; }
  // "host" or "cuda:N"; parse() takes the same words ("cuda" alone is cuda:0) and throws
  // InvalidArgument for anything else.
  std::string to_string() const;
  static PayloadLocation parse(std::string_view text);
  friend bool operator==(const PayloadLocation&, const PayloadLocation&) = default;
};

// Heap bytes aligned to kPayloadAlignment, left uninitialized (packing overwrites them all).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t size_bytes);

  std::span<std::byte> span() noexcept { return {data_.get(), size_}; }
  std::span<const std::byte> span() const noexcept { return {data_.get(), size_}; }
  std::size_t size() const noexcept { return size_; }

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte[], Free> data_;
  std::size_t size_ = 0;
};

// An encoded bucket: the frame (header + manifest) and the payload it describes.
struct PackedBucket {
  std::vector<std::byte> frame;
  AlignedBuffer payload;
};

class BucketBuilder {
 public:
  BucketBuilder() = default;
  BucketBuilder(const BucketBuilder&) = default;
  BucketBuilder& operator=(const BucketBuilder&) = default;
  // A moved-from builder is empty, as a new one.
  BucketBuilder(BucketBuilder&&) noexcept;
  BucketBuilder& operator=(BucketBuilder&&) noexcept;
  // Leaves its storage to the next builder made on this thread: a trainer that makes a new
  // builder every step then allocates nothing per entry once it has run a step.
  ~BucketBuilder();

  BucketBuilder& version(std::uint64_t version);
  // InvalidArgument unless index < count.
  BucketBuilder& bucket(std::uint32_t index, std::uint32_t count);

  // Adds an entry whose bytes are copied from `data` when packing. Throws BadName,
  // DuplicateName, UnsupportedDtype, BadShape, or Unmaterialized when `data` is null but the
  // entry has bytes (a meta or undefined tensor). Nothing is added when it throws.
  BucketBuilder& add(std::string_view name, DType dtype, Shape shape, const void* data);

  // Adds an entry the caller writes in place, through entry_spans(). Same checks as add(),
  // except that it has no data yet.
  BucketBuilder& declare(std::string_view name, DType dtype, Shape shape);

  // Points entry `name`, made by add(), at new bytes of the same dtype and shape (a tensor the
  // trainer reallocated). The layout does not change, nor its kept encoding: a builder made
  // once and republished every step stays the fast path (bench/RESULTS.md, issue 21).
  // InvalidArgument for a name no add() made, Unmaterialized for null when the entry has bytes.
  BucketBuilder& set_data(std::string_view name, const void* data);

  // Declares that the named entries must arrive together. Members may be added before or
  // after; manifest() throws IncompleteGroup while one is missing.
  BucketBuilder& group(std::string name, std::vector<std::string> members);

  // Total payload size: the end of the last entry, rounded up to kPayloadAlignment.
  std::uint64_t payload_bytes() const noexcept { return payload_bytes_; }

  // The manifest so far. Throws IncompleteGroup when a declared group lacks a member.
  const Manifest& manifest() const;

  // The manifest's encoding, as manifest() throws. Kept between calls: version() and bucket()
  // restamp it in place, so a builder republished every step with a new version is encoded
  // once. Valid until the next non-const call.
  std::span<const std::byte> encoded_manifest() const;

  // Names the bytes encoded_manifest() returns but for the identity fields: a new value each
  // time the builder encodes its manifest anew, the same while it only restamps it (and in a
  // new builder that repeated the last one's layout whole, whose encoding it took over). A
  // producer that already wrote these bytes into a slot rewrites only the identity fields.
  std::uint64_t encoding_id() const noexcept { return encoding_id_; }

  // Copies every entry into `payload` and zeroes the padding between entries. InvalidArgument
  // if `payload` is too small or an entry was declare()d (those are written in place).
  void pack_into(std::span<std::byte> payload) const;

  // Writable spans into `payload`, one per entry in manifest order, for in-place producers.
  std::vector<std::span<std::byte>> entry_spans(std::span<std::byte> payload) const;

  // The address add() was given for each entry, in manifest order; null for declare()d
  // entries. A device channel copies from these itself (they may be device addresses).
  std::span<const std::byte* const> entry_sources() const noexcept { return sources_; }

  // Packs into a new buffer and encodes the frame. Same refusals as pack_into().
  PackedBucket pack(const EncodeOptions& options = {}) const;

 private:
  void append(std::string_view name, DType dtype, Shape&& shape);
  void take_leftovers();  // of the last builder destroyed on this thread
  void stop_repeating() const;
  void settle() const;  // before the entries are read: see detail::LastLayout
  void restamp() noexcept;  // the identity fields into encoded_, when kept
  std::optional<std::size_t> find_entry(std::string_view name) const;  // its position in manifest_.entries
  void make_room_for_a_source();

  // Mutable for settle(), which const readers call: while a new builder repeats the last one's
  // layout, its entries stay in place (compared, not checked, copied or indexed again, and the
  // encoding is reused) until something reads them or add() departs from them.
  mutable Manifest manifest_;
  std::vector<const std::byte*> sources_;  // per entry; null for declare()d entries
  mutable std::vector<std::uint64_t> entry_slots_;  // entry names -> positions in manifest_.entries (flat)
  mutable detail::LastLayout last_;
  std::unordered_map<std::string, std::string> group_of_member_;
  std::uint64_t payload_bytes_ = 0;
  mutable std::vector<std::byte> encoded_;  // empty until encoded_manifest(), and after changes
  mutable std::uint64_t encoding_id_ = 0;   // see encoding_id(); 0 before the first encoding
};

// One entry of a verified bucket; points into the payload (no copy), host or device memory
// as the view's location() says.
struct TensorView {
  std::string_view name;
  DType dtype;
  std::span<const std::int64_t> shape;
  std::span<const std::byte> bytes;
  std::string_view group;  // empty when the entry belongs to no group
};

// Layouts a consumer already verified. Producers usually send the same layout every step (same
// names, shapes and offsets; a new version and new bytes), so a hit costs a compare of the
// manifest bytes (and a hash, when it is not the last bucket's layout) instead of a decode and
// every rule. A hit requires every byte but the identity fields (version, bucket_index,
// bucket_count) to be equal, and the same payload size the layout was verified against. Not
// synchronized: one per consumer thread.
class ManifestCache {
 public:
  explicit ManifestCache(std::size_t capacity = 64) : capacity_(capacity) {}

 private:
  friend class BucketView;
  // The verified layout of `encoded`, reused or verified and kept.
  std::shared_ptr<const detail::VerifiedManifest> verified(std::span<const std::byte> encoded,
                                                           std::uint64_t payload_bytes);
  std::size_t capacity_;
  // Keyed by the xxh3 of the bytes after the identity fields; the bytes are compared on a hit.
  std::unordered_map<std::uint64_t, std::shared_ptr<const detail::VerifiedManifest>> entries_;
  std::shared_ptr<const detail::VerifiedManifest> last_;  // the layout of the last bucket
};

struct VerifyOptions {
  // Rule 5: when set, the bucket must match these names, dtypes and shapes exactly; one
  // bucket of an update split into several, the part of them it names (check_expected_part).
  // Subscriber::next_update() checks a whole update against them.
  const Manifest* expected = nullptr;
  // Hash the payload when the header carries a payload checksum.
  bool check_payload_checksum = true;
};

class BucketView {
 public:
  // Verifies `frame` and `payload` (docs/format.md, "Verification") and returns views into
  // `payload`. MissingManifest / MissingPayload when a half is absent; otherwise the code of
  // the first rule broken. `payload` may be longer than the header's payload_bytes.
  // With a `cache`, a manifest whose bytes were verified before is reused, not decoded again.
  // A payload in device memory (`location` not the host) is never read here: its checksum,
  // when asked for, is the caller's to check (the channel checks it on the device's side).
  static BucketView open(std::span<const std::byte> frame, std::span<const std::byte> payload,
                         const VerifyOptions& options = {}, ManifestCache* cache = nullptr,
                         PayloadLocation location = {});

  // Where the payload, and so every entry's bytes, lives.
  PayloadLocation location() const noexcept { return location_; }

  // The payload as the verified header declares it: its bytes, and its hash when the header
  // carries one (for the checks of a payload open() does not read).
  struct PayloadChecksum {
    std::uint64_t value;
    bool block_hash;  // the block hash of docs/format.md, else xxh3-64
  };
  std::span<const std::byte> payload() const noexcept { return payload_; }
  std::optional<PayloadChecksum> payload_checksum() const noexcept { return payload_checksum_; }

  // This bucket's frame (docs/format.md) encoded anew, without a payload checksum: the
  // verified layout stamped with this bucket's identity, for payload(). What a relay sends on.
  std::vector<std::byte> frame() const;

  // This bucket's identity, from its manifest.
  std::uint64_t version() const noexcept { return version_; }
  std::uint32_t bucket_index() const noexcept { return bucket_index_; }
  std::uint32_t bucket_count() const noexcept { return bucket_count_; }

  // The verified layout: entries and groups, shared (immutable) by copies of this view and by
  // every bucket of the same layout, so its version, bucket_index and bucket_count are left at
  // their defaults (0, 0, 1): read this bucket's from the accessors above. A moved-from view
  // is empty.
  const Manifest& manifest() const noexcept;
  std::size_t size() const noexcept { return manifest().entries.size(); }
  TensorView operator[](std::size_t index) const;
  std::optional<TensorView> find(std::string_view name) const;
  // The index of the entry named `name`, for operator[].
  std::optional<std::size_t> position(std::string_view name) const;

 private:
  BucketView(std::shared_ptr<const detail::VerifiedManifest> verified,
             std::span<const std::byte> payload, std::uint64_t version,
             std::uint32_t bucket_index, std::uint32_t bucket_count, PayloadLocation location,
             std::optional<PayloadChecksum> payload_checksum);

  std::shared_ptr<const detail::VerifiedManifest> verified_;
  std::span<const std::byte> payload_;
  std::uint64_t version_ = 0;
  std::uint32_t bucket_index_ = 0;
  std::uint32_t bucket_count_ = 1;
  PayloadLocation location_;
  std::optional<PayloadChecksum> payload_checksum_;
};

}  // namespace tensorbucket
