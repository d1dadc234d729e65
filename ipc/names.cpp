#include <ctime>

#include "serialize/text.hpp"
#include "control.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::ipc {

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
}

std::string control_segment_name(std::string_view channel) {
  return "tensorbucket." + std::string(channel);
}

std::string slot_segment_name(std::string_view channel, std::uint32_t slot, std::uint64_t epoch) {
  return control_segment_name(channel) + ".slot" + std::to_string(slot) + "." +
         std::to_string(epoch);
}

std::uint64_t monotonic_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000u +
         static_cast<std::uint64_t>(now.tv_nsec);
}

}  // namespace tensorbucket::ipc
