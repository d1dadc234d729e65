// The serve side: a local consumer that sends each bucket to its authenticated peers.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <array>
#include <future>
#include <list>
#include <memory>
#include <optional>
#include <system_error>
#include <vector>

#include <unistd.h>

#include "tensorbucket/channel.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/net.hpp"
#include "ucx.hpp"
#include "wire.hpp"

namespace tensorbucket::net {
namespace detail {
namespace {

using namespace std::chrono_literals;

constexpr auto kProofTimeout = 3s;       // to send its proof after connecting
constexpr std::size_t kMaxPending = 8;   // connections that have not proved the token yet
constexpr auto kHeartbeatEvery = 500ms;  // to an idle peer, so that it can tell a dead link
constexpr auto kCloseLimit = 1s;
constexpr auto kRefusalGrace = 1s;       // for a refusal to reach its peer before the link closes
constexpr auto kLocalSlice = 1ms;        // a wait on the local channel, between network looks
constexpr double kSlowestBytesPerMs = 10e3;  // a bucket's payload may take its size at 10 MB/s
// A relay turned away retries every 2 s, and anyone who can reach the port can connect: one
// line per this long, with a count of the ones it passed over, keeps the log readable.
constexpr auto kTurnedAwayLogEvery = 30s;

// A small message under way and the bytes it sends: a list entry, so the bytes never move.
struct Small {
  std::vector<std::byte> bytes;
  Request request;
};

// A receive hear() gave up on (its message came by rendezvous) and the bytes UCX may still write
// into, kept until it ended: its peer is failed, and the forced close of the link ends it.
struct Lingering {
  std::unique_ptr<std::byte[]> bytes;
  Request request;
};

struct Peer {
  Endpoint endpoint;  // its address is the error handler's argument: a Peer never moves
  std::string from;
  std::uint64_t key = 0;
  Nonce nonce{};
  bool authenticated = false;
  bool joined = false;  // has had the first bucket of an update
  Clock::time_point since = Clock::now();
  Clock::time_point last_sent = Clock::now();
  std::uint64_t sent = 0, acked = 0;  // bucket ordinals
  Clock::time_point stalled_since{};  // when its window filled while a bucket waited
  std::vector<std::byte> announce;    // the current bucket's announce and frame, for this peer
  std::vector<Request> bucket_sends;  // the current bucket's messages under way
  bool taking = false;                // takes the current bucket: its chunks and hash follow
  std::uint64_t posted = 0;           // bytes of the current payload sent to it so far
  std::list<Small> small;             // challenge, welcome, refusal, heartbeats
  std::string problem;                // set: drop it
  bool transfer_failed = false;       // the problem is a UCX transfer's error
  Clock::time_point close_by{};       // refused: closed once told, or at this time

  bool live() const { return problem.empty(); }
  void fail_transfer(const Error& e) {
    if (!problem.empty()) return;
    problem = e.what();
    transfer_failed = true;
  }
  bool serving() const { return authenticated && live(); }
};

// The payload hash of a bucket that goes in chunks, computed on a thread of its own while the
// chunks go out. The server sets the pace of a large transfer: its copy into the socket is the
// slowest step, and hashing between its sends made each bucket take that much longer
// (bench/RESULTS.md, issue 22). The payload must stay put until stop() returned.
class PayloadHash {
 public:
  PayloadHash() = default;
  PayloadHash(const PayloadHash&) = delete;
  PayloadHash& operator=(const PayloadHash&) = delete;
  ~PayloadHash() { stop(); }

  void start(std::span<const std::byte> payload) {
    stop();
    try {
      running_ = std::async(std::launch::async, [this, payload] { return hash(payload); });
    } catch (const std::system_error&) {  // no thread to be had: here, then
      value_ = hash(payload);
    }
  }

  // The hash, once done (it stays where it is until stop()); nullptr while it runs.
  const std::uint64_t* ready() {
    if (running_.valid() && running_.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      value_ = running_.get();
    }
    return value_ ? &*value_ : nullptr;
  }

  // Ends the hash under way, at its next chunk: its payload may go.
  void stop() noexcept {
    if (running_.valid()) {
      stopping_.store(true, std::memory_order_relaxed);
      running_.wait();
      running_ = {};
      stopping_.store(false, std::memory_order_relaxed);
    }
    value_.reset();
  }

 private:
  std::uint64_t hash(std::span<const std::byte> payload) const {
    ChunkedHash hash(chunk_count(payload.size(), kChunkBytes));
    for (std::uint64_t at = 0; at < payload.size() && !stopping_.load(std::memory_order_relaxed); at += kChunkBytes) {
      hash.add(payload.subspan(at, std::min<std::uint64_t>(kChunkBytes, payload.size() - at)));
    }
    return hash.value();
  }

  std::future<std::uint64_t> running_;
  std::atomic<bool> stopping_{false};
  std::optional<std::uint64_t> value_;
};

// Finished requests leave; false while any is under way. A failed one fails the peer.
bool settle(Peer& peer) {
  try {
    std::erase_if(peer.bucket_sends, [](Request& request) { return request.done(); });
    peer.small.remove_if([](Small& small) { return small.request.done(); });
  } catch (const Error& e) {
    peer.fail_transfer(e);
  }
  return peer.bucket_sends.empty() && peer.small.empty();
}

}  // namespace

struct ServerState {
  ServeOptions options;
  Subscriber subscriber;
  // Buffers UCX may still write into until the worker is gone: declared before it.
  std::vector<std::byte> staged;                         // a device bucket's payload, on the host
#ifdef TENSORBUCKET_WIRE_FAULT
  std::vector<std::byte> flipped;                        // the payload with a byte flipped
  bool withhold_hash = false;                            // the current payload's hash is not sent
#endif
  std::array<std::byte, 64> discard{};                   // what hear() throws away; never read
  std::list<Lingering> lingering;                        // receives hear() gave up on
  Worker worker;
  Pace pace{worker};  // between progress calls while a bucket is under way
  ucp_listener_h listener = nullptr;
  std::vector<ucp_conn_request_h> incoming;  // filled by the listener's callback
  std::list<Peer> peers;                     // a list: peers keep their addresses
  Clock::time_point turned_away_logged{};    // the last "turned ... away" line
  std::size_t turned_away_quietly = 0;       // connections turned away since, unlogged
  std::optional<ReceivedBucket> current;  // being sent; its lease held until every send is done
  std::span<const std::byte> payload;      // its payload, on the host
  std::span<const std::byte> on_wire;      // what is sent of it: the same bytes (but in a test build)
  PayloadHash payload_hash;                // of a payload in chunks: sent after them, to each peer
  Clock::time_point current_deadline{};
  std::uint64_t served = 0;
  std::optional<std::uint64_t> incarnation;  // of the channel's producer, as of the last bucket taken
  std::string address;
  pid_t pid = ::getpid();  // the serving process; a forked child inherits this, not the role

  ServerState(Subscriber sub, const ServeOptions& serve, const SocketAddress& listen)
      : options(serve), subscriber(std::move(sub)), worker(interface_holding(listen), listen.storage.ss_family) {
    worker.set_progress_calls(1);  // turn() hears after each
  }
  ~ServerState() {
    for (auto& peer : peers) detail::close(worker, peer.endpoint, kCloseLimit);
    peers.clear();
    for (auto& receive : lingering) receive.request.cancel();  // while the worker lives; the bytes go after it
    payload_hash.stop();
    current.reset();  // after the peers and the hash: they read its slot
    if (listener != nullptr) {
      for (auto* request : incoming) ucp_listener_reject(listener, request);
      ucp_listener_destroy(listener);
    }
  }

  void log(const std::string& line) const { std::fprintf(stderr, "tbucket serve: %s\n", line.c_str()); }

  void send_small(Peer& peer, Kind kind, const void* bytes, std::size_t size) {
    if (peer.endpoint.failed != UCS_OK) return;  // drop_failed() tells why
    auto& small = peer.small.emplace_back();
    small.bytes.assign(static_cast<const std::byte*>(bytes), static_cast<const std::byte*>(bytes) + size);
    try {
      small.request = send(worker.get(), peer.endpoint.ep, small.bytes, tag(kind));
    } catch (const Error& e) {
      peer.fail_transfer(e);
    }
  }

  void admit() {
    for (auto* request : std::exchange(incoming, {})) {
      ucp_conn_request_attr_t attr{};
      attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
      std::string from = ucp_conn_request_query(request, &attr) == UCS_OK ? to_string(attr.client_address) : "?";
      std::size_t serving = 0, pending = 0;
      for (const auto& peer : peers) (peer.authenticated ? serving : pending) += 1;
      if (serving >= options.max_peers || pending >= kMaxPending) {
        ucp_listener_reject(listener, request);
        auto now = Clock::now();
        if (turned_away_logged != Clock::time_point{} && now - turned_away_logged < kTurnedAwayLogEvery) {
          ++turned_away_quietly;
          continue;
        }
        auto more = std::exchange(turned_away_quietly, 0);
        turned_away_logged = now;
        log("turned " + from + " away: " +
            (pending >= kMaxPending ? std::to_string(kMaxPending) + " connections proving the token already"
                                    : "max_peers (" + std::to_string(options.max_peers) + ") reached") +
            (more == 0 ? "" : " (and " + std::to_string(more) + " more since the last such line)"));
        continue;
      }
      auto& peer = peers.emplace_back();
      peer.from = from;
      try {
        accept(worker.get(), peer.endpoint, request);
        random_bytes(&peer.key, sizeof peer.key);
        peer.key = (peer.key & kKeyMask) | 1;
        random_bytes(peer.nonce.data(), peer.nonce.size());
        Challenge challenge{kMagic, kProtocolVersion, 0, peer.key, peer.nonce};
        send_small(peer, Kind::Challenge, &challenge, sizeof challenge);
      } catch (const Error& e) {
        peer.problem = e.what();
      }
    }
  }

  void refuse(Peer& peer, Refusal reason, const std::string& why) {
    log("refused " + peer.from + ": " + why);
    std::vector<std::byte> message(1 + std::min(why.size(), kMaxRefusalBytes - 1));
    message[0] = static_cast<std::byte>(reason);
    std::memcpy(message.data() + 1, why.data(), message.size() - 1);
    send_small(peer, Kind::Refused, message.data(), message.size());
    peer.problem = why;
    peer.close_by = Clock::now() + kRefusalGrace;
  }

  void welcome(Peer& peer, const ProofMessage& proof) {
    if (proof.magic != kMagic || proof.version != kProtocolVersion) {
      return refuse(peer, Refusal::Other, "protocol version " + std::to_string(proof.version) + ", not " +
                                              std::to_string(kProtocolVersion));
    }
    if (!same_digest(proof.proof, client_proof(options.token, peer.nonce, peer.key))) {
      return refuse(peer, Refusal::WrongToken, "wrong token");
    }
    // Checked again here: connections admitted together may all prove the token.
    auto serving = std::count_if(peers.begin(), peers.end(), [](const Peer& other) { return other.authenticated; });
    if (static_cast<std::size_t>(serving) >= options.max_peers) {
      return refuse(peer, Refusal::Other, "max_peers (" + std::to_string(options.max_peers) + ") reached");
    }
    Welcome welcome{server_proof(options.token, proof.nonce, peer.key), 0, {}};
    const auto& name = subscriber.channel();
    welcome.channel_bytes = static_cast<std::uint32_t>(std::min(name.size(), welcome.channel.size()));
    std::memcpy(welcome.channel.data(), name.data(), welcome.channel_bytes);
    send_small(peer, Kind::Welcome, &welcome, sizeof welcome);
    peer.authenticated = true;
    peer.last_sent = Clock::now();
    log("serving " + peer.from + " from the next update");
  }

  // Every message peers sent: proofs and acknowledgements, each the exact size, from the peer
  // whose key it carries. Anything else is taken off the queue (so that nothing piles up in
  // it) and fails the peer whose key it carries. A message not here whole at once came by
  // rendezvous, which no honest peer uses for these: its sender is failed too. All of the
  // queue, after every progress call: a flood of messages no peer's key names, which anyone
  // who can connect can send, must not hold back the acknowledgements behind it, nor pile up.
  void hear() {
    std::erase_if(lingering, [](const Lingering& receive) { return receive.request.ended(); });
    for (;;) {
      std::size_t length = 0;
      ucp_tag_t sender_tag = 0;
      auto* message = probe(worker.get(), 0, 0, &length, &sender_tag);
      if (message == nullptr) return;
      auto kind = static_cast<Kind>(sender_tag >> 56);
      Peer* peer = nullptr;
      for (auto& candidate : peers) {
        if (candidate.key == (sender_tag & kKeyMask) && candidate.live()) peer = &candidate;
      }
      std::size_t expected = !peer                                            ? 0
                             : kind == Kind::Proof && !peer->authenticated ? sizeof(ProofMessage)
                             : kind == Kind::Ack && peer->authenticated    ? sizeof(Ack)
                                                                           : 0;
      bool wanted = expected != 0 && length == expected;
      auto into = wanted ? std::make_unique<std::byte[]>(expected) : nullptr;
      bool whole = false;
      Request receiving;
      try {
        auto room = wanted ? std::span(into.get(), expected) : std::span(discard).first(std::min(length, discard.size()));
        receiving = receive(worker.get(), message, room);
        whole = receiving.done();
      } catch (const Error&) {
        whole = false;  // truncated, or failed
      }
      if (wanted && !whole) lingering.push_back({std::move(into), std::move(receiving)});  // UCX may still write there
      if (peer == nullptr) continue;
      if (!wanted || !whole) {
        peer->problem = "sent a message it should not have (tag kind " + std::to_string(static_cast<int>(kind)) +
                        ", " + std::to_string(length) + " bytes)";
        continue;
      }
      if (kind == Kind::Proof) {
        ProofMessage proof{};
        std::memcpy(&proof, into.get(), sizeof proof);
        welcome(*peer, proof);
      } else {
        Ack ack{};
        std::memcpy(&ack, into.get(), sizeof ack);
        if (ack.ordinal > peer->sent || ack.ordinal < peer->acked) {
          peer->problem = "acknowledged bucket " + std::to_string(ack.ordinal) + " of " + std::to_string(peer->sent);
        } else {
          peer->acked = ack.ordinal;
        }
      }
    }
  }

  void drop_failed() {
    auto now = Clock::now();
    for (auto it = peers.begin(); it != peers.end();) {
      auto& peer = *it;
      // A transfer under way fails with the link, and says less than the link's end does.
      if (peer.endpoint.failed != UCS_OK && (peer.problem.empty() || peer.transfer_failed)) {
        peer.problem = std::string("the link ended (") + ucs_status_string(peer.endpoint.failed) +
                       "): the relay left, or its host or the network failed";
      }
      if (!peer.authenticated && peer.live() && now - peer.since > kProofTimeout) {
        refuse(peer, Refusal::Other, "no proof of the token within " + std::to_string(kProofTimeout.count()) + " s");
      }
      bool refused = peer.close_by != Clock::time_point{};
      if (peer.live() || (refused && !settle(peer) && now < peer.close_by && peer.endpoint.failed == UCS_OK)) {
        ++it;
        continue;
      }
      if (peer.authenticated) log("dropped " + peer.from + ": " + peer.problem);
      // By force: whatever is still under way on it ends here, before its buffers go.
      detail::close(worker, peer.endpoint, kCloseLimit);
      it = peers.erase(it);
    }
  }

  bool has_room(const Peer& peer) const { return peer.sent - peer.acked < options.window; }

  // Announces `current` to every peer in the game: joined, or joining at an update's start.
  // A payload of one chunk goes with it; a larger one follows, from send_chunks().
  void announce_current() {
    auto& bucket = *current;
    const auto& view = bucket.view();
    payload_hash.stop();  // before `staged` is written again
    payload = view.payload();
    if (!view.location().on_host()) {
      staged = bucket.copy_to_host();
      payload = staged;
    }
    auto frame = view.frame();
    on_wire = payload;
#ifdef TENSORBUCKET_WIRE_FAULT
    // Test builds only (tests/meson.build): one payload byte of the bucket whose sequence
    // TBUCKET_WIRE_FAULT names flips on the wire, after the server hashed it; with
    // "padding:" before the sequence, a byte between the frame and a whole payload is set;
    // with "nohash:", the hash of a payload in chunks is never sent (heartbeats go on).
    const char* asked = std::getenv("TBUCKET_WIRE_FAULT");
    std::string_view fault = asked != nullptr ? asked : "";
    std::string_view how;
    for (std::string_view prefix : {"padding:", "nohash:"}) {
      if (fault.starts_with(prefix)) {
        how = prefix;
        fault.remove_prefix(prefix.size());
      }
    }
    bool faulty = fault == std::to_string(bucket.sequence());
    bool bad_padding = faulty && how == "padding:";
    withhold_hash = faulty && how == "nohash:";
    if (faulty && how.empty() && !payload.empty()) {
      flipped.assign(payload.begin(), payload.end());
      flipped[flipped.size() / 2] ^= std::byte{1};
      on_wire = flipped;
    }
#endif
    BucketAnnounce announce{0, bucket.sequence(), bucket.incarnation(), payload.size(), frame.size(), kChunkBytes, 0, 0};
    auto message_bytes = sizeof announce + frame.size();
    bool whole = payload.size() <= kChunkBytes;
    if (whole) {
      announce.chunk_bytes = 0;
      announce.whole_offset = (message_bytes + kPayloadAlignment - 1) / kPayloadAlignment * kPayloadAlignment;
      announce.whole_hash = hash_as_one_chunk(payload);
      message_bytes = announce.whole_offset + payload.size();
    } else {
      payload_hash.start(payload);
    }
    bool any = false;
    for (auto& peer : peers) {
      if (!peer.serving() || (!peer.joined && view.bucket_index() != 0)) continue;
      peer.joined = true;
      announce.ordinal = ++peer.sent;
      peer.announce.resize(message_bytes);
      auto* at = peer.announce.data();
      std::memcpy(at, &announce, sizeof announce);
      std::memcpy(at + sizeof announce, frame.data(), frame.size());
      if (whole) {
        std::memset(at + sizeof announce + frame.size(), 0, announce.whole_offset - sizeof announce - frame.size());
        if (!on_wire.empty()) std::memcpy(at + announce.whole_offset, on_wire.data(), on_wire.size());
#ifdef TENSORBUCKET_WIRE_FAULT
        if (bad_padding && announce.whole_offset > sizeof announce + frame.size()) {
          at[announce.whole_offset - 1] = std::byte{1};
        }
#endif
      }
      try {
        peer.bucket_sends.push_back(send(worker.get(), peer.endpoint.ep, peer.announce, tag(Kind::Bucket)));
        peer.taking = !whole;
        peer.posted = 0;
      } catch (const Error& e) {
        peer.fail_transfer(e);
      }
      peer.last_sent = Clock::now();
      any = true;
    }
    served += any ? 1 : 0;
    auto allowance = std::chrono::milliseconds(static_cast<std::int64_t>(payload.size() / kSlowestBytesPerMs));
    pace.restart();
    current_deadline = Clock::now() + options.peer_timeout + allowance;
  }

  // Sends each peer taking the current bucket its next chunks, kChunksInFlight at most under
  // way, so that a slow peer holds back only itself; after its last chunk, the hash, once
  // payload_hash has it.
  void send_chunks() {
    for (auto& peer : peers) {
      if (!peer.live() || !peer.taking) continue;
      while (peer.posted < on_wire.size() && peer.bucket_sends.size() < kChunksInFlight) {
        auto size = std::min<std::uint64_t>(kChunkBytes, on_wire.size() - peer.posted);
        if (!send_or_fail(peer, on_wire.subspan(peer.posted, size), Kind::Payload)) break;
        peer.posted += size;
      }
      if (peer.posted == on_wire.size() && peer.bucket_sends.size() < kChunksInFlight) {
        const auto* hash = payload_hash.ready();
        if (hash == nullptr) continue;  // still hashing: a later turn sends it
#ifdef TENSORBUCKET_WIRE_FAULT
        if (withhold_hash) continue;
#endif
        send_or_fail(peer, std::as_bytes(std::span(hash, 1)), Kind::PayloadHash);
        peer.taking = false;
      }
    }
  }

  bool send_or_fail(Peer& peer, std::span<const std::byte> bytes, Kind kind) {
    try {
      peer.bucket_sends.push_back(send(worker.get(), peer.endpoint.ep, bytes, tag(kind)));
      peer.last_sent = Clock::now();
      return true;
    } catch (const Error& e) {
      peer.fail_transfer(e);
      return false;
    }
  }

  void heartbeats() {
    auto now = Clock::now();
    for (auto& peer : peers) {
      // Not while the last small message is still queued: a peer that stopped reading would
      // otherwise gather two a second for as long as the channel is idle.
      if (peer.serving() && peer.bucket_sends.empty() && peer.small.empty() && now - peer.last_sent > kHeartbeatEvery) {
        std::uint64_t beat = 0;
        send_small(peer, Kind::Heartbeat, &beat, sizeof beat);
        peer.last_sent = now;
      }
    }
  }

  // One turn of the loop.
  void turn() {
    // Each progress call's messages are taken off the queue before the next call: one call
    // reads a few of UCX's receive buffers at most, while a turn's worth of calls, with serve
    // behind a flood (a loaded host), queued hundreds of MiB of messages.
    bool moved = false;
    for (int call = 0; call < Worker::kProgressCalls && worker.progress(); ++call) {
      moved = true;
      hear();
    }
    admit();
    hear();
    for (auto& peer : peers) settle(peer);
    if (current) send_chunks();
    heartbeats();
    auto now = Clock::now();
    if (current) {
      bool done = true;
      for (auto& peer : peers) {
        if (!peer.live() || (peer.bucket_sends.empty() && !peer.taking)) continue;
        done = false;
        if (now > current_deadline) {
          peer.problem = "took no bucket within " + std::to_string(options.peer_timeout.count()) + " ms";
        }
      }
      drop_failed();
      if (!done) {
        pace.after(moved);
        return;
      }
      payload_hash.stop();  // done, or no peer is left to take it
      current.reset();      // every send is done: the slot's bytes are no longer read
    }
    // No bucket is taken while no peer is there to take it: a producer waits for the first
    // relay as it waits for any consumer (under `Block`), and a relay starts at the oldest
    // update the channel still holds. A peer whose window is full holds the next bucket
    // back, peer_timeout at most.
    bool any_peer = false, all_room = true;
    for (auto& peer : peers) {
      if (!peer.serving()) continue;
      any_peer = true;
      if (has_room(peer)) {
        peer.stalled_since = {};
        continue;
      }
      if (peer.stalled_since == Clock::time_point{}) peer.stalled_since = now;
      if (now - peer.stalled_since > options.peer_timeout) {
        peer.problem = "acknowledged nothing within " + std::to_string(options.peer_timeout.count()) + " ms";
      } else {
        all_room = false;
      }
    }
    drop_failed();
    if (!any_peer || !all_room) {
      worker.wait(kLocalSlice);
      return;
    }
    std::optional<ReceivedBucket> bucket;
    try {
      bucket = subscriber.next(kLocalSlice);
    } catch (const Error& e) {
      // The subscriber has skipped the bad bucket; serve goes on with the next one rather
      // than leave every relay without the channel.
      if (!failed_verification(e.code())) throw;
      log("skipped a bucket of the channel that failed its checks: " + std::string(to_string(e.code())) + ": " +
          e.what());
      return;
    }
    if (!bucket) return;
    if (incarnation && *incarnation != bucket->incarnation()) {
      log("the channel's next producer is here (incarnation " + std::to_string(bucket->incarnation()) + ")");
    }
    incarnation = bucket->incarnation();
    current = std::move(bucket);
    announce_current();
  }
};

namespace {

void on_connection(ucp_conn_request_h request, void* arg) {
  static_cast<ServerState*>(arg)->incoming.push_back(request);
}

}  // namespace
}  // namespace detail

Server Server::start(std::string_view channel, const ServeOptions& options, std::chrono::milliseconds attach_timeout) {
  if (options.token.empty()) throw Error(ErrorCode::InvalidArgument, "serve needs a token (read_token_file)");
  if (options.window == 0 || options.max_peers == 0 || options.peer_timeout.count() <= 0) {
    throw Error(ErrorCode::InvalidArgument, "serve needs window, max_peers and peer_timeout above 0");
  }
  if (options.peer_timeout > kLongestTimeout) {  // now() + it would wrap into the past
    throw Error(ErrorCode::InvalidArgument, "serve's peer_timeout is at most 10^9 s");
  }
  if (options.max_peers > kMostPeers) {
    throw Error(ErrorCode::InvalidArgument, "serve's max_peers is at most " + std::to_string(kMostPeers) + ", not " +
                                                std::to_string(options.max_peers));
  }
  auto address = detail::parse_address(options.listen, true);
  detail::check_listenable(address);
  auto subscriber = Subscriber::attach(channel, attach_timeout, {.follow_restarts = true});
  auto state = std::make_unique<detail::ServerState>(std::move(subscriber), options, address);
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = address.get();
  params.sockaddr.addrlen = address.length;
  params.conn_handler.cb = detail::on_connection;
  params.conn_handler.arg = state.get();
  if (auto status = ucp_listener_create(state->worker.get(), &params, &state->listener); status != UCS_OK) {
    detail::fail_ucx("listening on " + options.listen, status);
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (auto status = ucp_listener_query(state->listener, &attr); status != UCS_OK) {
    detail::fail_ucx("ucp_listener_query", status);
  }
  state->address = detail::to_string(attr.sockaddr);
  return Server(std::move(state));
}

Server::Server(std::unique_ptr<detail::ServerState> state) : state_(std::move(state)) {}
Server::Server(Server&&) noexcept = default;
Server& Server::operator=(Server&&) noexcept = default;
Server::~Server() { close(); }

void Server::serve_for(std::chrono::milliseconds duration) {
  if (!state_) throw Error(ErrorCode::InvalidArgument, "serve_for() on a closed server");
  if (state_->pid != ::getpid()) {
    throw Error(ErrorCode::InvalidArgument, "the server of " + state_->address + " belongs to process " +
                                                std::to_string(state_->pid) + "; process " + std::to_string(::getpid()) +
                                                " was forked from it and cannot serve");
  }
  auto until = detail::Clock::now() + duration;
  while (detail::Clock::now() < until) {
    try {
      state_->turn();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ProducerGone) throw;
      state_->log("the channel's producer is gone; waiting for the next one");
    }
  }
}

std::string Server::address() const { return state_ ? state_->address : std::string(); }

std::uint32_t Server::peers() const noexcept {
  if (!state_) return 0;
  std::uint32_t count = 0;
  for (const auto& peer : state_->peers) count += peer.authenticated ? 1 : 0;
  return count;
}

std::uint64_t Server::buckets_served() const noexcept { return state_ ? state_->served : 0; }

void Server::close() noexcept {
  // A forked child's copy of the state is left as it is: tearing it down would close the
  // parent's links on sockets the two share, and wait for a hashing thread the child lacks.
  if (state_ && state_->pid != ::getpid()) static_cast<void>(state_.release());
  state_.reset();
}

}  // namespace tensorbucket::net
