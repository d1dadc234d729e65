// Internal: building error messages that name entries and values; every module's messages
// are made with these.
#pragma once

#include "base/private.hpp"

#include <charconv>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorbucket/dtype.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::text {

// Text with its control bytes written as \xNN, so that an error stays on one line.
struct Escaped {
  std::string_view text;
};
std::ostream& operator<<(std::ostream& out, Escaped escaped);

// A name in single quotes, Escaped.
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

// The message `parts` make, streamed in turn: for an Error made here and thrown elsewhere.
template <class... Parts>
std::string message(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

template <class... Parts>
[[noreturn]] void fail(ErrorCode code, const Parts&... parts) {
  throw Error(code, message(parts...));
}

// The text of strings and integers joined without a stream: for words made where a stream
// cannot be (a producer out of descriptors words why it waits, and a stream there trips
// UBSan's type check, which needs a pipe).
inline void append(std::string& out, std::string_view part) { out += part; }
template <std::integral Integer>
  requires(!std::same_as<Integer, bool> && !std::same_as<Integer, char>)
void append(std::string& out, Integer value) {
  char digits[24];
  auto end = std::to_chars(digits, digits + sizeof digits, value).ptr;
  out.append(digits, end);
}
template <class... Parts>
std::string joined(const Parts&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}

// Problems of one kind ("missing" names), for an error that may list hundreds: its message
// shows the first few of each kind after the counts, Error::details() every one.
class Listing {
 public:
  // `kind` leads the listing ("missing 'a', 'b'"); items that are sentences of their own
  // ("'w' has dtype f32, expected f16") go without one, apart by "; ".
  explicit Listing(std::string kind = {}, std::string separator = ", ")
      : kind_(std::move(kind)), separator_(std::move(separator)) {}

  template <class... Parts>
  void add(const Parts&... parts) {
    std::ostringstream item;
    (item << ... << parts);
    items_.push_back(item.str());
  }
  bool empty() const { return items_.empty(); }
  std::size_t size() const { return items_.size(); }

  // "missing 'a', 'b', 'c' and 9 more"
  void summarize(std::ostream& out) const;
  // One line per item: "missing 'a'\n".
  void detail(std::ostream& out) const;

 private:
  std::string kind_;
  std::string separator_;
  std::vector<std::string> items_;
};

// Throws Error(code) with the message "`what` (12 missing, 1 unexpected): missing 'a', 'b',
// 'c' and 9 more; unexpected 'x'`hint`", and details listing every item. Nothing when every
// listing is empty. `counted` names each listing's count, in order ("missing", "unexpected").
void fail_if_listed(ErrorCode code, std::string_view what,
                    std::initializer_list<std::pair<std::string_view, const Listing*>> counted,
                    std::string_view hint = {});

}  // namespace tensorbucket::text
