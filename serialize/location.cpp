#include <charconv>

#include "tensorbucket/bucket.hpp"
#include "base/text.hpp"

namespace tensorbucket {

std::string PayloadLocation::to_string() const {
  return on_host() ? "host" : "cuda:" + std::to_string(device);
}

PayloadLocation PayloadLocation::parse(std::string_view text) {
  if (text == "host" || text == "cpu") return host();
  if (text == "cuda") return cuda(0);
  constexpr std::string_view kCuda = "cuda:";
  if (text.starts_with(kCuda)) {
    auto digits = text.substr(kCuda.size());
    int device = -1;
    auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), device);
    if (error == std::errc{} && end == digits.data() + digits.size() && !digits.empty() && device >= 0) {
      return cuda(device);
    }
  }
  text::fail(ErrorCode::InvalidArgument, "payload location ", text::Quoted{text},
             " is not 'host', 'cuda' or 'cuda:N' (N a device ordinal)");
}

}  // namespace tensorbucket
