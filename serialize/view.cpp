// BucketView::open: the consumer's gate. Order matters: the cheap presence checks come
// first so a missing half is reported as such, the manifest is trusted only after its hash
// matches, and the payload is hashed only after the manifest proved it fits.
#include <cstring>

#include "tensorbucket/bucket.hpp"
#include "text.hpp"
#include "verified_manifest.hpp"
#include "verify.hpp"

namespace tensorbucket {

using text::fail;

namespace {

std::shared_ptr<const detail::VerifiedManifest> verify(std::span<const std::byte> encoded,
                                                       std::uint64_t payload_bytes) {
  auto verified = std::make_shared<detail::VerifiedManifest>();
  verified->manifest = decode_manifest(encoded);
  detail::verify_manifest(verified->manifest, payload_bytes, verified->index);
  verified->payload_bytes = payload_bytes;
  verified->bytes.assign(encoded.begin(), encoded.end());
  return verified;
}

}  // namespace

std::shared_ptr<const detail::VerifiedManifest> ManifestCache::verified(
    std::span<const std::byte> encoded, std::uint64_t hash, std::uint64_t payload_bytes) {
  auto found = entries_.find(hash);
  // memcmp, not std::equal: libstdc++ compares std::byte ranges one byte at a time.
  if (found != entries_.end() && found->second->payload_bytes == payload_bytes &&
      found->second->bytes.size() == encoded.size() &&
      std::memcmp(found->second->bytes.data(), encoded.data(), encoded.size()) == 0) {
    return found->second;
  }
  auto fresh = verify(encoded, payload_bytes);
  if (entries_.size() >= capacity_) entries_.clear();  // a producer has few distinct layouts
  entries_[hash] = fresh;
  return fresh;
}

BucketView BucketView::open(std::span<const std::byte> frame, std::span<const std::byte> payload,
                            const VerifyOptions& options, ManifestCache* cache) {
  auto header = read_header(frame);
  if (payload.data() == nullptr && header.payload_bytes != 0) {
    fail(ErrorCode::MissingPayload, "bucket has a manifest but no payload (", header.payload_bytes,
         " bytes expected)");
  }
  if (payload.size() < header.payload_bytes) {
    fail(ErrorCode::MissingPayload, "payload has ", payload.size(), " bytes but the header declares ",
         header.payload_bytes);
  }
  payload = payload.first(header.payload_bytes);

  auto encoded = manifest_bytes(header, frame);
  auto verified = cache != nullptr
                      ? cache->verified(encoded, header.manifest_xxh3, header.payload_bytes)
                      : verify(encoded, header.payload_bytes);
  if (options.expected != nullptr) check_expected(verified->manifest, *options.expected);
  if ((header.flags & kPayloadChecksum) && options.check_payload_checksum &&
      xxh3(payload) != header.payload_xxh3) {
    fail(ErrorCode::ChecksumMismatch, "payload hash 0x", std::hex, xxh3(payload),
         " does not match the header's 0x", header.payload_xxh3);
  }
  return BucketView(std::move(verified), payload);
}

BucketView::BucketView(std::shared_ptr<const detail::VerifiedManifest> verified,
                       std::span<const std::byte> payload)
    : verified_(std::move(verified)), payload_(payload) {}

const Manifest& BucketView::manifest() const noexcept {
  static const Manifest kEmpty;  // what a moved-from view shows
  return verified_ ? verified_->manifest : kEmpty;
}

TensorView BucketView::operator[](std::size_t index) const {
  const auto& entry = manifest().entries.at(index);
  return {entry.name, entry.dtype, entry.shape,
          payload_.subspan(entry.byte_offset, entry.byte_length), entry.group};
}

std::optional<TensorView> BucketView::find(std::string_view name) const {
  if (!verified_) return std::nullopt;
  auto found = verified_->index.find(name);
  if (!found) return std::nullopt;
  return (*this)[*found];
}

}  // namespace tensorbucket
