// The front door's messages and serve's end of it, without I/O (door.hpp).
#include "door.hpp"

#include <algorithm>
#include <cstring>

#include "base/text.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::net::detail {

std::vector<std::byte> door_message(DoorKind kind, std::span<const std::byte> body) {
  DoorHeader header{kind, {}, static_cast<std::uint32_t>(body.size())};
  std::vector<std::byte> message(sizeof header + body.size());
  std::memcpy(message.data(), &header, sizeof header);
  if (!body.empty()) std::memcpy(message.data() + sizeof header, body.data(), body.size());
  return message;
}

std::vector<std::byte> refusal_message(Refusal reason, std::string_view why) {
  std::vector<std::byte> body(1 + std::min(why.size(), kMaxRefusalBytes - 1));
  body[0] = static_cast<std::byte>(reason);
  std::memcpy(body.data() + 1, why.data(), body.size() - 1);
  return door_message(DoorKind::Refused, body);
}

void DoorReader::expect(DoorKind kind, std::string_view name, std::size_t least, std::size_t most, bool or_refusal) {
  kind_ = kind;
  name_ = name;
  least_ = least;
  most_ = most;
  or_refusal_ = or_refusal;
  have_header_ = false;
  header_ = {};
  body_.clear();
  have_ = 0;
}

std::span<std::byte> DoorReader::room() noexcept {
  if (!have_header_) return std::span(header_bytes_).subspan(have_);
  return std::span(body_).subspan(have_ - sizeof(DoorHeader));
}

void DoorReader::got(std::size_t count) {
  have_ += std::min(count, room().size());
  if (have_header_ || have_ < sizeof(DoorHeader)) return;
  std::memcpy(&header_, header_bytes_.data(), sizeof header_);
  auto fail = [](const auto&... parts) { text::fail(ErrorCode::NetworkError, parts...); };
  bool refusal = or_refusal_ && header_.kind == DoorKind::Refused;
  if (header_.kind != kind_ && !refusal) {
    fail("a message of kind ", static_cast<int>(header_.kind), " where a ", name_, " was due");
  }
  auto least = refusal ? std::size_t{1} : least_, most = refusal ? kMaxRefusalBytes : most_;
  std::string_view what = refusal ? std::string_view("refusal") : std::string_view(name_);
  if (header_.reserved != decltype(header_.reserved){}) fail("a ", what, " with its reserved bytes set");
  if (header_.length < least || header_.length > most) {
    if (least == most) fail("a ", what, " of ", header_.length, " bytes (", least, " are due)");
    fail("a ", what, " of ", header_.length, " bytes (", least, " to ", most, " are due)");
  }
  body_.resize(header_.length);  // bounded just above
  have_header_ = true;
}

std::span<const std::byte> DoorReader::body() const noexcept {
  return done() ? std::span<const std::byte>(body_) : std::span<const std::byte>();
}

ServerDoor::ServerDoor(std::string_view token, std::uint64_t key) : token_(token), key_(key) {
  random_bytes(nonce_.data(), nonce_.size());
  out_ = door_message(DoorKind::Challenge, Challenge{kMagic, kProtocolVersion, 0, key_, nonce_});
  reader_.expect(DoorKind::Proof, "proof", sizeof(ProofMessage), sizeof(ProofMessage), false);
}

std::span<const std::byte> ServerDoor::output() const noexcept { return std::span(out_).subspan(out_sent_); }

void ServerDoor::sent(std::size_t count) noexcept {
  out_sent_ = std::min(out_sent_ + count, out_.size());
  if (out_sent_ == out_.size()) {
    out_.clear();
    out_sent_ = 0;
  }
}

std::span<std::byte> ServerDoor::room() noexcept {
  return state_ == State::Proving || state_ == State::Addressing ? reader_.room() : std::span<std::byte>();
}

void ServerDoor::got(std::size_t count) {
  if (room().empty()) return;  // no bytes were due
  try {
    reader_.got(count);
  } catch (const Error& e) {
    return refuse(Refusal::Other, text::message("sent ", e.what()));
  }
  if (!reader_.done()) return;
  if (state_ == State::Addressing) {
    state_ = State::Done;
    return;
  }
  ProofMessage proof{};
  std::memcpy(&proof, reader_.body().data(), sizeof proof);
  if (proof.magic != kMagic) return refuse(Refusal::Other, "not a tensorbucket relay");
  if (proof.version != kProtocolVersion) {
    return refuse(Refusal::Other, text::message("protocol version ", proof.version, ", not ", kProtocolVersion));
  }
  // Refused, as in the header: a later version may give it a meaning an older serve must not ignore.
  if (proof.reserved != 0) return refuse(Refusal::Other, "the proof's reserved field is not zero");
  if (!same_digest(proof.proof, client_proof(token_, nonce_, key_))) {
    wrong_token_ = true;
    return refuse(Refusal::WrongToken, "wrong token");
  }
  peer_nonce_ = proof.nonce;
  state_ = State::Proved;
}

void ServerDoor::welcome(std::string_view channel, std::span<const std::byte> worker_address) {
  if (state_ != State::Proved) return;
  Welcome welcome{server_proof(token_, peer_nonce_, key_), 0, {}};
  welcome.channel_bytes = static_cast<std::uint32_t>(std::min(channel.size(), welcome.channel.size()));
  std::memcpy(welcome.channel.data(), channel.data(), welcome.channel_bytes);
  auto message = door_message(DoorKind::Welcome, welcome);
  auto address = door_message(DoorKind::Address, worker_address);
  out_.insert(out_.end(), message.begin(), message.end());
  out_.insert(out_.end(), address.begin(), address.end());
  reader_.expect(DoorKind::Address, "worker address", 1, kMaxWorkerAddress, false);
  state_ = State::Addressing;
}

void ServerDoor::refuse(Refusal reason, std::string why) {
  if (state_ == State::Closing) return;
  auto message = refusal_message(reason, why);
  out_.insert(out_.end(), message.begin(), message.end());
  why_ = std::move(why);
  state_ = State::Closing;
}

}  // namespace tensorbucket::net::detail
