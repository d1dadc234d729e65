// The serve side: a local consumer that sends each bucket to its authenticated peers.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <optional>
#include <thread>
#include <vector>

#include "tensorbucket/channel.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/net.hpp"
#include "ucx.hpp"
#include "wire.hpp"

namespace tensorbucket::net {
namespace detail {
namespace {

using namespace std::chrono_literals;

constexpr auto kProofTimeout = 5s;       // to send its proof after connecting
constexpr auto kHeartbeatEvery = 500ms;  // to an idle peer, so that it can tell a dead link
constexpr auto kCloseLimit = 1s;
constexpr auto kLocalSlice = 1ms;        // a wait on the local channel, between network looks

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
  std::vector<Request> sending;       // the current bucket's messages and small ones
  std::vector<std::vector<std::byte>> small;  // bytes of small messages under way
  std::string problem;                        // set: drop it
  bool refused = false;                       // told why: the link is flushed before it is closed
};

}  // namespace

struct ServerState {
  ServeOptions options;
  Subscriber subscriber;
  Worker worker;
  ucp_listener_h listener = nullptr;
  std::vector<ucp_conn_request_h> incoming;  // filled by the listener's callback
  std::list<Peer> peers;                     // a list: peers keep their addresses
  std::optional<ReceivedBucket> current;     // being sent; its lease held until every send is done
  std::vector<std::byte> message;            // the current bucket's announce and frame
  std::vector<std::byte> staged;             // a device bucket's payload, on the host
  Clock::time_point current_since{};
  std::uint64_t served = 0;
  std::string address;

  ServerState(Subscriber sub, const ServeOptions& serve) : options(serve), subscriber(std::move(sub)) {}
  ~ServerState() {
    for (auto& peer : peers) detail::close(worker, peer.endpoint, kCloseLimit);
    peers.clear();
    current.reset();  // after the peers: their sends read its slot
    if (listener != nullptr) {
      for (auto* request : incoming) ucp_listener_reject(listener, request);
      ucp_listener_destroy(listener);
    }
  }

  void log(const std::string& line) const { std::fprintf(stderr, "tbucket serve: %s\n", line.c_str()); }

  void send_small(Peer& peer, Kind kind, const void* bytes, std::size_t size) {
    auto& copy = peer.small.emplace_back(static_cast<const std::byte*>(bytes), static_cast<const std::byte*>(bytes) + size);
    peer.sending.push_back(send(worker.get(), peer.endpoint.ep, copy, tag(kind)));
  }

  void admit() {
    for (auto* request : std::exchange(incoming, {})) {
      ucp_conn_request_attr_t attr{};
      attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
      std::string from = ucp_conn_request_query(request, &attr) == UCS_OK ? to_string(attr.client_address) : "?";
      if (peers.size() >= options.max_peers) {
        log("refused " + from + ": " + std::to_string(options.max_peers) + " peers already (max_peers)");
        ucp_listener_reject(listener, request);
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

  void refuse(Peer& peer, const std::string& why) {
    log("refused " + peer.from + ": " + why);
    send_small(peer, Kind::Refused, why.data(), std::min(why.size(), kMaxRefusalBytes));
    peer.problem = why;
    peer.refused = true;
  }

  // Reads what the peer sent: its proof, its acknowledgements.
  void hear(Peer& peer) {
    std::size_t length = 0;
    if (!peer.authenticated) {
      auto* message = probe(worker.get(), tag(Kind::Proof, peer.key), kAllBits, &length);
      if (message == nullptr) {
        if (Clock::now() - peer.since > kProofTimeout) refuse(peer, "no proof of the token within 5 s");
        return;
      }
      ProofMessage proof{};
      std::vector<std::byte> bytes(std::min(length, sizeof proof));
      auto receiving = receive(worker.get(), message, bytes);
      while (!receiving.done()) worker.progress();  // a message this small came whole
      if (length != sizeof proof) return refuse(peer, "a malformed proof");
      std::memcpy(&proof, bytes.data(), sizeof proof);
      if (proof.magic != kMagic || proof.version != kProtocolVersion) {
        return refuse(peer, "protocol version " + std::to_string(proof.version) + ", not " +
                                std::to_string(kProtocolVersion));
      }
      if (!same_digest(proof.proof, client_proof(options.token, peer.nonce, peer.key))) {
        return refuse(peer, "wrong token");
      }
      Welcome welcome{server_proof(options.token, proof.nonce, peer.key), 0, {}};
      const auto& name = subscriber.channel();
      welcome.channel_bytes = static_cast<std::uint32_t>(std::min(name.size(), welcome.channel.size()));
      std::memcpy(welcome.channel.data(), name.data(), welcome.channel_bytes);
      send_small(peer, Kind::Welcome, &welcome, sizeof welcome);
      peer.authenticated = true;
      peer.last_sent = Clock::now();
      log("serving " + peer.from + " from the next update");
      return;
    }
    while (auto* message = probe(worker.get(), tag(Kind::Ack, peer.key), kAllBits, &length)) {
      Ack ack{};
      std::vector<std::byte> bytes(std::min(length, sizeof ack));
      auto receiving = receive(worker.get(), message, bytes);
      while (!receiving.done()) worker.progress();
      std::memcpy(&ack, bytes.data(), bytes.size());
      if (length != sizeof ack || ack.ordinal > peer.sent || ack.ordinal < peer.acked) {
        peer.problem = "a malformed acknowledgement";
        return;
      }
      peer.acked = ack.ordinal;
    }
  }

  // Finished sends leave the list; a failed one drops the peer.
  static bool sent_all(Peer& peer) {
    try {
      std::erase_if(peer.sending, [](Request& request) { return request.done(); });
    } catch (const Error& e) {
      peer.problem = e.what();
    }
    if (peer.sending.empty()) peer.small.clear();
    return peer.sending.empty();
  }

  void drop_failed() {
    for (auto it = peers.begin(); it != peers.end();) {
      if (it->endpoint.failed != UCS_OK && it->problem.empty()) {
        it->problem = std::string("the link failed: ") + ucs_status_string(it->endpoint.failed);
      }
      if (it->problem.empty()) {
        ++it;
        continue;
      }
      if (it->authenticated) log("dropped " + it->from + ": " + it->problem);
      detail::close(worker, it->endpoint, kCloseLimit, it->refused);
      it = peers.erase(it);
    }
  }

  bool has_room(Peer& peer) const { return peer.sent - peer.acked < options.window; }

  // Sends `current` to every authenticated peer in the game (joined, or joining at an update's start).
  void send_current() {
    auto& bucket = *current;
    const auto& view = bucket.view();
    auto payload = view.payload();
    if (!view.location().on_host()) {
      staged = bucket.copy_to_host();
      payload = std::span<const std::byte>(staged).first(view.payload().size());
    }
    auto frame = view.frame();
    BucketAnnounce announce{0, bucket.sequence(), bucket.incarnation(), payload.size(), xxh3(payload), frame.size()};
#ifdef TENSORBUCKET_WIRE_FAULT
    // Test builds only (tests/meson.build): one payload byte of the bucket whose sequence
    // TBUCKET_WIRE_FAULT names flips after its hash was taken, as on a faulty link.
    if (const char* at = std::getenv("TBUCKET_WIRE_FAULT"); at != nullptr && !payload.empty() &&
                                                           std::to_string(bucket.sequence()) == at) {
      staged.assign(payload.begin(), payload.end());
      staged[staged.size() / 2] ^= std::byte{1};
      payload = staged;
    }
#endif
    message.resize(sizeof announce + frame.size());
    std::memcpy(message.data() + sizeof announce, frame.data(), frame.size());
    for (auto& peer : peers) {
      if (!peer.authenticated || !peer.problem.empty()) continue;
      if (!peer.joined && view.bucket_index() != 0) continue;
      peer.joined = true;
      announce.ordinal = ++peer.sent;
      // Each peer's announce differs by its ordinal: the message is rewritten for each, so
      // every send below must have copied it (eager) or be a private copy.
      auto& copy = peer.small.emplace_back(message);
      std::memcpy(copy.data(), &announce, sizeof announce);
      try {
        peer.sending.push_back(send(worker.get(), peer.endpoint.ep, copy, tag(Kind::Bucket)));
        if (!payload.empty()) peer.sending.push_back(send(worker.get(), peer.endpoint.ep, payload, tag(Kind::Payload)));
      } catch (const Error& e) {
        peer.problem = e.what();
      }
      peer.last_sent = Clock::now();
    }
    ++served;
  }

  // One turn of the loop; true when it did something.
  bool turn() {
    worker.progress();
    admit();
    for (auto& peer : peers) {
      if (peer.problem.empty()) hear(peer);
      if (peer.problem.empty()) sent_all(peer);
    }
    auto now = Clock::now();
    if (current) {
      bool done = true;
      for (auto& peer : peers) {
        if (peer.problem.empty() && !sent_all(peer)) {
          done = false;
          if (now - current_since > options.peer_timeout) {
            peer.problem = "took no bucket within " + std::to_string(options.peer_timeout.count()) + " ms";
          }
        }
      }
      drop_failed();
      if (!done) {
        std::this_thread::yield();  // the transfer needs this thread's progress calls: no sleep
        return false;
      }
      current.reset();  // every send is done: the slot's bytes are no longer read
      return true;
    }
    for (auto& peer : peers) {
      if (peer.authenticated && peer.problem.empty() && peer.sending.empty() && now - peer.last_sent > kHeartbeatEvery) {
        std::uint64_t beat = 0;
        send_small(peer, Kind::Heartbeat, &beat, sizeof beat);
        peer.last_sent = now;
      }
    }
    // No bucket is taken while no peer is there to take it: a producer waits for the first
    // relay as it waits for any consumer (under `Block`), and a relay starts at the oldest
    // update the channel still holds.
    bool any_peer = false;
    for (auto& peer : peers) any_peer = any_peer || (peer.authenticated && peer.problem.empty());
    // A peer whose window is full holds the next bucket back, peer_timeout at most.
    bool all_room = any_peer;
    for (auto& peer : peers) {
      if (!peer.authenticated || !peer.problem.empty() || has_room(peer)) {
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
    if (!all_room) {
      worker.wait(kLocalSlice);
      return false;
    }
    auto bucket = subscriber.next(kLocalSlice);
    if (!bucket) return false;
    current = std::move(bucket);
    current_since = Clock::now();
    send_current();
    return true;
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
  auto address = detail::parse_address(options.listen, true);
  auto subscriber = Subscriber::attach(channel, attach_timeout, {.follow_restarts = true});
  auto state = std::make_unique<detail::ServerState>(std::move(subscriber), options);
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

void Server::close() noexcept { state_.reset(); }

}  // namespace tensorbucket::net
