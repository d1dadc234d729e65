// The receiving side: a bucket at a time from a Server, verified before it is handed out.
#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <list>
#include <new>
#include <vector>

#include "base/text.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/net.hpp"
#include "door.hpp"
#include "socket.hpp"
#include "ucx.hpp"
#include "wire.hpp"

namespace tensorbucket::net {
namespace detail {

using namespace std::chrono_literals;
using text::Quoted;

// An acknowledgement under way: a list entry, so its bytes never move.
struct PendingAck {
  Ack ack;
  Request request;
};

struct RemoteState {
  std::string address;
  std::string channel;  // the one served
  ConnectOptions options;
  // Buffers UCX may still use until the worker is gone: declared before it.
  std::shared_ptr<AlignedBuffer> buffer;  // a payload that came in chunks
  std::shared_ptr<AlignedBuffer> inbox;   // a Bucket message, with its payload when it came whole
  std::array<std::byte, 64> scratch{};    // where a message refused unread goes; never read
  std::list<PendingAck> acks;
  Worker worker;
  Endpoint endpoint;
  std::uint64_t key = 0;
  Clock::time_point last_heard = Clock::now();
  std::uint64_t ordinal = 0;  // of the last bucket taken
  std::optional<std::pair<std::uint64_t, std::uint64_t>> last;  // (incarnation, sequence) taken
  ManifestCache cache;
  bool broken = false;

  RemoteState(std::string_view where, const ConnectOptions& connect, const SocketAddress& peer)
      : address(where), options(connect), worker(interface_towards(peer), peer.storage.ss_family) {}
  ~RemoteState() {
    detail::close(worker, endpoint, kCloseLimit);
    for (auto& pending : acks) pending.request.cancel();  // while the worker lives; the bytes go after it
  }

  // The link is not trusted further: closed, and every later call says so.
  void drop() noexcept {
    broken = true;
    detail::close(worker, endpoint, kCloseLimit);
  }
  template <class... Parts>
  [[noreturn]] void drop(ErrorCode code, const Parts&... message) {
    drop();
    text::fail(code, message...);
  }
  template <class... Parts>
  [[noreturn]] void lost(const Parts&... why) {
    drop(ErrorCode::NetworkError, "link to ", address, ": ", why...);
  }

  // Throws NetworkError when the link failed.
  void check_link() {
    if (endpoint.failed != UCS_OK) lost("failed: ", ucx().status_string(endpoint.failed));
  }

  // A refusal at the front door: Unauthorized for a wrong token (trying again will not help),
  // else NetworkError (the server was full, or this side too slow).
  [[noreturn]] void refused(std::span<const std::byte> message) {
    auto why = message.size() > 1 ? std::string_view(reinterpret_cast<const char*>(message.data()) + 1, message.size() - 1)
                                  : std::string_view("no reason given");
    bool wrong_token = !message.empty() && message[0] == static_cast<std::byte>(Refusal::WrongToken);
    // Sent before the server proved anything: quoted, so no byte of it reaches a log raw.
    drop(wrong_token ? ErrorCode::Unauthorized : ErrorCode::NetworkError, "refused by ", address, ": ", Quoted{why});
  }

  // The next message of `kind` taken whole into `into` (resized to it), waiting until `until`;
  // false at `until`. Longer than `limit` bytes: the link is dropped.
  bool take(Kind kind, std::vector<std::byte>& into, std::size_t limit, Clock::time_point until) {
    return take(kind, limit, until, [&](std::size_t length) {
      into.resize(length);
      return std::span(into);
    });
  }

  // The same, into the `length` bytes room(length) gives.
  template <class Room>
  bool take(Kind kind, std::size_t limit, Clock::time_point until, Room room) {
    for (;;) {
      check_link();
      std::size_t length = 0;
      if (auto* found = probe(worker.get(), tag(kind), kKindMask, &length)) {
        if (length > limit) {
          discard(found);
          lost("a message of ", length, " bytes where ", limit, " is the most");
        }
        auto receiving = receive(worker.get(), found, room(length));
        wait_for(receiving, Clock::now() + options.idle_timeout);
        last_heard = Clock::now();
        return true;
      }
      if (Clock::now() >= until) return false;
      // Short sleeps (UCX's wake-up event does not fire for every transport), shorter while
      // buckets keep coming: the wait for the next message is a bucket's latency.
      worker.wait(Clock::now() - last_heard < 100ms ? std::chrono::microseconds(100) : std::chrono::microseconds(2000));
    }
  }

  // A message taken off the queue that will not be read: received into `scratch`, cut short, so
  // that UCX lets go of it.
  void discard(ucp_tag_message_h message) noexcept {
    try {
      receive(worker.get(), message, scratch);
    } catch (const Error&) {
    }
  }

  void wait_for(Request& request, Clock::time_point until) {
    Pace pace(worker);
    try {
      while (!request.done()) {
        check_link();
        if (Clock::now() > until) lost("a transfer stalled");
        pace.step();
      }
    } catch (...) {
      rethrow_once_ended([&] { return request.ended(); });
    }
  }

  // Called from a catch block, with requests under way whose buffers the caller frees once
  // this throws: the link goes, by force, which ends them, and this waits (kCloseLimit at
  // most) until `ended()` says so, since until then UCX may still write there. Then throws
  // the exception caught, naming the link when it is the first news of its failure.
  template <class Ended>
  [[noreturn]] void rethrow_once_ended(Ended ended) {
    bool news = !broken;
    if (news) drop();
    auto until = Clock::now() + kCloseLimit;
    while (!ended() && Clock::now() < until) worker.progress();
    try {
      throw;
    } catch (const Error& e) {
      if (news && e.code() == ErrorCode::NetworkError) {
        text::fail(ErrorCode::NetworkError, "link to ", address, ": ", e.what());
      }
      throw;
    }
  }

  // Drops the heartbeats that came (a bounded number: a server sending nothing else must not
  // keep next() from its deadline), and fails the link on a message of a kind no server sends
  // after the handshake: no peer takes it, and it would stay in the queue, the oldest, for good.
  void skip_heartbeats() {
    std::vector<std::byte> beat;
    for (int skipped = 0; skipped < 64 && take(Kind::Heartbeat, beat, 64, Clock::now()); ++skipped) {
    }
    if (auto oldest = oldest_tag(worker.get())) {
      auto kind = static_cast<Kind>(*oldest >> 56);
      if (kind != Kind::Bucket && kind != Kind::Payload && kind != Kind::PayloadHash && kind != Kind::Heartbeat) {
        lost("a message of kind ", static_cast<int>(kind), ", which a server does not send now");
      }
    }
  }

  void silent_too_long() {
    if (Clock::now() - last_heard > options.idle_timeout) {
      lost("no word for ", options.idle_timeout.count(), " ms");
    }
  }

  // One message at the front door by `until`: `kind`, of `least` to `most` bytes, or a refusal
  // (which throws).
  std::span<const std::byte> door_message_in(const Socket& link, DoorReader& reader, DoorKind kind,
                                             std::string_view name, std::size_t least, std::size_t most,
                                             Clock::time_point until) {
    reader.expect(kind, name, least, most, true);
    try {
      read_message(link, reader, until);
    } catch (const Error& e) {
      lost(e.what());
    }
    if (reader.kind() == DoorKind::Refused) refused(reader.body());
    return reader.body();
  }

  // The front door (door.hpp), by `until`: serve's challenge, this side's proof, serve's
  // welcome (its proof and the channel's name, both checked) and worker address, this side's;
  // then the UCX endpoint, and the first message on it, serve's heartbeat.
  void handshake(const SocketAddress& where, Clock::time_point until, std::string_view token) {
    Socket link;
    try {
      link = connect_to(where, until);
    } catch (const Error& e) {
      lost(e.what());
    }
    DoorReader reader;
    auto bytes = door_message_in(link, reader, DoorKind::Challenge, "challenge", sizeof(Challenge), sizeof(Challenge), until);
    Challenge challenge{};
    std::memcpy(&challenge, bytes.data(), sizeof challenge);
    if (challenge.magic != kMagic) lost("not a tensorbucket server");
    if (challenge.version != kProtocolVersion) {
      lost("a tensorbucket server of protocol version ", challenge.version, ", not ", kProtocolVersion);
    }
    key = challenge.key;
    ProofMessage proof{kMagic, kProtocolVersion, 0, client_proof(token, challenge.nonce, key), {}};
    random_bytes(proof.nonce.data(), proof.nonce.size());
    try {
      send_all(link, door_message(DoorKind::Proof, proof), until);
    } catch (const Error& e) {
      lost(e.what());
    }
    bytes = door_message_in(link, reader, DoorKind::Welcome, "welcome", sizeof(Welcome), sizeof(Welcome), until);
    Welcome welcome{};
    std::memcpy(&welcome, bytes.data(), sizeof welcome);
    if (!same_digest(welcome.proof, server_proof(token, proof.nonce, key))) {
      drop(ErrorCode::Unauthorized, address, " did not prove it holds the token");
    }
    std::string_view served(welcome.channel.data(), std::min<std::size_t>(welcome.channel_bytes, welcome.channel.size()));
    if (!options.channel.empty() && served != options.channel) {
      drop(ErrorCode::ChannelMissing, address, " serves channel ", Quoted{served}, ", not ", Quoted{options.channel});
    }
    channel = served;
    bytes = door_message_in(link, reader, DoorKind::Address, "worker address", 1, kMaxWorkerAddress, until);
    try {
      send_all(link, door_message(DoorKind::Address, worker.address()), until);
      detail::connect(worker.get(), endpoint, bytes);
    } catch (const Error& e) {
      lost(e.what());
    }
    // serve closes the front door once it made its endpoint, or refuses there when it could not.
    reader.expect(DoorKind::Refused, "refusal", 1, kMaxRefusalBytes, false);
    bool door_open = true;
    while (!oldest_tag(worker.get())) {
      check_link();
      try {
        door_open = door_open && read_available(link, reader);
      } catch (const Error&) {
        door_open = false;  // a reset, or bytes that are no refusal: only UCX's link counts now
      }
      if (reader.done()) refused(reader.body());
      if (Clock::now() >= until) {
        lost("the server let this side in, but nothing came over UCX in time: are UCX's own ports between "
             "the hosts closed (a firewall)?");
      }
      worker.wait(std::chrono::microseconds(1000));
    }
    last_heard = Clock::now();
  }

  // Receives a payload's chunks into `payload` in order and returns their hash (wire.hpp).
  // Each chunk is asked for as soon as the server has sent word of it, kChunksInFlight ahead at
  // most, and hashed as soon as it is in, while the next ones travel. Each chunk has
  // idle_timeout (and its size at 10 MB/s) to come.
  std::uint64_t receive_payload(std::span<std::byte> payload, std::uint64_t chunk_bytes) {
    if (chunk_bytes < kMinChunkBytes || chunk_bytes > kMaxChunkBytes) lost("chunks of ", chunk_bytes, " bytes");
    auto allowance = std::chrono::milliseconds(static_cast<std::int64_t>(chunk_bytes / kSlowestBytesPerMs));
    auto chunk_at = [&](std::uint64_t at) { return payload.subspan(at, std::min(chunk_bytes, payload.size() - at)); };
    ChunkedHash hash(chunk_count(payload.size(), chunk_bytes));
    std::deque<Request> arriving;  // the chunks asked for, in order
    std::uint64_t asked = 0, hashed = 0;
    auto due = Clock::now() + options.idle_timeout + allowance;
    Pace pace(worker);
    try {
      while (hashed < payload.size()) {
        std::size_t length = 0;
        ucp_tag_message_h found = nullptr;
        while (asked < payload.size() && arriving.size() < kChunksInFlight &&
               (found = probe(worker.get(), tag(Kind::Payload), kAllBits, &length)) != nullptr) {
          auto chunk = chunk_at(asked);
          if (length != chunk.size()) {
            discard(found);
            lost("a chunk of ", length, " bytes where ", chunk.size(), " were due");
          }
          arriving.push_back(receive(worker.get(), found, chunk));
          asked += chunk.size();
        }
        if (!arriving.empty() && arriving.front().done()) {
          auto chunk = chunk_at(hashed);
          hash.add(chunk);
          hashed += chunk.size();
          arriving.pop_front();
          last_heard = Clock::now();
          due = last_heard + options.idle_timeout + allowance;
          continue;
        }
        check_link();
        if (Clock::now() > due) lost("no payload chunk within ", options.idle_timeout.count(), " ms");
        pace.step();
      }
    } catch (...) {
      // The receives under way write into `payload`, which the caller may give back once this throws.
      rethrow_once_ended([&] {
        return std::all_of(arriving.begin(), arriving.end(), [](const Request& r) { return r.ended(); });
      });
    }
    return hash.value();
  }

  // A Bucket message's room: `inbox` again when no bucket holds it (a payload that came whole
  // stays there), else a new one. Aligned, so that such a payload is.
  std::span<std::byte> inbox_room(std::size_t length) {
    if (!inbox || inbox.use_count() != 1 || inbox->size() < length) {
      inbox.reset();
      try {
        inbox = std::make_shared<AlignedBuffer>(std::max<std::size_t>(length, 1));
      } catch (const std::bad_alloc&) {
        lost("no memory for a message of ", length, " bytes");
      }
    }
    return inbox->span().first(length);
  }

  // The next Bucket message, taken whole into the inbox before `deadline` (heartbeats and
  // finished acknowledgements cleared on the way); empty at `deadline` or once interrupted.
  std::span<std::byte> take_announce(const Deadline& deadline) {
    // A payload that comes whole is one chunk at most, and within max_bucket_bytes before any
    // memory is taken for it.
    const std::size_t max_message =
        sizeof(BucketAnnounce) + kMaxFrameBytes + kPayloadAlignment + std::min(kChunkBytes, options.max_bucket_bytes);
    std::span<std::byte> received;
    for (;;) {
      try {
        acks.remove_if([](PendingAck& pending) { return pending.request.done(); });
      } catch (const Error& e) {
        lost("an acknowledgement: ", e.what());
      }
      skip_heartbeats();
      if (take(Kind::Bucket, max_message, std::min(deadline.at(), Clock::now() + 50ms),
               [&](std::size_t length) { return received = inbox_room(length); })) {
        return received;
      }
      silent_too_long();
      if (deadline.passed() || deadline.interrupted()) return {};
    }
  }

  // The announce at the start of a Bucket message, its every field checked against the message
  // and against what this side took before.
  BucketAnnounce read_announce(std::span<const std::byte> received) {
    BucketAnnounce announce{};
    if (received.size() < sizeof announce) lost("a malformed bucket announce");
    std::memcpy(&announce, received.data(), sizeof announce);
    bool whole = announce.chunk_bytes == 0;
    auto frame_end = sizeof announce + std::min<std::uint64_t>(announce.frame_bytes, kMaxFrameBytes);
    bool well_formed =
        announce.ordinal == ordinal + 1 && announce.frame_bytes <= kMaxFrameBytes &&
        (whole ? announce.payload_bytes <= kChunkBytes &&
                     announce.whole_offset == (frame_end + kPayloadAlignment - 1) / kPayloadAlignment * kPayloadAlignment &&
                     announce.whole_offset <= received.size() && received.size() - announce.whole_offset == announce.payload_bytes
               : frame_end == received.size() && announce.whole_offset == 0 && announce.whole_hash == 0);
    if (!well_formed) lost("a malformed bucket announce");
    if (whole && std::any_of(received.begin() + static_cast<std::ptrdiff_t>(frame_end),
                             received.begin() + static_cast<std::ptrdiff_t>(announce.whole_offset),
                             [](std::byte b) { return b != std::byte{0}; })) {
      lost("a bucket message whose padding before its payload is not zero");
    }
    if (announce.payload_bytes > options.max_bucket_bytes) {
      lost("a payload of ", announce.payload_bytes, " bytes, past max_bucket_bytes ", options.max_bucket_bytes);
    }
    if (last && last->first == announce.incarnation && announce.sequence <= last->second) {
      lost("bucket ", announce.sequence, " came after bucket ", last->second);
    }
    return announce;
  }

  // Where the caller's `place` puts the payload; empty for this side's own memory.
  std::span<std::byte> placed(const PayloadPlace& place, std::uint64_t payload_bytes, std::span<const std::byte> frame) {
    if (!place || payload_bytes == 0) return {};
    std::span<std::byte> given;
    try {
      given = place(payload_bytes, frame);
    } catch (...) {
      drop();  // the payload stays unread on the link
      throw;
    }
    return given.size() >= payload_bytes ? given.first(payload_bytes) : std::span<std::byte>();
  }

  // A payload's bytes, whole in the message or in chunks after it, and the hash computed of
  // them beside the one the server sent.
  struct Payload {
    std::span<std::byte> bytes;
    std::shared_ptr<void> owner;  // none when the bytes are the caller's
    std::uint64_t hash = 0, sent_hash = 0;
  };

  Payload take_payload(const BucketAnnounce& announce, std::span<std::byte> received, std::span<std::byte> into) {
    Payload payload{into, nullptr};
    if (announce.chunk_bytes == 0) {  // whole, in the message
      auto came = received.subspan(announce.whole_offset);
      if (payload.bytes.empty()) {
        payload.bytes = came;
        payload.owner = inbox;
      } else {
        std::memcpy(payload.bytes.data(), came.data(), came.size());
      }
      payload.hash = hash_as_one_chunk(payload.bytes);
      payload.sent_hash = announce.whole_hash;
      return payload;
    }
    if (payload.bytes.empty()) {
      if (!buffer || buffer.use_count() != 1 || buffer->size() < announce.payload_bytes) {
        buffer.reset();  // before the new one: two of the largest buckets need not fit at once
        try {
          buffer = std::make_shared<AlignedBuffer>(announce.payload_bytes);
        } catch (const std::bad_alloc&) {
          lost("no memory for a payload of ", announce.payload_bytes, " bytes");
        }
      }
      payload.bytes = buffer->span().first(announce.payload_bytes);
      payload.owner = buffer;
    }
    payload.hash = receive_payload(payload.bytes, announce.chunk_bytes);
    payload.sent_hash = take_payload_hash(payload.bytes.size());
    return payload;
  }

  // The hash serve sends after a payload's chunks. serve may still be hashing (on a thread of
  // its own, with a link faster than its hash); its heartbeats meanwhile keep the link, as
  // between buckets. Not for longer than the payload itself may take: a server that only sends
  // heartbeats must not hold this side (and the slot it reserved) for good.
  std::uint64_t take_payload_hash(std::uint64_t payload_bytes) {
    auto allowance = std::chrono::milliseconds(static_cast<std::int64_t>(payload_bytes / kSlowestBytesPerMs));
    auto hash_due = Clock::now() + options.idle_timeout + allowance;
    std::vector<std::byte> hash_message;
    while (!take(Kind::PayloadHash, hash_message, sizeof(std::uint64_t), Clock::now() + 50ms)) {
      skip_heartbeats();
      silent_too_long();
      if (Clock::now() > hash_due) {
        lost("no payload hash within ", (options.idle_timeout + allowance).count(), " ms of the payload");
      }
    }
    std::uint64_t sent_hash = 0;
    if (hash_message.size() != sizeof sent_hash) lost("a malformed payload hash");
    std::memcpy(&sent_hash, hash_message.data(), sizeof sent_hash);
    return sent_hash;
  }

  // Tells the server this bucket was taken. Should the send fail, the bucket (verified) is
  // still handed out; the next call says the link is gone.
  void acknowledge() {
    auto& pending = acks.emplace_back();
    pending.ack.ordinal = ordinal;
    try {
      pending.request = send(worker.get(), endpoint.ep, std::as_bytes(std::span(&pending.ack, 1)), tag(Kind::Ack, key));
    } catch (const Error&) {
      drop();
    }
  }

  std::optional<RemoteBucket> next(const Deadline& deadline, const VerifyOptions& verify, const PayloadPlace& place) {
    if (broken) text::fail(ErrorCode::NetworkError, "link to ", address, " is closed: connect again");
    auto received = take_announce(deadline);
    if (received.empty()) return std::nullopt;
    auto announce = read_announce(received);
    auto frame = std::span<const std::byte>(received).subspan(sizeof announce, announce.frame_bytes);
    auto payload = take_payload(announce, received, placed(place, announce.payload_bytes, frame));
    if (payload.hash != payload.sent_hash) {
      drop(ErrorCode::ChecksumMismatch, "bucket ", announce.sequence, " from ", address,
           ": payload hash does not match the one sent with it");
    }
    std::optional<BucketView> view;
    try {
      view = BucketView::open(frame, payload.bytes, verify, &cache);
    } catch (const Error&) {
      drop();
      throw;
    }
    ordinal = announce.ordinal;
    last = {announce.incarnation, announce.sequence};
    acknowledge();
    return RemoteBucket(std::move(*view), announce.sequence, announce.incarnation, std::move(payload.owner));
  }
};

}  // namespace detail

RemoteSubscriber RemoteSubscriber::connect(std::string_view address, const ConnectOptions& options,
                                           const Deadline& deadline) {
  if (options.token.empty()) throw Error(ErrorCode::InvalidArgument, "connect needs a token (read_token_file)");
  if (options.idle_timeout.count() <= 0 || options.idle_timeout > kLongestTimeout) {  // now() + it would wrap
    throw Error(ErrorCode::InvalidArgument, "connect's idle_timeout must be above 0 and at most 10^9 s");
  }
  auto timeout = std::min(deadline.left(), std::chrono::milliseconds(std::chrono::hours(24)));
  auto until = detail::Clock::now() + timeout;
  auto where = detail::parse_address(address, false, timeout);
  auto state = std::make_unique<detail::RemoteState>(address, options, where);
  state->handshake(where, until, options.token);
  return RemoteSubscriber(std::move(state));
}

RemoteSubscriber::RemoteSubscriber(std::unique_ptr<detail::RemoteState> state) : state_(std::move(state)) {}
RemoteSubscriber::RemoteSubscriber(RemoteSubscriber&&) noexcept = default;
RemoteSubscriber& RemoteSubscriber::operator=(RemoteSubscriber&&) noexcept = default;
RemoteSubscriber::~RemoteSubscriber() = default;

std::optional<RemoteBucket> RemoteSubscriber::next(const Deadline& deadline, const VerifyOptions& options,
                                                   const PayloadPlace& place) {
  if (!state_) throw Error(ErrorCode::InvalidArgument, "next() on a moved-from RemoteSubscriber");
  return state_->next(deadline, options, place);
}

const std::string& RemoteSubscriber::address() const noexcept { return state_->address; }
const std::string& RemoteSubscriber::channel() const noexcept { return state_->channel; }

}  // namespace tensorbucket::net
