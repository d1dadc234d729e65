#include "text.hpp"

#include <iomanip>

namespace tensorbucket::text {

std::ostream& operator<<(std::ostream& out, Quoted quoted) {
  out << '\'';
  for (char c : quoted.name) {
    auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      out << "\\x" << std::hex << std::setw(2) << std::setfill('0') << unsigned{byte}
          << std::dec << std::setfill(' ');
    } else {
      out << c;
    }
  }
  return out << '\'';
}

std::ostream& operator<<(std::ostream& out, Dims dims) {
  out << '[';
  for (std::size_t i = 0; i < dims.dims.size(); ++i) out << (i ? ", " : "") << dims.dims[i];
  return out << ']';
}

std::ostream& operator<<(std::ostream& out, DType dtype) {
  if (is_known(dtype)) return out << dtype_name(dtype);
  return out << "dtype #" << unsigned{static_cast<std::uint8_t>(dtype)};
}

}  // namespace tensorbucket::text
