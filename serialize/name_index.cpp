#include "name_index.hpp"

#include <bit>

#include "tensorbucket/header.hpp"

namespace tensorbucket::detail {
namespace {

constexpr std::uint64_t kPositionMask = 0xffffffffu;

std::uint64_t name_hash(std::string_view name) {
  return xxh3({reinterpret_cast<const std::byte*>(name.data()), name.size()});
}

}  // namespace

std::optional<std::size_t> NameIndex::build(std::span<const ManifestEntry> entries) {
  static_assert(kMaxEntries < kPositionMask, "positions must fit the slot's low half");
  entries_ = entries;
  // At most half full, so probes stay short.
  slots_.assign(std::bit_ceil(2 * entries.size() + 2), 0);
  const std::size_t mask = slots_.size() - 1;
  for (std::size_t position = 0; position < entries.size(); ++position) {
    const auto& name = entries[position].name;
    auto hash = name_hash(name);
    auto tag = hash & ~kPositionMask;
    for (auto slot = hash & mask;; slot = (slot + 1) & mask) {
      if (slots_[slot] == 0) {
        slots_[slot] = tag | (position + 1);
        break;
      }
      if ((slots_[slot] & ~kPositionMask) == tag &&
          entries[(slots_[slot] & kPositionMask) - 1].name == name) {
        return position;
      }
    }
  }
  return std::nullopt;
}

std::optional<std::size_t> NameIndex::find(std::string_view name) const {
  if (slots_.empty()) return std::nullopt;
  const std::size_t mask = slots_.size() - 1;
  auto hash = name_hash(name);
  auto tag = hash & ~kPositionMask;
  for (auto slot = hash & mask; slots_[slot] != 0; slot = (slot + 1) & mask) {
    auto position = (slots_[slot] & kPositionMask) - 1;
    if ((slots_[slot] & ~kPositionMask) == tag && entries_[position].name == name) return position;
  }
  return std::nullopt;
}

}  // namespace tensorbucket::detail
