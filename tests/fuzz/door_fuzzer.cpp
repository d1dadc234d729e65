// libFuzzer target: what a peer sends at the front door (net/door.hpp), the first bytes any
// connection to `--listen` reaches, and what a relay reads from whoever answers at its
// server's address. The input's first byte sets the size of the pieces the rest arrives in
// (as recv() may cut them anywhere), its second which end takes them:
// - serve's end, from a peer without the token: it must end refusing the peer (naming why) or
//   waiting for more; a proof never holds, since it is made with a fresh nonce;
// - serve's end, after a genuine proof (made here from the challenge): the input is what
//   follows it, the relay's worker address;
// - a relay's reader, expecting a challenge, then a welcome, then an address, as remote.cpp
//   reads them.
// Neither end may offer room past the message due, nor more than the most it may hold. Any
// exception but a NetworkError from the relay's reader, crash or sanitizer report is a
// finding. The outcome names where each ended.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fuzz_target.hpp"
#include "net/door.hpp"
#include "tensorbucket/error.hpp"

using namespace tensorbucket::net::detail;

namespace {

constexpr std::string_view kToken = "a token of sixteen bytes or more";

// Feeds `input` into room() and got() of `end`, `piece` bytes at most at a time, until it has
// no room; returns the bytes fed.
template <class End>
std::size_t feed(End& end, std::span<const std::uint8_t> input, std::size_t piece) {
  std::size_t fed = 0;
  while (fed < input.size()) {
    auto room = end.room();
    if (room.empty()) break;
    if (room.size() > sizeof(DoorHeader) + kMaxWorkerAddress) std::abort();
    auto count = std::min({room.size(), piece, input.size() - fed});
    std::memcpy(room.data(), input.data() + fed, count);
    fed += count;
    end.got(count);
  }
  return fed;
}

std::string serve_end(std::span<const std::uint8_t> input, std::size_t piece, bool proved) {
  ServerDoor door(kToken, 0x1234567 | 1);
  if (proved) {
    Challenge challenge{};
    std::memcpy(&challenge, door.output().data() + sizeof(DoorHeader), sizeof challenge);
    ProofMessage proof{kMagic, kProtocolVersion, 0, client_proof(kToken, challenge.nonce, challenge.key), {}};
    auto message = door_message(DoorKind::Proof, proof);
    feed(door, std::span(reinterpret_cast<const std::uint8_t*>(message.data()), message.size()), message.size());
    if (door.state() != ServerDoor::State::Proved) std::abort();
    door.welcome("fuzz", std::as_bytes(std::span("an address")));
  }
  feed(door, input, piece);
  switch (door.state()) {
    case ServerDoor::State::Proving:
      return "proving";
    case ServerDoor::State::Proved:
      std::abort();  // no input holds the token
    case ServerDoor::State::Addressing:
      return "addressing";
    case ServerDoor::State::Done:
      if (door.peer_address().empty() || door.peer_address().size() > kMaxWorkerAddress) std::abort();
      return "done, an address of " + std::to_string(door.peer_address().size()) + " bytes";
    case ServerDoor::State::Closing:
      // What goes out: the challenge, a welcome and an address, a refusal.
      if (door.output().size() > 4 * sizeof(DoorHeader) + sizeof(Challenge) + sizeof(Welcome) + 16 + kMaxRefusalBytes) {
        std::abort();
      }
      return std::string(door.wrong_token() ? "refused, wrong token: " : "refused: ") + door.why();
  }
  std::abort();
}

std::string relay_end(std::span<const std::uint8_t> input, std::size_t piece) {
  struct Due {
    DoorKind kind;
    const char* name;
    std::size_t least, most;
  };
  DoorReader reader;
  std::string outcome;
  for (auto due : {Due{DoorKind::Challenge, "challenge", sizeof(Challenge), sizeof(Challenge)},
                   Due{DoorKind::Welcome, "welcome", sizeof(Welcome), sizeof(Welcome)},
                   Due{DoorKind::Address, "worker address", 1, kMaxWorkerAddress}}) {
    reader.expect(due.kind, due.name, due.least, due.most, true);
    try {
      input = input.subspan(feed(reader, input, piece));
    } catch (const tensorbucket::Error& e) {
      return outcome + e.what();
    }
    if (!reader.done()) return outcome + "waiting for a " + due.name;
    if (reader.kind() == DoorKind::Refused) return outcome + "refused";
    if (reader.body().size() < due.least || reader.body().size() > due.most) std::abort();
    outcome += std::string(due.name) + ", ";
  }
  return outcome + "all read";
}

}  // namespace

std::string fuzz_outcome(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return "too short";
  std::size_t piece = data[0] % 97 + 1;
  auto input = std::span(data + 2, size - 2);
  switch (data[1] % 3) {
    case 0:
      return serve_end(input, piece, false);
    case 1:
      return "proved, " + serve_end(input, piece, true);
    default:
      return "relay: " + relay_end(input, piece);
  }
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_outcome(data, size);
  return 0;
}
