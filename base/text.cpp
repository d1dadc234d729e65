#include "base/text.hpp"

#include <iomanip>

namespace tensorbucket::text {

std::ostream& operator<<(std::ostream& out, Escaped escaped) {
  for (char c : escaped.text) {
    auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      out << "\\x" << std::hex << std::setw(2) << std::setfill('0') << unsigned{byte}
          << std::dec << std::setfill(' ');
    } else {
      out << c;
    }
  }
  return out;
}

std::ostream& operator<<(std::ostream& out, Quoted quoted) { return out << '\'' << Escaped{quoted.name} << '\''; }

std::ostream& operator<<(std::ostream& out, Dims dims) {
  out << '[';
  for (std::size_t i = 0; i < dims.dims.size(); ++i) out << (i ? ", " : "") << dims.dims[i];
  return out << ']';
}

// How many items of a kind a message names; details() has them all.
constexpr std::size_t kItemsShown = 3;

void Listing::summarize(std::ostream& out) const {
  if (!kind_.empty()) out << kind_ << ' ';
  for (std::size_t i = 0; i < items_.size() && i < kItemsShown; ++i) out << (i ? separator_ : "") << items_[i];
  if (items_.size() > kItemsShown) out << " and " << items_.size() - kItemsShown << " more";
}

void Listing::detail(std::ostream& out) const {
  for (const auto& item : items_) out << kind_ << (kind_.empty() ? "" : " ") << item << '\n';
}

void fail_if_listed(ErrorCode code, std::string_view what,
                    std::initializer_list<std::pair<std::string_view, const Listing*>> counted,
                    std::string_view hint) {
  std::ostringstream message, details;
  message << what << " (";
  bool first = true;
  for (const auto& [count_name, listing] : counted) {
    if (listing->empty()) continue;
    message << (first ? "" : ", ") << listing->size() << ' ' << count_name;
    first = false;
  }
  if (first) return;  // nothing listed
  message << "): ";
  first = true;
  for (const auto& [count_name, listing] : counted) {
    if (listing->empty()) continue;
    message << (first ? "" : "; ");
    listing->summarize(message);
    listing->detail(details);
    first = false;
  }
  message << hint;
  throw Error(code, message.str(), details.str());
}

}  // namespace tensorbucket::text
