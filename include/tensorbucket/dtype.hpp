// Element types, named as in safetensors so the same names work in every language and file.
//
// Invariant: every enumerator has a name and an item size; values are stable on the wire
// (a manifest stores the enumerator's value as one byte), so new types are only appended.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace tensorbucket {

enum class DType : std::uint8_t {
  BOOL = 0,
  U8,
  I8,
  I16,
  U16,
  I32,
  U32,
  I64,
  U64,
  F16,
  BF16,
  F32,
  F64,
  F8_E4M3,
  F8_E5M2,
};

inline constexpr std::size_t kDTypeCount = 15;

// False for a value outside the table (e.g. a byte read from a hostile manifest).
bool is_known(DType dtype) noexcept;

// Bytes per element; 0 for an unknown dtype.
std::size_t itemsize(DType dtype) noexcept;

// The safetensors name ("BF16"); "?" for an unknown dtype.
std::string_view dtype_name(DType dtype) noexcept;

// Parses a safetensors name; nullopt when unknown.
std::optional<DType> dtype_from_name(std::string_view name) noexcept;

}  // namespace tensorbucket
