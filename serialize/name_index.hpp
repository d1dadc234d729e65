// Internal: entry name -> entry position, as a flat open-addressing table. The consumer builds
// one per bucket (uniqueness check, group lookups, BucketView::find); node-based maps cost
// an allocation per name, which dominated verification of large manifests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "tensorbucket/manifest.hpp"

namespace tensorbucket::detail {

class NameIndex {
 public:
  // Indexes the names of `entries`, which must outlive the index (it keeps a span, whose
  // target moves along when the owning vector is moved). Returns the position of the first
  // entry whose name repeats an earlier one, or nullopt when all are unique.
  std::optional<std::size_t> build(std::span<const ManifestEntry> entries);

  std::optional<std::size_t> find(std::string_view name) const;

 private:
  std::span<const ManifestEntry> entries_;
  // Per slot: high 32 bits of the name's hash, low 32 bits entry position + 1; 0 is empty.
  std::vector<std::uint64_t> slots_;
};

}  // namespace tensorbucket::detail
