// libFuzzer target: arbitrary bytes as the start of a safetensors file (safetensors.hpp). What
// parses must describe tensors that tile the file's data, sorted, of the size their dtype and
// shape make; everything else must be a typed Error. Any other exception,
// crash or sanitizer report is a finding. The outcome names the error code, or the count of
// tensors, for the corpus replay.
#include <cstdint>
#include <cstdlib>

#include "fuzz_target.hpp"
#include "tensorbucket/tensorbucket.hpp"

using namespace tensorbucket;

namespace {

// The invariants parse_header() promises.
void check(const safetensors::FileHeader& header, std::uint64_t file_bytes) {
  if (header.data_offset + header.data_bytes != file_bytes) std::abort();
  std::uint64_t last_end = 0;
  for (const auto& tensor : header.tensors) {
    if (tensor.begin != last_end || tensor.begin > tensor.end) std::abort();
    if (checked_byte_length(tensor.dtype, tensor.shape) != tensor.end - tensor.begin) std::abort();
    if (tensor.name.empty() || tensor.name.size() > kMaxNameBytes) std::abort();
    last_end = tensor.end;
  }
  if (last_end != header.data_bytes) std::abort();
}

}  // namespace

std::string fuzz_outcome(const std::uint8_t* data, std::size_t size) {
  std::span bytes(reinterpret_cast<const std::byte*>(data), size);
  // The file as long as the input, and as one with 4 KiB more data after it (bytes past the
  // last tensor: refused).
  std::string outcome;
  for (std::uint64_t extra : {std::uint64_t{0}, std::uint64_t{4096}}) {
    outcome += outcome.empty() ? "" : ", ";
    try {
      auto header = safetensors::parse_header(bytes, size + extra, "input");
      check(header, size + extra);
      outcome += std::to_string(header.tensors.size()) + " tensors";
    } catch (const Error& e) {
      outcome += to_string(e.code());
    }
  }
  return outcome;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_outcome(data, size);
  return 0;
}
