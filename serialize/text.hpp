// Internal: building error messages that name entries and values.
#pragma once

#include <cstdint>
#include <ostream>
#include <span>
#include <sstream>
#include <string_view>

#include "tensorbucket/dtype.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::text {

// A name in single quotes; control bytes escaped so an error stays on one line.
struct Quoted {
  std::string_view name;
};
std::ostream& operator<<(std::ostream& out, Quoted quoted);

// A shape as "[2, 3]".
struct Dims {
  std::span<const std::int64_t> dims;
};
std::ostream& operator<<(std::ostream& out, Dims dims);

std::ostream& operator<<(std::ostream& out, DType dtype);

template <class... Parts>
[[noreturn]] void fail(ErrorCode code, const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw Error(code, message.str());
}

}  // namespace tensorbucket::text
