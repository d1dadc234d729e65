#include "tensorbucket/header.hpp"

#ifdef TENSORBUCKET_XXH3_DISPATCH
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif

#include <algorithm>
#include <cstring>

#include "tensorbucket/error.hpp"
#include "base/text.hpp"

namespace tensorbucket {

using text::fail;

std::uint64_t xxh3(std::span<const std::byte> bytes) noexcept {
#ifdef TENSORBUCKET_XXH3_DISPATCH
  return XXH3_64bits_dispatch(bytes.data(), bytes.size());  // the same hash, vectorised
#else
  return XXH3_64bits(bytes.data(), bytes.size());
#endif
}

BucketHeader make_header(std::span<const std::byte> encoded_manifest,
                         std::span<const std::byte> payload, const EncodeOptions& options) {
  BucketHeader header{};
  header.magic = kHeaderMagic;
  header.layout_version = kHeaderLayoutVersion;
  header.flags = options.payload_checksum ? kPayloadChecksum : 0;
  header.manifest_bytes = encoded_manifest.size();
  header.manifest_xxh3 = xxh3(encoded_manifest);
  header.payload_bytes = payload.size();
  header.payload_xxh3 = options.payload_checksum ? xxh3(payload) : 0;
  return header;
}

std::vector<std::byte> encode_frame(const Manifest& manifest, std::span<const std::byte> payload,
                                    const EncodeOptions& options) {
  auto manifest_bytes = encode_manifest(manifest);
  auto header = make_header(manifest_bytes, payload, options);
  std::vector<std::byte> frame(sizeof header + manifest_bytes.size());
  std::memcpy(frame.data(), &header, sizeof header);
  std::memcpy(frame.data() + sizeof header, manifest_bytes.data(), manifest_bytes.size());
  return frame;
}

BucketHeader read_header(std::span<const std::byte> frame) {
  if (frame.empty()) fail(ErrorCode::MissingManifest, "bucket has no manifest (empty frame)");
  if (frame.size() < sizeof(BucketHeader)) {
    fail(ErrorCode::HeaderCorrupt, "frame has ", frame.size(), " bytes, less than the ",
         sizeof(BucketHeader), "-byte header");
  }
  BucketHeader header;
  std::memcpy(&header, frame.data(), sizeof header);
  if (header.magic != kHeaderMagic) {
    fail(ErrorCode::HeaderCorrupt, "header magic is 0x", std::hex, header.magic,
         ", expected 0x", kHeaderMagic);
  }
  if (header.layout_version != kHeaderLayoutVersion) {
    fail(ErrorCode::HeaderCorrupt, "header layout version ", header.layout_version,
         " is not supported (this build reads version ", kHeaderLayoutVersion, ')');
  }
  if ((header.flags & ~kKnownHeaderFlags) != 0) {
    fail(ErrorCode::HeaderCorrupt, "header has unknown flags 0x", std::hex, header.flags);
  }
  if (!(header.flags & kPayloadChecksum) && header.payload_xxh3 != 0) {
    fail(ErrorCode::HeaderCorrupt, "header has a payload hash but no payload checksum flag");
  }
  if ((header.flags & kPayloadBlockHash) && !(header.flags & kPayloadChecksum)) {
    fail(ErrorCode::HeaderCorrupt, "header names the block hash but has no payload checksum flag");
  }
  if (std::any_of(std::begin(header.reserved), std::end(header.reserved),
                  [](std::uint8_t b) { return b != 0; })) {
    fail(ErrorCode::HeaderCorrupt, "header has non-zero reserved bytes");
  }
  if (header.manifest_bytes == 0) {
    fail(ErrorCode::MissingManifest, "bucket header declares an empty manifest");
  }
  if (header.manifest_bytes > kMaxManifestBytes) {
    fail(ErrorCode::HeaderCorrupt, "header declares a ", header.manifest_bytes,
         "-byte manifest; the limit is ", kMaxManifestBytes);
  }
  if (header.payload_bytes > kMaxPayloadBytes) {
    fail(ErrorCode::HeaderCorrupt, "header declares a ", header.payload_bytes,
         "-byte payload; the limit is ", kMaxPayloadBytes);
  }
  return header;
}

std::span<const std::byte> manifest_bytes(const BucketHeader& header,
                                          std::span<const std::byte> frame) {
  auto body = frame.subspan(std::min(frame.size(), sizeof(BucketHeader)));
  if (body.size() != header.manifest_bytes) {
    fail(ErrorCode::ManifestCorrupt, "frame carries ", body.size(),
         " manifest bytes but its header declares ", header.manifest_bytes);
  }
  if (xxh3(body) != header.manifest_xxh3) {
    fail(ErrorCode::ChecksumMismatch, "manifest hash 0x", std::hex, xxh3(body),
         " does not match the header's 0x", header.manifest_xxh3);
  }
  return body;
}

}  // namespace tensorbucket
