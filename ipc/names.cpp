#include <ctime>

#include "base/text.hpp"
#include "control.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::ipc {

namespace {

// Whether `name` ends in ".slot<digits>.<digits>", as slot_segment_name() makes them.
bool ends_like_a_slot(std::string_view name) {
  auto digits_before = [&](std::size_t end) {  // where the run of digits ending at `end` starts
    auto start = end;
    while (start > 0 && name[start - 1] >= '0' && name[start - 1] <= '9') --start;
    return start;
  };
  auto epoch = digits_before(name.size());
  if (epoch == name.size() || epoch == 0 || name[epoch - 1] != '.') return false;
  auto slot = digits_before(epoch - 1);
  return slot != epoch - 1 && name.substr(0, slot).ends_with(".slot");
}

}  // namespace

void validate_channel_name(std::string_view channel) {
  auto allowed = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-';
  };
  bool valid = !channel.empty() && channel.size() <= kMaxChannelName && channel[0] != '.';
  for (char c : channel) valid = valid && allowed(c);
  if (!valid) {
    text::fail(ErrorCode::InvalidArgument, "channel name ", text::Quoted{channel},
               " is not 1-", kMaxChannelName, " characters of [A-Za-z0-9._-] (no leading dot)");
  }
  // "x.slot0.1" would name slot 0 of channel "x" (slot_segment_name()).
  if (ends_like_a_slot(channel)) {
    text::fail(ErrorCode::InvalidArgument, "channel name ", text::Quoted{channel},
               " ends like a slot's segment (.slot<s>.<epoch>), which it could be taken for");
  }
}

std::string control_segment_name(std::string_view channel) {
  return "tensorbucket." + std::string(channel);
}

std::string slot_segment_name(std::string_view channel, std::uint32_t slot, std::uint64_t epoch) {
  return control_segment_name(channel) + ".slot" + std::to_string(slot) + "." +
         std::to_string(epoch);
}

}  // namespace tensorbucket::ipc

namespace tensorbucket {

std::uint64_t monotonic_ns() noexcept {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(now.tv_nsec);
}

}  // namespace tensorbucket
