// Internal: verification that also hands back the name index it builds on the way.
#pragma once

#include <cstdint>

#include "name_index.hpp"
#include "tensorbucket/manifest.hpp"

namespace tensorbucket::detail {

// verify_manifest(), building `index` over manifest.entries as a by-product.
void verify_manifest(const Manifest& manifest, std::uint64_t payload_bytes, NameIndex& index);

}  // namespace tensorbucket::detail
