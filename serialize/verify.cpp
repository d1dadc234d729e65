// The well-formedness rules of docs/format.md ("Verification", rules 2, 3 and 5). Each check
// runs before anything that relies on it: sizes are proven overflow-free before they are
// compared, names are indexed before groups refer to them.
#include "verify.hpp"

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "identity.hpp"
#include "tensorbucket/error.hpp"
#include "base/text.hpp"

namespace tensorbucket {

using text::Dims;
using text::fail;
using text::Quoted;
using text::operator<<;

std::optional<std::uint64_t> checked_byte_length(DType dtype,
                                                 std::span<const std::int64_t> shape) noexcept {
  std::uint64_t total = itemsize(dtype);
  for (auto dim : shape) {
    // Every dim is bounded on its own too, so that numel() of an empty tensor (a zero dim
    // beside a huge one) cannot overflow either.
    if (dim < 0 || static_cast<std::uint64_t>(dim) > kMaxPayloadBytes ||
        __builtin_mul_overflow(total, static_cast<std::uint64_t>(dim), &total)) {
      return std::nullopt;
    }
  }
  if (total > kMaxPayloadBytes) return std::nullopt;
  return total;
}

void detail::check_name(std::string_view name, std::size_t position, const char* what) {
  if (name.empty()) fail(ErrorCode::BadName, what, ' ', position, " has an empty name");
  if (name.size() > kMaxNameBytes) {
    fail(ErrorCode::BadName, what, " name ", Quoted{name.substr(0, 64)}, "... is ", name.size(),
         " bytes long; the limit is ", kMaxNameBytes);
  }
}

std::uint64_t detail::check_tensor(std::string_view name, DType dtype,
                                   std::span<const std::int64_t> shape) {
  if (!is_known(dtype)) {
    fail(ErrorCode::UnsupportedDtype, "entry ", Quoted{name}, " has unknown ", dtype);
  }
  if (shape.size() > kMaxRank) {
    fail(ErrorCode::BadShape, "entry ", Quoted{name}, " has ", shape.size(),
         " dims; the limit is ", kMaxRank);
  }
  auto byte_length = checked_byte_length(dtype, shape);
  if (!byte_length) {
    fail(ErrorCode::BadShape, "entry ", Quoted{name}, " has shape ", Dims{shape},
         " with a negative dim or a size past ", kMaxPayloadBytes, " bytes");
  }
  return *byte_length;
}

namespace {

using detail::check_name;

void check_entry(const ManifestEntry& entry, std::uint64_t payload_bytes) {
  auto expected_length = detail::check_tensor(entry.name, entry.dtype, entry.shape);
  if (expected_length != entry.byte_length) {
    fail(ErrorCode::BadShape, "entry ", Quoted{entry.name}, " of ", entry.dtype, ' ',
         Dims{entry.shape}, " needs ", expected_length, " bytes but declares ",
         entry.byte_length);
  }
  if (entry.byte_offset % kPayloadAlignment != 0) {
    fail(ErrorCode::Misaligned, "entry ", Quoted{entry.name}, " starts at byte ",
         entry.byte_offset, ", not a multiple of ", kPayloadAlignment);
  }
  // byte_length <= kMaxPayloadBytes was proven above, so only the offset can overflow.
  if (entry.byte_offset > payload_bytes || entry.byte_length > payload_bytes - entry.byte_offset) {
    fail(ErrorCode::OutOfBounds, "entry ", Quoted{entry.name}, " spans bytes [",
         entry.byte_offset, ", ", entry.byte_offset + entry.byte_length,
         ") but the payload has ", payload_bytes, " bytes");
  }
}

void fail_overlap(const ManifestEntry& previous, const ManifestEntry& current) {
  fail(ErrorCode::Overlap, "entry ", Quoted{current.name}, " at bytes [", current.byte_offset,
       ", ", current.byte_offset + current.byte_length, ") overlaps entry ",
       Quoted{previous.name}, " at bytes [", previous.byte_offset, ", ",
       previous.byte_offset + previous.byte_length, ')');
}

// Empty entries occupy no bytes and cannot overlap anything.
void check_no_overlap(const Manifest& manifest) {
  // Builders emit entries in offset order: check that order in place, and sort a copy of the
  // pointers only for a producer that did not.
  const ManifestEntry* previous = nullptr;
  bool sorted = true;
  for (const auto& entry : manifest.entries) {
    if (entry.byte_length == 0) continue;
    if (previous != nullptr) {
      if (entry.byte_offset < previous->byte_offset) {
        sorted = false;
        break;
      }
      if (previous->byte_offset + previous->byte_length > entry.byte_offset) {
        fail_overlap(*previous, entry);
      }
    }
    previous = &entry;
  }
  if (sorted) return;

  std::vector<const ManifestEntry*> by_offset;
  by_offset.reserve(manifest.entries.size());
  for (const auto& entry : manifest.entries) {
    if (entry.byte_length != 0) by_offset.push_back(&entry);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->byte_offset < b->byte_offset;
  });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i - 1]->byte_offset + by_offset[i - 1]->byte_length > by_offset[i]->byte_offset) {
      fail_overlap(*by_offset[i - 1], *by_offset[i]);
    }
  }
}

void check_groups(const Manifest& manifest, const detail::NameIndex& index) {
  if (manifest.groups.size() > kMaxGroups) {
    fail(ErrorCode::ManifestCorrupt, "manifest has ", manifest.groups.size(),
         " groups; the limit is ", kMaxGroups);
  }
  // Each entry must be claimed by exactly the group its `group` field names. Most buckets
  // declare no groups; they skip the claim table.
  std::vector<const ManifestGroup*> claimed_by(
      manifest.groups.empty() ? 0 : manifest.entries.size(), nullptr);
  std::unordered_set<std::string_view> group_names;
  for (std::size_t g = 0; g < manifest.groups.size(); ++g) {
    const auto& group = manifest.groups[g];
    check_name(group.name, g, "group");
    if (!group_names.insert(group.name).second) {
      fail(ErrorCode::DuplicateName, "group ", Quoted{group.name}, " is declared twice");
    }
    for (const auto& member : group.members) {
      auto found = index.find(member);
      if (!found) {
        fail(ErrorCode::IncompleteGroup, "group ", Quoted{group.name}, " is missing member ",
             Quoted{member});
      }
      const auto& entry = manifest.entries[*found];
      if (claimed_by[*found] != nullptr || entry.group != group.name) {
        fail(ErrorCode::IncompleteGroup, "group ", Quoted{group.name}, " lists entry ",
             Quoted{member}, " which declares group ", Quoted{entry.group});
      }
      claimed_by[*found] = &group;
    }
  }
  for (std::size_t i = 0; i < manifest.entries.size(); ++i) {
    const auto& entry = manifest.entries[i];
    if (!entry.group.empty() && (claimed_by.empty() || claimed_by[i] == nullptr)) {
      fail(ErrorCode::IncompleteGroup, "entry ", Quoted{entry.name}, " declares group ",
           Quoted{entry.group}, " which does not list it");
    }
  }
}

}  // namespace

void detail::verify_manifest(const Manifest& manifest, std::uint64_t payload_bytes,
                             NameIndex& index) {
  if (manifest.entries.size() > kMaxEntries) {
    fail(ErrorCode::ManifestCorrupt, "manifest has ", manifest.entries.size(),
         " entries; the limit is ", kMaxEntries);
  }
  check_identity({manifest.version, manifest.bucket_index, manifest.bucket_count});
  for (std::size_t i = 0; i < manifest.entries.size(); ++i) {
    check_name(manifest.entries[i].name, i, "entry");
    check_entry(manifest.entries[i], payload_bytes);
  }
  if (auto repeated = index.build(manifest.entries)) {
    fail(ErrorCode::DuplicateName, "entry name ", Quoted{manifest.entries[*repeated].name},
         " appears twice");
  }
  check_no_overlap(manifest);
  check_groups(manifest, index);
}

void verify_manifest(const Manifest& manifest, std::uint64_t payload_bytes) {
  detail::NameIndex index;
  detail::verify_manifest(manifest, payload_bytes, index);
}

namespace {

// check_expected(), and with `whole` false, check_expected_part(): no name is missing then.
void compare_expected(const Manifest& actual, const Manifest& expected, bool whole) {
  // A consumer checks every bucket against the same model, which lists the same entries in the
  // same order: compared pairwise, that case needs no index.
  auto same = [](const ManifestEntry& a, const ManifestEntry& b) {
    return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape;
  };
  if (whole && std::ranges::equal(actual.entries, expected.entries, same)) return;

  detail::NameIndex wanted;
  if (auto repeated = wanted.build(expected.entries)) {
    // The index stops at the first repeat, so comparing against it would mislead.
    fail(ErrorCode::InvalidArgument, "expected manifest lists ",
         Quoted{expected.entries[*repeated].name}, " twice");
  }

  // Every problem, by kind, like a strict load_state_dict; the message shows the first few.
  text::Listing missing("missing"), unexpected("unexpected"), mismatched({}, "; ");
  std::vector<bool> seen(expected.entries.size(), false);
  for (const auto& entry : actual.entries) {
    auto found = wanted.find(entry.name);
    if (!found) {
      unexpected.add(Quoted{entry.name});
      continue;
    }
    seen[*found] = true;
    const auto& want = expected.entries[*found];
    bool dtype = want.dtype != entry.dtype, shape = want.shape != entry.shape;  // one item a name
    if (dtype && shape) {
      mismatched.add(Quoted{entry.name}, " has dtype ", entry.dtype, ", expected ", want.dtype, ", and shape ",
                     Dims{entry.shape}, ", expected ", Dims{want.shape});
    } else if (dtype) {
      mismatched.add(Quoted{entry.name}, " has dtype ", entry.dtype, ", expected ", want.dtype);
    } else if (shape) {
      mismatched.add(Quoted{entry.name}, " has shape ", Dims{entry.shape}, ", expected ", Dims{want.shape});
    }
  }
  for (std::size_t i = 0; i < expected.entries.size() && whole; ++i) {
    if (!seen[i]) missing.add(Quoted{expected.entries[i].name});
  }
  text::fail_if_listed(ErrorCode::ManifestMismatch, "bucket does not match the expected manifest",
                       {{"missing", &missing}, {"unexpected", &unexpected}, {"mismatched", &mismatched}});
}

}  // namespace

void check_expected(const Manifest& actual, const Manifest& expected) { compare_expected(actual, expected, true); }

void check_expected_part(const Manifest& actual, const Manifest& expected) {
  compare_expected(actual, expected, false);
}

}  // namespace tensorbucket
