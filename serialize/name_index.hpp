// Internal: entry name -> entry position, as a flat open-addressing table. The consumer builds
// one per bucket (uniqueness check, group lookups, BucketView::find) and the builder grows one
// an entry at a time; node-based maps cost an allocation (and, in the builder, a copy of the
// name) per entry, which dominated verification of large manifests and a new builder's add().
#pragma once

#include "base/private.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "tensorbucket/manifest.hpp"

namespace tensorbucket::detail {

// The table itself, over entries kept elsewhere: per slot, the high 32 bits of the name's hash
// and the entry's position + 1 in the low 32; 0 is empty. At most half full. The high bits
// also pick the slot, so the table grows without reading or hashing a name again. Positions at
// or past the entries' count are not found. A builder repeating the last builder's layout keeps
// that layout's table, and its entries in place, while add() repeats them; it settles (drops
// the entries not repeated, and indexes what stays) before any lookup.
using NameSlots = std::vector<std::uint64_t>;

// The hash the table keys on; a caller that both looks a name up and indexes it hashes once.
std::uint64_t name_hash(std::string_view name);

std::optional<std::size_t> find_name(std::span<const std::uint64_t> slots, std::span<const ManifestEntry> entries,
                                     std::string_view name, std::uint64_t hash);
inline std::optional<std::size_t> find_name(std::span<const std::uint64_t> slots,
                                            std::span<const ManifestEntry> entries, std::string_view name) {
  return find_name(slots, entries, name, name_hash(name));
}
// Indexes every one of `entries` anew. Their names must be unique. Allocates only when the
// table is too small for them (never where it indexed more of them before).
void index_all(NameSlots& slots, std::span<const ManifestEntry> entries);
// Indexes entry `position` (every entry before it is indexed), whose name hashes to `hash`,
// growing `slots` when it would be more than half full. The name must not be indexed yet
// (find_name() first).
void index_last(NameSlots& slots, std::size_t position, std::uint64_t hash);

class NameIndex {
 public:
  // Indexes the names of `entries`, which must outlive the index (it keeps a span, whose
  // target moves along when the owning vector is moved). Returns the position of the first
  // entry whose name repeats an earlier one, or nullopt when all are unique.
  std::optional<std::size_t> build(std::span<const ManifestEntry> entries);

  std::optional<std::size_t> find(std::string_view name) const { return find_name(slots_, entries_, name); }

 private:
  std::span<const ManifestEntry> entries_;
  NameSlots slots_;
};

}  // namespace tensorbucket::detail
