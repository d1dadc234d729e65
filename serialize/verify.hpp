// Internal: verification that also hands back the name index it builds on the way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <unordered_map>

#include "tensorbucket/manifest.hpp"

namespace tensorbucket::detail {

// Entry name -> index into manifest.entries; keys view the manifest's own strings.
using NameIndex = std::unordered_map<std::string_view, std::size_t>;

// verify_manifest(), filling `index` (cleared first) as a by-product.
void verify_manifest(const Manifest& manifest, std::uint64_t payload_bytes, NameIndex& index);

}  // namespace tensorbucket::detail
