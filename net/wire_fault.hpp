// Internal: faults a test build of serve puts on the wire, to check that a relay refuses what
// it must (tests/meson.build builds tbucket-wire-fault with TENSORBUCKET_WIRE_FAULT). Elsewhere
// a WireFault is never faulty and costs nothing; the protocol code reads the same either way.
//
// TBUCKET_WIRE_FAULT=SEQUENCE flips one payload byte of that bucket on the wire, after serve
// hashed it; "padding:SEQUENCE" sets a byte between the frame and a whole payload instead;
// "nohash:SEQUENCE" never sends the hash of that bucket's payload in chunks (heartbeats go on).
#pragma once

#include "base/private.hpp"

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#ifdef TENSORBUCKET_WIRE_FAULT
#include <cstdlib>
#include <string>
#endif

namespace tensorbucket::net::detail {

class WireFault {
 public:
  // The fault for the bucket of `sequence`, as the environment asks for it.
  static WireFault for_bucket([[maybe_unused]] std::uint64_t sequence) {
    WireFault fault;
#ifdef TENSORBUCKET_WIRE_FAULT
    const char* asked = std::getenv("TBUCKET_WIRE_FAULT");
    std::string_view text = asked != nullptr ? asked : "";
    std::string_view how;
    for (std::string_view prefix : {"padding:", "nohash:"}) {
      if (text.starts_with(prefix)) {
        how = prefix;
        text.remove_prefix(prefix.size());
      }
    }
    if (text != std::to_string(sequence)) return fault;
    fault.flip_ = how.empty();
    fault.bad_padding_ = how == "padding:";
    fault.withhold_hash_ = how == "nohash:";
#endif
    return fault;
  }

  // What goes on the wire of `payload`: itself, or a copy in `flipped` with a byte flipped.
  std::span<const std::byte> on_wire(std::span<const std::byte> payload, std::vector<std::byte>& flipped) const {
    if (!flip_ || payload.empty()) return payload;
    flipped.assign(payload.begin(), payload.end());
    flipped[flipped.size() / 2] ^= std::byte{1};
    return flipped;
  }
  bool bad_padding() const noexcept { return bad_padding_; }
  bool withhold_hash() const noexcept { return withhold_hash_; }

 private:
  bool flip_ = false, bad_padding_ = false, withhold_hash_ = false;
};

}  // namespace tensorbucket::net::detail
