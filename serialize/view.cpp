// BucketView::open: the consumer's gate. Order matters: the cheap presence checks come
// first so a missing half is reported as such, the manifest is trusted only after its hash
// matches, and the payload is hashed only after the manifest proved it fits.
#include <cstring>

#include "block_hash.hpp"
#include "identity.hpp"
#include "tensorbucket/bucket.hpp"
#include "base/text.hpp"
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
  // Views read their identity from their own bytes; the layout carries none.
  verified->manifest.version = 0;
  verified->manifest.bucket_index = 0;
  verified->manifest.bucket_count = 1;
  verified->payload_bytes = payload_bytes;
  verified->bytes.assign(encoded.begin(), encoded.end());
  return verified;
}

}  // namespace

std::shared_ptr<const detail::VerifiedManifest> ManifestCache::verified(
    std::span<const std::byte> encoded, std::uint64_t payload_bytes) {
  // Too short to hold the identity fields: it cannot decode, so let verify() say why.
  if (encoded.size() < detail::kIdentityEnd) return verify(encoded, payload_bytes);
  // The same layout with any identity: every byte equal but the identity fields.
  auto same_layout = [&](const std::vector<std::byte>& known) {
    // memcmp, not std::equal: libstdc++ compares std::byte ranges one byte at a time.
    return known.size() == encoded.size() &&
           std::memcmp(known.data(), encoded.data(), detail::kIdentityOffset) == 0 &&
           std::memcmp(known.data() + detail::kIdentityEnd, encoded.data() + detail::kIdentityEnd,
                       encoded.size() - detail::kIdentityEnd) == 0;
  };
  auto hit = [&](const std::shared_ptr<const detail::VerifiedManifest>& known) {
    return known && known->payload_bytes == payload_bytes && same_layout(known->bytes);
  };
  // Usually the layout of the bucket before: a compare, without hashing for the lookup.
  if (hit(last_)) return last_;
  auto key = xxh3(encoded.subspan(detail::kIdentityEnd));
  auto found = entries_.find(key);
  if (found != entries_.end() && hit(found->second)) return last_ = found->second;
  auto fresh = verify(encoded, payload_bytes);
  if (entries_.size() >= capacity_) entries_.clear();  // a producer has few distinct layouts
  entries_[key] = fresh;
  return last_ = fresh;
}

BucketView BucketView::open(std::span<const std::byte> frame, std::span<const std::byte> payload,
                            const VerifyOptions& options, ManifestCache* cache,
                            PayloadLocation location) {
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
  auto verified = cache != nullptr ? cache->verified(encoded, header.payload_bytes)
                                  : verify(encoded, header.payload_bytes);
  // Decoded and verified above, so the fields are there; a cached layout did not check them.
  auto identity = detail::read_identity(encoded);
  detail::check_identity(identity);
  if (options.expected != nullptr) {
    if (identity.bucket_count == 1) {
      check_expected(verified->manifest, *options.expected);
    } else {
      check_expected_part(verified->manifest, *options.expected);
    }
  }
  if ((header.flags & kPayloadChecksum) && options.check_payload_checksum && location.on_host()) {
    auto hash = (header.flags & kPayloadBlockHash) ? block_hash::hash_of(payload) : xxh3(payload);
    if (hash != header.payload_xxh3) {
      fail(ErrorCode::ChecksumMismatch, "payload hash 0x", std::hex, hash, " does not match the header's 0x",
           header.payload_xxh3);
    }
  }
  std::optional<PayloadChecksum> checksum;
  if (header.flags & kPayloadChecksum) checksum = {header.payload_xxh3, (header.flags & kPayloadBlockHash) != 0};
  return BucketView(std::move(verified), payload, identity.version, identity.bucket_index,
                    identity.bucket_count, location, checksum);
}

BucketView::BucketView(std::shared_ptr<const detail::VerifiedManifest> verified,
                       std::span<const std::byte> payload, std::uint64_t version,
                       std::uint32_t bucket_index, std::uint32_t bucket_count,
                       PayloadLocation location, std::optional<PayloadChecksum> payload_checksum)
    : verified_(std::move(verified)),
      payload_(payload),
      version_(version),
      bucket_index_(bucket_index),
      bucket_count_(bucket_count),
      location_(location),
      payload_checksum_(payload_checksum) {}

std::vector<std::byte> BucketView::frame() const {
  if (!verified_) fail(ErrorCode::InvalidArgument, "frame() of a moved-from view");
  std::vector<std::byte> frame(sizeof(BucketHeader) + verified_->bytes.size());
  auto encoded = std::span(frame).subspan(sizeof(BucketHeader));
  std::memcpy(encoded.data(), verified_->bytes.data(), encoded.size());
  detail::stamp_identity(encoded, {version_, bucket_index_, bucket_count_});
  auto header = make_header(encoded, payload_);
  std::memcpy(frame.data(), &header, sizeof header);
  return frame;
}

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
  auto found = position(name);
  if (!found) return std::nullopt;
  return (*this)[*found];
}

std::optional<std::size_t> BucketView::position(std::string_view name) const {
  if (!verified_) return std::nullopt;
  return verified_->index.find(name);
}

}  // namespace tensorbucket
