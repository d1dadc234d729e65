// libFuzzer target: arbitrary bytes as a manifest and as a frame. Whatever decodes and
// verifies must round-trip and yield views inside the payload; everything else must be a
// typed Error. Any other exception, crash or sanitizer report is a finding. The outcome names
// the error code of each half, for the corpus replay.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "fuzz_target.hpp"
#include "tensorbucket/tensorbucket.hpp"

using namespace tensorbucket;

namespace {

const AlignedBuffer& zero_payload() {
  static const AlignedBuffer payload = [] {
    AlignedBuffer buffer(64 << 10);
    std::memset(buffer.span().data(), 0, buffer.size());
    return buffer;
  }();
  return payload;
}

// Reads every byte the views expose, so a view past the payload trips ASan.
void touch(const BucketView& view) {
  unsigned sum = 0;
  for (std::size_t i = 0; i < view.size(); ++i) {
    for (auto b : view[i].bytes) sum += static_cast<unsigned>(b);
  }
  if (sum != 0) std::abort();  // the payload is all zeros
}

}  // namespace

std::string fuzz_outcome(const std::uint8_t* data, std::size_t size) {
  std::span bytes(reinterpret_cast<const std::byte*>(data), size);
  const auto payload = zero_payload().span();
  std::string outcome = "manifest ";
  try {
    auto manifest = decode_manifest(bytes);
    verify_manifest(manifest, payload.size());
    if (!(decode_manifest(encode_manifest(manifest)) == manifest)) std::abort();
    touch(BucketView::open(encode_frame(manifest, payload), payload));
    outcome += "ok";
  } catch (const Error& e) {
    outcome += to_string(e.code());
  }
  outcome += ", frame ";
  try {
    touch(BucketView::open(bytes, payload));
    outcome += "ok";
  } catch (const Error& e) {
    outcome += to_string(e.code());
  }
  return outcome;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_outcome(data, size);
  return 0;
}
