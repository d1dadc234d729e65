// The serve side: a local consumer that sends each bucket to its authenticated peers.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <array>
#include <cerrno>
#include <future>
#include <iterator>
#include <list>
#include <memory>
#include <optional>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/text.hpp"
#include "tensorbucket/channel.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/net.hpp"
#include "door.hpp"
#include "socket.hpp"
#include "ucx.hpp"
#include "wire.hpp"
#include "wire_fault.hpp"

namespace tensorbucket::net {
namespace detail {
namespace {

using namespace std::chrono_literals;
using text::message;

constexpr auto kProofTimeout = 3s;       // at the front door: to prove the token and send its address
constexpr std::size_t kMaxPending = 8;   // connections at the front door
constexpr int kAcceptsPerTurn = 64;      // connections taken off the listening socket per look
constexpr auto kHeartbeatEvery = 500ms;  // to an idle peer, so that it can tell a dead link
constexpr auto kRefusalGrace = 1s;       // for a refusal to reach its peer before the connection closes
constexpr auto kListeningEvery = 200ms;  // UCX's listening sockets looked at
constexpr auto kLocalSlice = 1ms;        // a wait on the local channel, between network looks
// A relay turned away retries every 2 s, and anyone who can reach the port can connect: one
// line per this long, with a count of the ones it passed over, keeps the log readable. So for
// refusals at the front door, which any connection can provoke.
constexpr auto kTurnedAwayLogEvery = 30s;
constexpr auto kRefusedLogEvery = 1s;

// A line that anyone who can connect can provoke: one per `every` at most, with a count of the
// ones passed over since.
class QuietLog {
 public:
  explicit QuietLog(std::chrono::milliseconds every) : every_(every) {}
  // The line to log now (with the count), or nothing.
  std::optional<std::string> line(const std::string& text) {
    auto now = Clock::now();
    if (logged_ != Clock::time_point{} && now - logged_ < every_) {
      ++passed_over_;
      return std::nullopt;
    }
    logged_ = now;
    auto more = std::exchange(passed_over_, 0);
    return more == 0 ? text : message(text, " (and ", more, " more since the last such line)");
  }

 private:
  std::chrono::milliseconds every_;
  Clock::time_point logged_{};
  std::size_t passed_over_ = 0;
};

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

// A connection at the front door (door.hpp): proving the token, or being told why not.
struct Door {
  Socket link;
  ServerDoor door;
  std::string from;
  Clock::time_point due;  // through the door by then; once refused, closed by then
  bool refused = false;
  bool shut = false;      // refused, told so, and this side of the connection shut
};

// A relay that came through the front door.
struct Peer {
  Endpoint endpoint;  // its address is the error handler's argument: a Peer never moves
  std::string from;
  std::uint64_t key = 0;
  bool joined = false;  // has had the first bucket of an update
  Clock::time_point last_sent = Clock::now();
  std::uint64_t sent = 0, acked = 0;  // bucket ordinals
  Clock::time_point stalled_since{};  // when its window filled while a bucket waited
  std::vector<std::byte> announce;    // the current bucket's announce and frame, for this peer
  std::vector<Request> bucket_sends;  // the current bucket's messages under way
  bool taking = false;                // takes the current bucket: its chunks and hash follow
  std::uint64_t posted = 0;           // bytes of the current payload sent to it so far
  std::list<Small> small;             // heartbeats
  std::string problem;                // set: drop it
  bool transfer_failed = false;       // the problem is a UCX transfer's error

  bool live() const { return problem.empty(); }
  void fail_transfer(const Error& e) {
    if (!problem.empty()) return;
    problem = e.what();
    transfer_failed = true;
  }
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

// Finished requests leave. A failed one fails the peer.
void settle(Peer& peer) {
  try {
    std::erase_if(peer.bucket_sends, [](Request& request) { return request.done(); });
    peer.small.remove_if([](Small& small) { return small.request.done(); });
  } catch (const Error& e) {
    peer.fail_transfer(e);
  }
}

}  // namespace

struct ServerState {
  ServeOptions options;
  Subscriber subscriber;
  // Buffers UCX may still write into until the worker is gone: declared before it.
  std::vector<std::byte> staged;                         // a device bucket's payload, on the host
  std::vector<std::byte> flipped;                        // the payload with a byte flipped (wire_fault.hpp)
  WireFault fault;                                       // of the current bucket: none but in a test build
  std::array<std::byte, 64> discard{};                   // what hear() throws away; never read
  std::list<Lingering> lingering;                        // receives hear() gave up on
  Worker worker;
  Pace pace{worker};  // between progress calls while a bucket is under way
  Socket listening;                      // the front door
  Socket spare{::open("/dev/null", O_RDONLY | O_CLOEXEC)};  // a descriptor to free when out of them
  std::vector<std::byte> worker_address;  // sent to each relay let in
  std::list<Door> doors;
  Clock::time_point doors_looked_at{};
  Clock::time_point listening_looked_at{};  // UCX's own listening sockets (Worker::check_listening)
  std::list<Peer> peers;                  // a list: peers keep their addresses
  QuietLog turned_away{kTurnedAwayLogEvery};
  QuietLog refused{kRefusedLogEvery};
  std::optional<ReceivedBucket> current;  // being sent; its lease held until every send is done
  std::span<const std::byte> payload;      // its payload, on the host
  std::span<const std::byte> on_wire;      // what is sent of it: the same bytes (but in a test build)
  PayloadHash payload_hash;                // of a payload in chunks: sent after them, to each peer
  Clock::time_point current_deadline{};
  std::uint64_t served = 0;
  std::optional<std::uint64_t> incarnation;  // of the channel's producer, as of the last bucket taken
  std::string address;
  pid_t pid = ::getpid();  // the serving process; a forked child inherits this, not the role

  ServerState(Subscriber sub, const ServeOptions& serve, const SocketAddress& listen, Socket front_door)
      : options(serve),
        subscriber(std::move(sub)),
        worker(interface_holding(listen), listen.storage.ss_family),
        listening(std::move(front_door)),
        worker_address(worker.address()) {
    worker.set_progress_calls(1);  // turn() hears after each
    address = to_string(local_address(listening));
  }
  ~ServerState() {
    for (auto& peer : peers) detail::close(worker, peer.endpoint, kCloseLimit);
    peers.clear();
    for (auto& receive : lingering) receive.request.cancel();  // while the worker lives; the bytes go after it
    payload_hash.stop();
    current.reset();  // after the peers and the hash: they read its slot
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

  // New connections at the front door, kMaxPending at most at once, besides max_peers relays:
  // the others are told why and closed at once, so that connections that never send hold no
  // descriptors here.
  void open_doors() {
    if (!spare) spare = Socket(::open("/dev/null", O_RDONLY | O_CLOEXEC));  // lost to a race for the last one
    for (int taken = 0; taken < kAcceptsPerTurn; ++taken) {
      sockaddr_storage from_address{};
      socklen_t length = sizeof from_address;
      Socket link(::accept4(listening.get(), reinterpret_cast<sockaddr*>(&from_address), &length,
                            SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!link) {
        int error = errno;
        if (error == ECONNABORTED || error == EINTR) continue;  // gone before it was taken
        if (error == EAGAIN || error == EWOULDBLOCK) return;
        if ((error == EMFILE || error == ENFILE) && spare) {
          turn_away_with_the_spare();
          continue;
        }
        // Out of memory, or of descriptors with no spare: the connection waits in the
        // listening queue, and the next look tries again.
        if (auto line = turned_away.line(message("cannot take a connection: ", std::strerror(error)))) log(*line);
        return;
      }
      auto from = to_string(from_address);
      std::string full = doors.size() >= kMaxPending          ? message(kMaxPending, " connections proving the token already")
                         : peers.size() >= options.max_peers ? message("max_peers (", options.max_peers, ") reached")
                                                             : "";
      if (!full.empty()) {
        turn_away(link, from, full);
        continue;
      }
      std::uint64_t key = 0;
      random_bytes(&key, sizeof key);
      doors.push_back({std::move(link), ServerDoor(options.token, (key & kKeyMask) | 1), from, Clock::now() + kProofTimeout});
    }
  }

  // A connection told why it is not taken, and left to close with its Socket. A fresh
  // connection's send buffer takes these few bytes: nothing is waited for.
  void turn_away(const Socket& link, const std::string& from, const std::string& why) {
    auto refusal = refusal_message(Refusal::Other, why);
    static_cast<void>(::send(link.get(), refusal.data(), refusal.size(), MSG_NOSIGNAL | MSG_DONTWAIT));
    if (auto line = turned_away.line(message("turned ", from, " away: ", why))) log(*line);
  }

  // Out of descriptors: the spare one is let go of to take the next connection and close it at
  // once, so that the listening queue drains instead of holding relays behind connections
  // that cannot be served until a descriptor is free.
  void turn_away_with_the_spare() {
    spare.reset();
    sockaddr_storage from_address{};
    socklen_t length = sizeof from_address;
    Socket link(::accept4(listening.get(), reinterpret_cast<sockaddr*>(&from_address), &length, SOCK_CLOEXEC));
    if (link) turn_away(link, to_string(from_address), "out of descriptors");
    link.reset();
    spare = Socket(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  }

  // Every connection at the front door moves as far as its bytes let it; those done with are
  // closed. Each reads only what its next message may hold, and has kProofTimeout in all.
  void tend_doors() {
    auto now = Clock::now();
    for (auto it = doors.begin(); it != doors.end();) {
      it = tend(*it, now) ? std::next(it) : doors.erase(it);
    }
  }

  // Relays served, and those welcomed at the front door that are still sending their address:
  // max_peers counts both.
  std::size_t peers_and_coming() const {
    return peers.size() + static_cast<std::size_t>(std::count_if(doors.begin(), doors.end(), [](const Door& entry) {
             return entry.door.state() == ServerDoor::State::Addressing;
           }));
  }

  // False once the connection is done with: let in, refused and closed, or gone. A connection
  // has kProofTimeout from its start to its end, the refusal's grace included.
  bool tend(Door& entry, Clock::time_point now) {
    auto& door = entry.door;
    int fd = entry.link.get();
    for (auto room = door.room(); !room.empty(); room = door.room()) {
      auto got = ::recv(fd, room.data(), room.size(), 0);
      if (got > 0) {
        door.got(static_cast<std::size_t>(got));
        continue;
      }
      if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;  // it left
      break;
    }
    if (door.state() == ServerDoor::State::Proved) {
      // Counted here, not at the connection: several may prove the token at once.
      if (peers_and_coming() >= options.max_peers) {
        door.refuse(Refusal::Other, message("max_peers (", options.max_peers, ") reached"));
      } else {
        door.welcome(subscriber.channel(), worker_address);
      }
    }
    if (door.state() == ServerDoor::State::Done) {
      let_in(entry);
      if (door.state() != ServerDoor::State::Closing) return false;
    } else if (door.state() != ServerDoor::State::Closing && now >= entry.due) {
      // The relay proved the token but sent no worker address: told so, not that it proved nothing.
      auto missing = door.state() == ServerDoor::State::Addressing ? "no worker address" : "no proof of the token";
      auto proved = door.state() == ServerDoor::State::Addressing ? " (the token was proved)" : "";
      door.refuse(Refusal::Other, message(missing, " within ", kProofTimeout.count(), " s", proved));
    }
    while (!door.output().empty()) {
      auto out = door.output();
      auto sent = ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
      if (sent > 0) {
        door.sent(static_cast<std::size_t>(sent));
        continue;
      }
      if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
      return false;
    }
    if (door.state() != ServerDoor::State::Closing) return true;
    if (!entry.refused) {
      entry.refused = true;
      entry.due = std::min(entry.due, now + kRefusalGrace);
      if (auto line = refused.line(message("refused ", entry.from, ": ", door.why()))) log(*line);
    }
    if (!entry.shut && door.output().empty()) {
      // Told: a relay reads the refusal, then the end of the connection. What it still sends
      // is read and thrown away until it closes, kRefusalGrace at most.
      ::shutdown(fd, SHUT_WR);
      entry.shut = true;
    }
    if (entry.shut) {
      std::array<std::byte, 512> scratch;
      auto got = ::recv(fd, scratch.data(), scratch.size(), 0);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
    }
    return now < entry.due;
  }

  // A relay through the front door: its UCX endpoint, and a heartbeat on it at once, the
  // first message of every link, which tells the relay that UCX reaches it. Refused at the
  // door when UCX cannot make the endpoint.
  void let_in(Door& entry) {
    auto& peer = peers.emplace_back();
    peer.from = entry.from;
    peer.key = entry.door.key();
    try {
      connect(worker.get(), peer.endpoint, entry.door.peer_address());
    } catch (const Error& e) {
      peers.pop_back();  // no endpoint: nothing under way
      entry.door.refuse(Refusal::Other, message("its UCX worker cannot be reached: ", e.what()));
      return;
    }
    std::uint64_t beat = 0;
    send_small(peer, Kind::Heartbeat, &beat, sizeof beat);
    peer.last_sent = Clock::now();
    log(message("serving ", peer.from, " from the next update"));
  }

  // Every message peers sent: acknowledgements, each the exact size, from the peer whose key it
  // carries. Anything else is taken off the queue (so that nothing piles up in it) and fails
  // the peer whose key it carries. A message not here whole at once came by rendezvous, which
  // no honest peer uses for these: its sender is failed too. All of the queue, after every
  // progress call: a peer that floods (it holds the token: only such a peer reaches UCX) must
  // not hold back the other peers' acknowledgements behind it, nor pile up.
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
      constexpr std::size_t expected = sizeof(Ack);
      bool wanted = peer != nullptr && kind == Kind::Ack && length == expected;
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
        peer->problem = text::message("sent a message it should not have (tag kind ", static_cast<int>(kind), ", ", length,
                                      " bytes)");
        continue;
      }
      Ack ack{};
      std::memcpy(&ack, into.get(), sizeof ack);
      if (ack.ordinal > peer->sent || ack.ordinal < peer->acked) {
        peer->problem = text::message("acknowledged bucket ", ack.ordinal, " of ", peer->sent);
      } else {
        peer->acked = ack.ordinal;
      }
    }
  }

  void drop_failed() {
    for (auto it = peers.begin(); it != peers.end();) {
      auto& peer = *it;
      // A transfer under way fails with the link, and says less than the link's end does.
      if (peer.endpoint.failed != UCS_OK && (peer.problem.empty() || peer.transfer_failed)) {
        peer.problem = message("the link ended (", ucx().status_string(peer.endpoint.failed),
                               "): the relay left, or its host or the network failed");
      }
      if (peer.live()) {
        ++it;
        continue;
      }
      log(message("dropped ", peer.from, ": ", peer.problem));
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
    fault = WireFault::for_bucket(bucket.sequence());
    on_wire = fault.on_wire(payload, flipped);
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
      if (!peer.live() || (!peer.joined && view.bucket_index() != 0)) continue;
      peer.joined = true;
      announce.ordinal = ++peer.sent;
      peer.announce.resize(message_bytes);
      auto* at = peer.announce.data();
      std::memcpy(at, &announce, sizeof announce);
      std::memcpy(at + sizeof announce, frame.data(), frame.size());
      if (whole) {
        std::memset(at + sizeof announce + frame.size(), 0, announce.whole_offset - sizeof announce - frame.size());
        if (!on_wire.empty()) std::memcpy(at + announce.whole_offset, on_wire.data(), on_wire.size());
        if (fault.bad_padding() && announce.whole_offset > sizeof announce + frame.size()) {
          at[announce.whole_offset - 1] = std::byte{1};
        }
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
        if (fault.withhold_hash()) continue;
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
      if (peer.live() && peer.bucket_sends.empty() && peer.small.empty() && now - peer.last_sent > kHeartbeatEvery) {
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
    // The front door, once per kLocalSlice: a transfer's turns come back to back.
    if (auto looked = Clock::now(); looked - doors_looked_at >= kLocalSlice) {
      doors_looked_at = looked;
      if (looked - listening_looked_at >= kListeningEvery) {
        // serve's one worker for life: a listener UCX closed leaves every relay let in unable
        // to reach it, while serve looked alive. Ended instead, for a supervisor to restart.
        listening_looked_at = looked;
        worker.check_listening([this] {
          spare.reset();  // serve ends: two descriptors for its last words
          listening.reset();
        });
      }
      open_doors();
      tend_doors();
    }
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
          peer.problem = message("took no bucket within ", options.peer_timeout.count(), " ms");
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
      if (!peer.live()) continue;
      any_peer = true;
      if (has_room(peer)) {
        peer.stalled_since = {};
        continue;
      }
      if (peer.stalled_since == Clock::time_point{}) peer.stalled_since = now;
      if (now - peer.stalled_since > options.peer_timeout) {
        peer.problem = message("acknowledged nothing within ", options.peer_timeout.count(), " ms");
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
      log(message("skipped a bucket of the channel that failed its checks: ", to_string(e.code()), ": ", e.what()));
      return;
    }
    if (!bucket) return;
    if (incarnation && *incarnation != bucket->incarnation()) {
      log(message("the channel's next producer is here (incarnation ", bucket->incarnation(), ")"));
    }
    incarnation = bucket->incarnation();
    current = std::move(bucket);
    announce_current();
  }
};

}  // namespace detail

Server Server::start(std::string_view channel, const ServeOptions& options, const Deadline& attach_deadline) {
  if (options.token.empty()) throw Error(ErrorCode::InvalidArgument, "serve needs a token (read_token_file)");
  if (options.window == 0 || options.max_peers == 0 || options.peer_timeout.count() <= 0) {
    throw Error(ErrorCode::InvalidArgument, "serve needs window, max_peers and peer_timeout above 0");
  }
  if (options.peer_timeout > kLongestTimeout) {  // now() + it would wrap into the past
    throw Error(ErrorCode::InvalidArgument, "serve's peer_timeout is at most 10^9 s");
  }
  if (options.max_peers > kMostPeers) {
    text::fail(ErrorCode::InvalidArgument, "serve's max_peers is at most ", kMostPeers, ", not ", options.max_peers);
  }
  auto address = detail::parse_address(options.listen, true);
  auto front_door = detail::listen_on(address);  // before the channel is waited for: a bad address fails at once
  auto subscriber = Subscriber::attach(channel, attach_deadline, {.follow_restarts = true});
  return Server(std::make_unique<detail::ServerState>(std::move(subscriber), options, address, std::move(front_door)));
}

Server::Server(std::unique_ptr<detail::ServerState> state) : state_(std::move(state)) {}
Server::Server(Server&&) noexcept = default;
Server& Server::operator=(Server&&) noexcept = default;
Server::~Server() { close(); }

void Server::serve_for(const Deadline& until) {
  if (!state_) throw Error(ErrorCode::InvalidArgument, "serve_for() on a closed server");
  if (state_->pid != ::getpid()) {
    text::fail(ErrorCode::InvalidArgument, "the server of ", state_->address, " belongs to process ", state_->pid,
               "; process ", ::getpid(), " was forked from it and cannot serve");
  }
  for (auto now = detail::Clock::now(); !until.passed(now) && !until.interrupted(now); now = detail::Clock::now()) {
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
  return static_cast<std::uint32_t>(state_->peers.size());
}

std::uint64_t Server::buckets_served() const noexcept { return state_ ? state_->served : 0; }

void Server::close() noexcept {
  // A forked child's copy of the state is left as it is: tearing it down would close the
  // parent's links on sockets the two share, and wait for a hashing thread the child lacks.
  if (state_ && state_->pid != ::getpid()) static_cast<void>(state_.release());
  state_.reset();
}

}  // namespace tensorbucket::net
