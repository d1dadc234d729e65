// `tbucket serve` and `tbucket relay`: a channel exported to the network, and received into a
// local channel on another host (include/tensorbucket/net.hpp, docs/network.md).
#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>
#include <thread>

#include "commands.hpp"
#include "exit_codes.hpp"
#include "tensorbucket/net.hpp"

namespace tensorbucket::cli {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Payloads from this size on are received straight into a local slot (the in-place path);
// smaller ones into a buffer, then copied, which keeps one builder for a layout sent again.
constexpr std::uint64_t kReceiveInPlaceFrom = 4ull << 20;

// The relay's local producer: republishes each remote bucket, reusing one builder while the
// layout and the receive buffer stay the same (the fast path, as for any producer), or
// commits the slot a large payload was received into.
class Republisher {
 public:
  explicit Republisher(Publisher publisher) : publisher_(std::move(publisher)) {}

  // Where a remote payload goes: a reserved local slot when it is large, the local channel
  // is on the host, and the frame lays its entries out as a local layout would; else nowhere
  // (the remote subscriber's buffer). The frame was not verified yet: a bad one only makes
  // this say nowhere, and next() then rejects it.
  std::span<std::byte> place(std::uint64_t payload_bytes, std::span<const std::byte> frame, std::uint64_t timeout_ms) {
    reservation_.reset();
    if (payload_bytes < kReceiveInPlaceFrom || !publisher_.location().on_host()) return {};
    try {
      auto header = read_header(frame);
      auto manifest = decode_manifest(manifest_bytes(header, frame));
      BucketBuilder layout;
      for (const auto& entry : manifest.entries) layout.declare(entry.name, entry.dtype, entry.shape);
      for (const auto& group : manifest.groups) layout.group(group.name, group.members);
      layout.version(manifest.version).bucket(manifest.bucket_index, manifest.bucket_count);
      const auto& laid = layout.manifest().entries;
      for (std::size_t i = 0; i < laid.size(); ++i) {
        if (laid[i].byte_offset != manifest.entries[i].byte_offset) return {};
      }
      // Exactly: the frame is not verified yet, and a slot grows to what its layout needs, so
      // a frame that declared more would take shared memory past max_bucket_bytes.
      if (layout.payload_bytes() != payload_bytes) return {};
      with_deadline(timeout_ms, [&](auto slice) {
        if (auto reserved = publisher_.reserve(layout, slice)) reservation_.emplace(std::move(*reserved));
        return reservation_.has_value();
      });
    } catch (const Error&) {
      return {};
    }
    return reservation_ ? reservation_->payload().first(payload_bytes) : std::span<std::byte>();
  }

  // Publishes `view`: commits the slot place() gave, when the view is in it.
  bool publish_placed(const BucketView& view, std::uint64_t timeout_ms) {
    if (reservation_ && !view.payload().empty() && view.payload().data() == reservation_->payload().data()) {
      reservation_->commit();
      reservation_.reset();
      return true;
    }
    reservation_.reset();
    return publish(view, timeout_ms);
  }

  void abandon() { reservation_.reset(); }

  // False when the local consumers took no slot within `timeout_ms`.
  bool publish(const BucketView& view, std::uint64_t timeout_ms) {
    if (!layout_ || &layout_->manifest() != &view.manifest() || layout_->payload().data() != view.payload().data()) {
      builder_ = BucketBuilder();
      const auto& manifest = view.manifest();
      for (const auto& entry : manifest.entries) {
        builder_.add(entry.name, entry.dtype, entry.shape, view.payload().data() + entry.byte_offset);
      }
      for (const auto& group : manifest.groups) builder_.group(group.name, group.members);
      layout_ = view;  // keeps the verified layout alive, so its address names it
    }
    builder_.version(view.version()).bucket(view.bucket_index(), view.bucket_count());
    return with_deadline(timeout_ms, [&](auto slice) { return publisher_.publish(builder_, slice); });
  }
  Publisher& publisher() { return publisher_; }

 private:
  Publisher publisher_;
  BucketBuilder builder_;
  std::optional<BucketView> layout_;
  std::optional<Reservation> reservation_;  // place()'s slot, until published or abandoned
};

int stopped(const char* what) {
  std::fprintf(stderr, "tbucket: stopped by signal %d; %s\n", stop_signal(), what);
  return 128 + stop_signal();
}

}  // namespace

int run_serve(const ServeCommandOptions& options) {
  install_stop_handlers();
  net::ServeOptions serve{.listen = options.listen,
                          .token = net::read_token_file(options.token_file),
                          .peer_timeout = std::chrono::milliseconds(options.peer_timeout_ms),
                          .max_peers = options.max_peers};
  std::optional<net::Server> server;
  bool started = with_deadline(options.timeout_ms, [&](auto slice) {
    try {
      server.emplace(net::Server::start(options.channel, serve, slice));
      return true;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ChannelMissing) throw;
      return false;
    }
  });
  if (stop_signal() != 0) return stopped("served nothing");
  if (!started) {
    std::fprintf(stderr, "tbucket: ChannelMissing: channel '%s' had no live producer within %llu ms\n",
                 options.channel.c_str(), static_cast<unsigned long long>(options.timeout_ms));
    return kChannelUnavailable;
  }
  std::fprintf(stderr, "tbucket serve: channel '%s' on %s\n", options.channel.c_str(), server->address().c_str());
  while (stop_signal() == 0) server->serve_for(kWaitSlice);
  auto served = server->buckets_served();
  server->close();
  std::fprintf(stderr, "tbucket serve: served %llu buckets\n", static_cast<unsigned long long>(served));
  return stopped("peers disconnected");
}

int run_relay(const RelayOptions& options) {
  install_stop_handlers();
  net::ConnectOptions connect{.token = net::read_token_file(options.token_file),
                              .channel = options.channel,
                              .max_bucket_bytes = options.max_bucket_bytes,
                              .idle_timeout = std::chrono::milliseconds(options.idle_timeout_ms)};
  const auto& local = options.as.empty() ? options.channel : options.as;
  Republisher republisher(Publisher::create(local, options.local.publisher()));
  auto log = [&](const std::string& line, bool even_quiet = false) {
    if (!options.quiet || even_quiet) std::fprintf(stderr, "tbucket relay: %s\n", line.c_str());
  };
  // What was republished last: a server restarted on a channel that still holds it sends it
  // again, and it must not reach the local consumers twice.
  std::optional<std::pair<std::uint64_t, std::uint64_t>> last;  // (incarnation, sequence)
  std::uint64_t relayed = 0;
  // The rate line: from the end of the first bucket's arrival to the end of the last one's publish.
  std::uint64_t bytes_after_first = 0;
  Clock::time_point first{}, latest{};
  auto backoff = 100ms;
  bool connected_once = false;
  // Each try: --timeout-ms, held between 1 and 5 s, so that --timeout-ms 0 (a local publish
  // that never waits) still leaves a connect time to answer.
  auto connect_timeout = std::chrono::milliseconds(std::clamp<std::uint64_t>(options.timeout_ms, 1000, 5000));
  // Under --quiet, each reason the link went down is told once, until buckets flow again: a
  // mistyped port or a server not up yet is never silent, and never told every 2 s either.
  std::set<std::string> told;
  auto lost = [&](const std::string& why, bool even_quiet = false) {
    // Some reasons carry changing figures (a local consumer's pid and wait): held to a bound,
    // the set never grows with an outage that lasts for days.
    if (told.size() >= 64) told.clear();
    log(why + "; reconnecting", told.insert(why).second || even_quiet);
  };
  while (stop_signal() == 0 && (options.buckets == 0 || relayed < options.buckets)) {
    std::optional<net::RemoteSubscriber> remote;
    try {
      remote.emplace(net::RemoteSubscriber::connect(options.connect, connect, connect_timeout));
      log("connected to " + options.connect + ", channel '" + options.channel + "' → local '" + local + "'");
      connected_once = true;
      backoff = 100ms;
      while (stop_signal() == 0 && (options.buckets == 0 || relayed < options.buckets)) {
        auto bucket = remote->next(kWaitSlice, {}, [&](std::uint64_t payload_bytes, std::span<const std::byte> frame) {
          return republisher.place(payload_bytes, frame, options.timeout_ms);
        });
        if (!bucket) continue;
        const auto& view = bucket->view();
        std::pair<std::uint64_t, std::uint64_t> id{bucket->incarnation(), bucket->sequence()};
        if (last && last->first == id.first && id.second <= last->second) {
          republisher.abandon();
          continue;
        }
        bool published = false;
        try {
          published = republisher.publish_placed(view, options.timeout_ms);
        } catch (const Error& e) {
          // The server sent a bucket out of its update's order: nothing was published.
          if (e.code() != ErrorCode::InvalidArgument) throw;
          lost(std::string("the server sent a bucket out of order (") + e.what() + ")");
          break;
        }
        if (!published) {
          if (stop_signal() != 0) break;
          lost("Timeout: no local slot came free within " + std::to_string(options.timeout_ms) + " ms; waiting for " +
               republisher.publisher().waiting_for());
          break;
        }
        last = id;
        told.clear();  // buckets flow: a reason the link goes down again is news
        latest = Clock::now();
        if (relayed++ == 0) {
          first = latest;
        } else {
          bytes_after_first += view.payload().size();
        }
      }
    } catch (const Error& e) {
      // A slot a rejected payload was received into is never published. The link goes first:
      // a receive into the slot that UCX had under way ends with it.
      remote.reset();
      republisher.abandon();
      // A refused token ends the relay when it was never served: the configuration is wrong.
      // Once served, it tries again: what answers now may be an impostor on the server's port
      // (a refusal comes before the server proved anything), and it must not end the relay.
      bool unauthorized = e.code() == ErrorCode::Unauthorized;
      if ((unauthorized && !connected_once) || e.code() == ErrorCode::InvalidArgument ||
          e.code() == ErrorCode::ChannelMissing) {
        std::fprintf(stderr, "tbucket: %s: %s\n", std::string(to_string(e.code())).c_str(), e.what());
        return exit_code_for(e.code());
      }
      // A refusal is told every time, also under --quiet: it may go on.
      lost(std::string(to_string(e.code())) + ": " + e.what(), unauthorized);
      if (!connected_once && e.code() != ErrorCode::NetworkError) throw;
      if (unauthorized) backoff = std::chrono::milliseconds(2000);
    }
    remote.reset();
    if (stop_signal() != 0 || (options.buckets != 0 && relayed >= options.buckets)) break;
    with_deadline(static_cast<std::uint64_t>(backoff.count()), [](auto slice) {
      std::this_thread::sleep_for(slice);
      return false;
    });
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
  }
  if (stop_signal() != 0) return stopped("local channel closed");
  bool drained = with_deadline(options.timeout_ms, [&](auto slice) { return republisher.publisher().drain(slice); });
  auto seconds = std::chrono::duration<double>(latest - first).count();
  std::printf("relayed %llu buckets from %s to local channel '%s'; after the first, %.1f MiB in %.3f s: %.1f MiB/s\n",
              static_cast<unsigned long long>(relayed), options.connect.c_str(), local.c_str(),
              static_cast<double>(bytes_after_first) / (1 << 20), seconds,
              seconds > 0 ? static_cast<double>(bytes_after_first) / (1 << 20) / seconds : 0.0);
  return drained ? kOk : kTimeout;
}

}  // namespace tensorbucket::cli
