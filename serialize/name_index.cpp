#include "name_index.hpp"

#include <bit>

#include "tensorbucket/header.hpp"

namespace tensorbucket::detail {
namespace {

constexpr std::uint64_t kPositionMask = 0xffffffffu;
static_assert(kMaxEntries < kPositionMask, "positions must fit the slot's low half");

std::uint64_t name_hash(std::string_view name) {
  return xxh3({reinterpret_cast<const std::byte*>(name.data()), name.size()});
}

// Puts entry `position` into its slot, or returns the position of an indexed entry of the same
// name (where the caller did not check).
std::optional<std::size_t> place(NameSlots& slots, std::span<const ManifestEntry> entries, std::size_t position) {
  const std::size_t mask = slots.size() - 1;
  const auto& name = entries[position].name;
  auto hash = name_hash(name);
  auto tag = hash & ~kPositionMask;
  for (auto slot = hash & mask;; slot = (slot + 1) & mask) {
    if (slots[slot] == 0) {
      slots[slot] = tag | (position + 1);
      return std::nullopt;
    }
    auto other = (slots[slot] & kPositionMask) - 1;
    if ((slots[slot] & ~kPositionMask) == tag && entries[other].name == name) return other;
  }
}

// Room for `entries` names, at most half full, so that probes stay short.
std::size_t slots_for(std::size_t entries) { return std::bit_ceil(2 * entries + 2); }

}  // namespace

std::optional<std::size_t> find_name(std::span<const std::uint64_t> slots, std::span<const ManifestEntry> entries,
                                     std::string_view name) {
  if (slots.empty()) return std::nullopt;
  const std::size_t mask = slots.size() - 1;
  auto hash = name_hash(name);
  auto tag = hash & ~kPositionMask;
  for (auto slot = hash & mask; slots[slot] != 0; slot = (slot + 1) & mask) {
    auto position = (slots[slot] & kPositionMask) - 1;
    if ((slots[slot] & ~kPositionMask) == tag && entries[position].name == name) return position;
  }
  return std::nullopt;
}

void index_last(NameSlots& slots, std::span<const ManifestEntry> entries) {
  if (slots.size() < slots_for(entries.size())) {  // grown: every name placed again
    slots.assign(slots_for(std::max<std::size_t>(entries.size(), 32)), 0);
    for (std::size_t position = 0; position + 1 < entries.size(); ++position) place(slots, entries, position);
  }
  place(slots, entries, entries.size() - 1);
}

std::optional<std::size_t> NameIndex::build(std::span<const ManifestEntry> entries) {
  entries_ = entries;
  slots_.assign(slots_for(entries.size()), 0);
  for (std::size_t position = 0; position < entries.size(); ++position) {
    if (place(slots_, entries, position)) {
      // The first entry whose name repeats an earlier one; the earlier one is indexed.
      return position;
    }
  }
  return std::nullopt;
}

}  // namespace tensorbucket::detail
