// BucketView::open: the consumer's gate. Order matters: the cheap presence checks come
// first so a missing half is reported as such, the manifest is trusted only after its hash
// matches, and the payload is hashed only after the manifest proved it fits.
#include "tensorbucket/bucket.hpp"
#include "text.hpp"
#include "name_index.hpp"
#include "verify.hpp"

namespace tensorbucket {

using text::fail;

BucketView BucketView::open(std::span<const std::byte> frame, std::span<const std::byte> payload,
                            const VerifyOptions& options) {
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

  BucketView view;
  view.manifest_ = decode_manifest(manifest_bytes(header, frame));
  detail::verify_manifest(view.manifest_, header.payload_bytes, *view.index_);
  if (options.expected != nullptr) check_expected(view.manifest_, *options.expected);
  if ((header.flags & kPayloadChecksum) && options.check_payload_checksum &&
      xxh3(payload) != header.payload_xxh3) {
    fail(ErrorCode::ChecksumMismatch, "payload hash 0x", std::hex, xxh3(payload),
         " does not match the header's 0x", header.payload_xxh3);
  }
  view.payload_ = payload;
  return view;
}

BucketView::BucketView() : index_(std::make_unique<detail::NameIndex>()) {}
BucketView::BucketView(BucketView&&) noexcept = default;
BucketView& BucketView::operator=(BucketView&&) noexcept = default;
BucketView::~BucketView() = default;

TensorView BucketView::operator[](std::size_t index) const {
  const auto& entry = manifest_.entries.at(index);
  return {entry.name, entry.dtype, entry.shape,
          payload_.subspan(entry.byte_offset, entry.byte_length), entry.group};
}

std::optional<TensorView> BucketView::find(std::string_view name) const {
  if (!index_) return std::nullopt;  // a moved-from view
  auto found = index_->find(name);
  if (!found) return std::nullopt;
  return (*this)[*found];
}

}  // namespace tensorbucket
