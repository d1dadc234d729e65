// Internal: verification that also hands back the name index it builds on the way.
#pragma once

#include "base/private.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "name_index.hpp"
#include "tensorbucket/manifest.hpp"

namespace tensorbucket::detail {

// BadName unless `name` is non-empty and within kMaxNameBytes; `what` and `position`
// ("entry", 3) identify an empty one in the message.
void check_name(std::string_view name, std::size_t position, const char* what);

// The checks a tensor's description passes wherever it comes from, a builder call or a
// received manifest: UnsupportedDtype, then BadShape (rank, negative dims, overflow).
// Returns numel x itemsize.
std::uint64_t check_tensor(std::string_view name, DType dtype,
                           std::span<const std::int64_t> shape);

// verify_manifest(), building `index` over manifest.entries as a by-product.
void verify_manifest(const Manifest& manifest, std::uint64_t payload_bytes, NameIndex& index);

}  // namespace tensorbucket::detail
