#include "name_index.hpp"

#include <bit>

#include "tensorbucket/header.hpp"

namespace tensorbucket::detail {
namespace {

constexpr std::uint64_t kPositionMask = 0xffffffffu;
static_assert(kMaxEntries < kPositionMask, "positions must fit the slot's low half");

std::size_t slot_of(std::uint64_t hash, std::size_t mask) { return (hash >> 32) & mask; }

// Puts `position`, whose name hashes to `hash`, into the first free slot from its own.
void put(NameSlots& slots, std::uint64_t hash, std::size_t position) {
  const std::size_t mask = slots.size() - 1;
  auto slot = slot_of(hash, mask);
  while (slots[slot] != 0) slot = (slot + 1) & mask;
  slots[slot] = (hash & ~kPositionMask) | (position + 1);
}

// Puts entry `position` into its slot, or returns the position of an indexed entry of the same
// name, in one probe.
std::optional<std::size_t> place(NameSlots& slots, std::span<const ManifestEntry> entries, std::size_t position) {
  const std::size_t mask = slots.size() - 1;
  const auto& name = entries[position].name;
  auto hash = name_hash(name);
  auto tag = hash & ~kPositionMask;
  for (auto slot = slot_of(hash, mask);; slot = (slot + 1) & mask) {
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

std::uint64_t name_hash(std::string_view name) {
  return xxh3({reinterpret_cast<const std::byte*>(name.data()), name.size()});
}

std::optional<std::size_t> find_name(std::span<const std::uint64_t> slots, std::span<const ManifestEntry> entries,
                                     std::string_view name, std::uint64_t hash) {
  if (slots.empty()) return std::nullopt;
  const std::size_t mask = slots.size() - 1;
  auto tag = hash & ~kPositionMask;
  for (auto slot = slot_of(hash, mask); slots[slot] != 0; slot = (slot + 1) & mask) {
    auto position = (slots[slot] & kPositionMask) - 1;
    if ((slots[slot] & ~kPositionMask) == tag && position < entries.size() && entries[position].name == name) {
      return position;
    }
  }
  return std::nullopt;
}

void index_all(NameSlots& slots, std::span<const ManifestEntry> entries) {
  if (slots.size() < slots_for(entries.size())) slots.resize(slots_for(entries.size()));
  std::fill(slots.begin(), slots.end(), 0);
  for (std::size_t position = 0; position < entries.size(); ++position) put(slots, name_hash(entries[position].name), position);
}

void index_last(NameSlots& slots, std::size_t position, std::uint64_t hash) {
  if (slots.size() < slots_for(position + 1)) {  // grown: every slot placed again by its tag
    NameSlots grown(slots_for(std::max<std::size_t>(position + 1, 32)), 0);
    for (auto taken : slots) {
      if (taken != 0) put(grown, taken, (taken & kPositionMask) - 1);
    }
    slots.swap(grown);
  }
  put(slots, hash, position);
}

std::optional<std::size_t> NameIndex::build(std::span<const ManifestEntry> entries) {
  entries_ = entries;
  slots_.assign(slots_for(entries.size()), 0);
  for (std::size_t position = 0; position < entries.size(); ++position) {
    // The first entry whose name repeats an earlier one; the earlier one is indexed.
    if (place(slots_, entries, position)) return position;
  }
  return std::nullopt;
}

}  // namespace tensorbucket::detail
