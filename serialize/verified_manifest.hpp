// Internal: a decoded manifest that passed every rule, with its name index, shared (immutable)
// by the views made from it and by a consumer's ManifestCache. It is a layout: shared by every
// bucket whose manifest differs only in its identity fields, which are left at their defaults
// here and kept by each BucketView.
#pragma once

#include "base/private.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

#include "name_index.hpp"
#include "tensorbucket/manifest.hpp"

namespace tensorbucket::detail {

struct VerifiedManifest {
  std::vector<std::byte> bytes;   // the encoding it was decoded from (any identity)
  std::uint64_t payload_bytes;    // the payload size its ranges were checked against
  Manifest manifest;
  NameIndex index;                // over manifest.entries, which never move
};

}  // namespace tensorbucket::detail
