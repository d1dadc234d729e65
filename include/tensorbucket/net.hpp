// Across hosts: a channel exported to the network (Server) and received on another host
// (RemoteSubscriber), over UCX. In the separate library tensorbucket-net, built where UCX is.
//
// A Server is an ordinary consumer of a local channel. It serves each bucket it receives to
// the remote peers that proved they hold the shared token: a payload of 1 MiB or less in one
// message with the frame, a larger one in chunks sent from the slot itself (UCX moves them by
// remote memory access where the transport has it, streamed otherwise, and keeps each slot's
// registration in its cache).
// A RemoteSubscriber receives those buckets into host memory and verifies each one exactly as
// a local consumer does (docs/format.md rules 1-6), and the payload hash, which the network
// always carries, before it returns it. A Relay (what `tbucket relay` runs) republishes them
// into a local channel, so the servers on that host use Subscriber unchanged.
//
// Semantics (docs/network.md has the protocol, the failure cases and what an attacker on the
// network can and cannot do):
// - In order: a peer gets the channel's buckets in the order the server received them,
//   starting at the first bucket of the next update after it joined (updates are units).
// - Bounded: a peer that does not take a bucket within ServeOptions::peer_timeout is dropped,
//   so a slow or dead host holds the local channel at most that long. A RemoteSubscriber that
//   hears nothing (not even the server's heartbeat) within ConnectOptions::idle_timeout
//   throws NetworkError. Connecting again resumes at the next whole update.
// - Authenticated, not encrypted: both sides prove they hold the token (HMAC-SHA256 over fresh
//   nonces) before anything is served. Anyone on the path can read the weights.
//
// Thread safety: each object is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <optional>
#include <string>
#include <string_view>

#include "tensorbucket/bucket.hpp"
#include "tensorbucket/channel.hpp"

namespace tensorbucket::net {
namespace detail {
struct ServerState;
struct RemoteState;
struct RelayState;
}  // namespace detail

// The shared secret in `path`: 16 to 4096 bytes (a trailing newline is dropped), in a regular
// file of this user that neither group nor others may read or write (0600 or 0400).
// PermissionDenied otherwise, naming the path and what is wrong; InvalidArgument for its size.
std::string read_token_file(const std::string& path);

// The longest peer_timeout and idle_timeout: 10^9 s (InvalidArgument past it).
inline constexpr std::chrono::milliseconds kLongestTimeout{1'000'000'000'000};
// The most relays one server serves at once (InvalidArgument past it): each holds a
// connection and gets each bucket's sends, from one thread.
inline constexpr std::uint32_t kMostPeers = 1024;

struct ServeOptions {
  // "ADDRESS:PORT" ("[ADDRESS]:PORT" for IPv6), an address of this host: there is no default,
  // so that weights are never served on every interface by accident. Port 0 picks a free one.
  std::string listen;
  std::string token;  // read_token_file()
  std::chrono::milliseconds peer_timeout{10000};  // a peer that takes no bucket within this is dropped
  std::uint32_t max_peers = 16;  // 1 to kMostPeers
  std::uint32_t window = 2;  // buckets sent to a peer before it acknowledged the first of them
};

class Server {
 public:
  // Attaches to `channel` as a consumer (waiting until `attach_deadline`, errors as
  // Subscriber::attach; it follows the channel across producer restarts) and listens.
  // InvalidArgument for a bad address or option; NetworkError when the address cannot be
  // bound (not this host's, or the port is taken).
  static Server start(std::string_view channel, const ServeOptions& options,
                      const Deadline& attach_deadline);

  Server(Server&&) noexcept;
  Server& operator=(Server&&) noexcept;
  ~Server();  // close()

  // Serves until `until` (a duration: for that long; interrupted: once asked, within
  // Deadline::kAskEvery): admits and authenticates peers, sends every new bucket to the peers
  // in the game, drops the slow and the dead. Problems with one peer are logged (stderr) and
  // drop that peer only; so is a local bucket that fails its checks, which is skipped. Other
  // errors of the local channel are thrown as Subscriber::next() throws them, but for
  // ProducerGone (the server waits for the channel's next producer). InvalidArgument in a
  // child forked from the serving process: the server stays the parent's.
  void serve_for(const Deadline& until);

  std::string address() const;       // what it listens on, the port resolved
  std::uint32_t peers() const noexcept;        // authenticated peers now
  std::uint64_t buckets_served() const noexcept;  // buckets sent to at least one peer
  // Disconnects every peer, detaches from the channel. In a forked child it only lets go of
  // the server: the links, the channel and the hashing thread are the parent's.
  void close() noexcept;

 private:
  explicit Server(std::unique_ptr<detail::ServerState> state);
  std::unique_ptr<detail::ServerState> state_;
};

struct ConnectOptions {
  std::string token;    // read_token_file()
  std::string channel;  // the served channel must have this name (ChannelMissing); empty: any
  // The largest payload accepted: a bigger one is refused before any memory is taken for it.
  std::uint64_t max_bucket_bytes = 64ull << 30;
  std::chrono::milliseconds idle_timeout{5000};  // silence after which the link counts as dead
};

// A bucket received from a server, verified. Owns its bytes (host memory), unless next() put
// them where a PayloadPlace said.
class RemoteBucket {
 public:
  const BucketView& view() const noexcept { return view_; }
  std::uint64_t sequence() const noexcept { return sequence_; }        // in the served channel
  std::uint64_t incarnation() const noexcept { return incarnation_; }  // of the served channel's producer

 private:
  friend struct detail::RemoteState;
  RemoteBucket(BucketView view, std::uint64_t sequence, std::uint64_t incarnation, std::shared_ptr<void> bytes)
      : view_(std::move(view)), sequence_(sequence), incarnation_(incarnation), bytes_(std::move(bytes)) {}
  BucketView view_;
  std::uint64_t sequence_;
  std::uint64_t incarnation_;
  std::shared_ptr<void> bytes_;  // next()'s buffer, reused by the next bucket once this is gone; or none
};

// Where RemoteSubscriber::next() receives a payload, asked once the bucket's frame came: given
// the payload's size and the frame (docs/format.md; not yet verified), memory for at least that
// many bytes (a local slot, for a relay), or an empty span for next()'s own buffer.
using PayloadPlace = std::function<std::span<std::byte>(std::uint64_t payload_bytes, std::span<const std::byte> frame)>;

class RemoteSubscriber {
 public:
  // Connects to a Server at "HOST:PORT" and authenticates both ways before `deadline` (24 h
  // at most; not interrupted). NetworkError when it cannot be reached, Unauthorized when either
  // side's token proof fails.
  static RemoteSubscriber connect(std::string_view address, const ConnectOptions& options, const Deadline& deadline);

  RemoteSubscriber(RemoteSubscriber&&) noexcept;
  RemoteSubscriber& operator=(RemoteSubscriber&&) noexcept;
  ~RemoteSubscriber();

  // The next bucket, verified (rules 1-6 and the payload hash); nullopt when none came before
  // `deadline`. Verification errors throw and drop the link: a server that sends a bad bucket
  // is not trusted further. NetworkError when the link is lost; connect again to go on. A bucket
  // begun is received whole, which may go past `deadline` (idle_timeout bounds it).
  // With `place`, the payload lands where it says; the bucket's view then points there, and
  // when next() throws, what it wrote there is not a verified bucket. next() waits up to 1 s
  // for the receives under way to end before it throws; only once the RemoteSubscriber is
  // destroyed is it certain that nothing writes there any more.
  std::optional<RemoteBucket> next(const Deadline& deadline, const VerifyOptions& options = {},
                                   const PayloadPlace& place = {});

  const std::string& address() const noexcept;
  const std::string& channel() const noexcept;  // the served channel's name

 private:
  explicit RemoteSubscriber(std::unique_ptr<detail::RemoteState> state);
  std::unique_ptr<detail::RemoteState> state_;
};

struct RelayOptions {
  std::string connect;      // the Server's "HOST:PORT"
  ConnectOptions remote;    // the token, the served channel's name (required), the link's limits
  std::string local;        // the local channel's name; empty: the served channel's
  PublisherOptions publisher;  // the local channel's
  // How long a local publish waits for a slot (local consumers behind: the link is then dropped
  // and made again), and, held between 1 and 5 s, a connect.
  std::chrono::milliseconds timeout{10000};
  // Told what a person watching the relay wants to know, a line each: connected, and why the
  // link went down. `important` lines are for a quiet log too: a reason the first time it comes
  // since buckets last flowed, and every refusal.
  std::function<void(const std::string& line, bool important)> log;
  // Asked while waiting for the link's next bucket, for a local slot and between tries (every
  // Deadline::kAskEvery): true ends relay_for() or drain() early, as their own deadline's
  // interruption does. A connect (5 s at most) and a bucket already begun run to their end
  // first.
  std::function<bool()> interrupted;
};

struct RelayStats {
  std::uint64_t buckets = 0;            // republished
  std::uint64_t bytes_after_first = 0;  // the payload bytes of those after the first
  std::chrono::nanoseconds after_first{};  // from the first one's publish to the last one's
};

// A served channel received and republished, each bucket verified (rules 1-6 and the payload
// hash), into a local channel of this host, in order; a payload past 4 MiB is received straight
// into a local slot. A link that breaks (a server gone, a silent or hostile peer, local consumers
// that took no slot within `timeout`) is made again, 100 ms later doubling up to 2 s, and the
// relay resumes at the next whole update; a bucket sent again after a server's restart is not
// republished twice.
class Relay {
 public:
  // Creates the local channel (errors as Publisher::create, whose `wait` this is); connects in
  // relay_for().
  static Relay create(const RelayOptions& options, const Deadline& wait = std::chrono::seconds(10));

  Relay(Relay&&) noexcept;
  Relay& operator=(Relay&&) noexcept;
  ~Relay();  // close()

  // Relays until `until` (a duration: for that long), until `buckets` more were republished
  // (0: no limit), or until interrupted; returns how many it republished. Throws what trying again cannot mend:
  // Unauthorized while no server has let it in yet (a wrong token: once served, a refusal is
  // retried, as an impostor on the port may answer), ChannelMissing (the server serves another
  // channel), InvalidArgument; before the first connection, every error but NetworkError.
  std::uint64_t relay_for(const Deadline& until, std::uint64_t buckets = 0);
  // Until the local consumers released every bucket; false at `deadline` or when interrupted.
  bool drain(const Deadline& deadline);

  // Drops the link, so that the server frees its place; the next relay_for() connects again and
  // resumes at the next whole update.
  void disconnect() noexcept;

  RelayStats stats() const noexcept;
  const std::string& local_channel() const noexcept;
  void close() noexcept;  // drops the link and closes the local channel

 private:
  explicit Relay(std::unique_ptr<detail::RelayState> state);
  std::unique_ptr<detail::RelayState> state_;
  std::string local_channel_;
};

}  // namespace tensorbucket::net
