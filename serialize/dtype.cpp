#include "tensorbucket/dtype.hpp"

#include <array>
#include <ostream>

#include "base/text.hpp"

namespace tensorbucket {
namespace {

struct DTypeInfo {
  std::string_view name;
  std::size_t itemsize;
};

// Indexed by the enumerator's value, which is also its wire value.
constexpr std::array<DTypeInfo, kDTypeCount> kTable{{
    {"BOOL", 1},
    {"U8", 1},
    {"I8", 1},
    {"I16", 2},
    {"U16", 2},
    {"I32", 4},
    {"U32", 4},
    {"I64", 8},
    {"U64", 8},
    {"F16", 2},
    {"BF16", 2},
    {"F32", 4},
    {"F64", 8},
    {"F8_E4M3", 1},
    {"F8_E5M2", 1},
}};
static_assert(static_cast<std::size_t>(DType::F8_E5M2) + 1 == kDTypeCount);

}  // namespace

bool is_known(DType dtype) noexcept { return static_cast<std::size_t>(dtype) < kDTypeCount; }

std::size_t itemsize(DType dtype) noexcept {
  return is_known(dtype) ? kTable[static_cast<std::size_t>(dtype)].itemsize : 0;
}

std::string_view dtype_name(DType dtype) noexcept {
  return is_known(dtype) ? kTable[static_cast<std::size_t>(dtype)].name : "?";
}

// Declared with the message kit (base/text.hpp): the dtypes are this module's.
std::ostream& text::operator<<(std::ostream& out, DType dtype) {
  if (is_known(dtype)) return out << dtype_name(dtype);
  return out << "dtype #" << unsigned{static_cast<std::uint8_t>(dtype)};
}

std::optional<DType> dtype_from_name(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kTable.size(); ++i) {
    if (kTable[i].name == name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

}  // namespace tensorbucket
