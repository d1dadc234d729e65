// The manifest: what a bucket's payload holds, entry by entry.
//
// A manifest is plain data. `encode_manifest` writes it with cereal's portable binary archive;
// `decode_manifest` reads hostile bytes safely: every count and length is checked against the
// limits below (and against the bytes that remain) before anything is allocated, and decoding
// never executes anything. `verify_manifest` applies the well-formedness rules of
// docs/format.md; a manifest that passes can be turned into views without further checks.
//
// Thread safety: value types; const functions are safe to call concurrently.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tensorbucket/dtype.hpp"

namespace tensorbucket {

// Bumped when the encoded layout changes; decoders reject other versions.
inline constexpr std::uint32_t kManifestFormatVersion = 1;

// Every entry starts at a multiple of this many payload bytes (what CUDA kernels and
// vectorized loads want, and what keeps two entries off one cache line).
inline constexpr std::uint64_t kPayloadAlignment = 256;

// Decoding bounds. They are far above real models (a 70B model has ~1k tensors) and small
// enough that a hostile manifest cannot make a consumer allocate much.
inline constexpr std::uint64_t kMaxEntries = 1u << 20;
inline constexpr std::uint64_t kMaxGroups = kMaxEntries;
inline constexpr std::uint64_t kMaxNameBytes = 1024;
inline constexpr std::uint64_t kMaxRank = 64;
inline constexpr std::uint64_t kMaxManifestBytes = 256ull << 20;
inline constexpr std::uint64_t kMaxPayloadBytes = 1ull << 48;

// Row-major dims. Up to kInlineRank dims live inside the object and more spill to the heap:
// decoding a manifest would otherwise allocate a vector per entry, which was a third of the
// consumer's cost for large buckets. Converts to std::span<const std::int64_t>.
class Shape {
 public:
  static constexpr std::size_t kInlineRank = 8;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) { assign(dims); }
  explicit Shape(std::span<const std::int64_t> dims) { assign(dims); }
  Shape(const Shape&) = default;
  Shape& operator=(const Shape&) = default;
  // A moved-from Shape is empty (the default would keep its rank but lose its heap dims).
  Shape(Shape&& other) noexcept
      : rank_(std::exchange(other.rank_, 0)), inline_(other.inline_), heap_(std::move(other.heap_)) {}
  Shape& operator=(Shape&& other) noexcept {
    inline_ = other.inline_;
    heap_ = std::move(other.heap_);
    rank_ = std::exchange(other.rank_, 0);
    return *this;
  }

  void assign(std::span<const std::int64_t> dims) {
    resize(dims.size());
    std::copy(dims.begin(), dims.end(), data());
  }
  // Keeps the first min(size(), rank) dims; new dims are 0.
  void resize(std::size_t rank) {
    if (rank > kInlineRank) {
      if (rank_ <= kInlineRank) heap_.assign(inline_.begin(), inline_.begin() + rank_);
      heap_.resize(rank);
    } else {
      if (rank_ > kInlineRank) std::copy_n(heap_.begin(), rank, inline_.begin());
      std::fill(inline_.begin() + std::min(rank, rank_), inline_.begin() + rank, 0);
      heap_.clear();
    }
    rank_ = rank;
  }

  std::size_t size() const noexcept { return rank_; }
  bool empty() const noexcept { return rank_ == 0; }
  std::int64_t* data() noexcept { return rank_ > kInlineRank ? heap_.data() : inline_.data(); }
  const std::int64_t* data() const noexcept {
    return rank_ > kInlineRank ? heap_.data() : inline_.data();
  }
  std::int64_t* begin() noexcept { return data(); }
  std::int64_t* end() noexcept { return data() + rank_; }
  const std::int64_t* begin() const noexcept { return data(); }
  const std::int64_t* end() const noexcept { return data() + rank_; }
  std::int64_t& operator[](std::size_t i) noexcept { return data()[i]; }
  std::int64_t operator[](std::size_t i) const noexcept { return data()[i]; }
  operator std::span<const std::int64_t>() const noexcept { return {data(), rank_}; }

  // Dim by dim: std::equal becomes a memcmp call, whose wide loads of a Shape just built (as
  // every add() of a new builder compares one) waited for its narrower stores to land: half
  // the time of such a builder's 1000 add() calls.
  friend bool operator==(const Shape& a, const Shape& b) noexcept {
    if (a.rank_ != b.rank_) return false;
    for (std::size_t d = 0; d < a.rank_; ++d) {
      if (a[d] != b[d]) return false;
    }
    return true;
  }

 private:
  std::size_t rank_ = 0;
  std::array<std::int64_t, kInlineRank> inline_{};
  std::vector<std::int64_t> heap_;  // the dims when rank_ > kInlineRank
};

struct ManifestEntry {
  std::string name;  // unique within the bucket, 1..kMaxNameBytes bytes of any encoding
  DType dtype = DType::U8;
  Shape shape;                      // each dim >= 0; empty for a scalar
  std::uint64_t byte_offset = 0;    // from the payload start; multiple of kPayloadAlignment
  std::uint64_t byte_length = 0;    // numel x itemsize
  std::string group;                // name of the group this entry belongs to, or empty

  friend bool operator==(const ManifestEntry&, const ManifestEntry&) = default;
};

// Entries that must arrive together: a quantized weight and its scales, a ragged token
// pool and its valid lengths. A consumer rejects a bucket that lacks any member.
struct ManifestGroup {
  std::string name;
  std::vector<std::string> members;  // entry names; each entry is in at most one group

  friend bool operator==(const ManifestGroup&, const ManifestGroup&) = default;
};

struct Manifest {
  std::uint64_t version = 0;        // producer's weight version, e.g. the training step
  std::uint32_t bucket_index = 0;   // this bucket's place in one update: 0..bucket_count-1
  std::uint32_t bucket_count = 1;   // how many buckets make the update complete
  std::vector<ManifestEntry> entries;
  std::vector<ManifestGroup> groups;

  friend bool operator==(const Manifest&, const Manifest&) = default;
};

// Portable binary bytes of `manifest`. Does not verify it.
std::vector<std::byte> encode_manifest(const Manifest& manifest);

// Throws Error(ManifestCorrupt) for bytes that do not decode exactly (trailing bytes included)
// or that exceed a bound. Does not apply the verification rules.
Manifest decode_manifest(std::span<const std::byte> bytes);

// Throws the Error of the first rule `manifest` breaks for a payload of `payload_bytes`:
// BadName, DuplicateName, UnsupportedDtype, BadShape, Misaligned, OutOfBounds, Overlap,
// IncompleteGroup, ManifestCorrupt (bucket index, limits).
void verify_manifest(const Manifest& manifest, std::uint64_t payload_bytes);

// Rule 5: throws one Error(ManifestMismatch) whose details() list every name of `expected`
// missing from `actual`, every unexpected name, and every shape and dtype mismatch; its message
// gives their counts and the first few of each. Offsets are not compared.
// InvalidArgument when `expected` lists a name twice.
void check_expected(const Manifest& actual, const Manifest& expected);
// The same for one bucket of an update split into several: every entry of `actual` must be
// expected, as expected; the expected names it lacks are the other buckets'.
void check_expected_part(const Manifest& actual, const Manifest& expected);

// numel x itemsize of a shape, or nullopt on a negative dim or on overflow past kMaxPayloadBytes.
std::optional<std::uint64_t> checked_byte_length(DType dtype,
                                                 std::span<const std::int64_t> shape) noexcept;

}  // namespace tensorbucket
