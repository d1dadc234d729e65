// `tbucket serve` and `tbucket relay`: a channel exported to the network, and received into a
// local channel on another host (include/tensorbucket/net.hpp, docs/network.md).
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <thread>

#include "commands.hpp"
#include "exit_codes.hpp"
#include "tensorbucket/net.hpp"

namespace tensorbucket::cli {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// The relay's local producer: republishes each remote bucket, reusing one builder while the
// layout and the receive buffer stay the same (the fast path, as for any producer).
class Republisher {
 public:
  explicit Republisher(Publisher publisher) : publisher_(std::move(publisher)) {}

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
};

int stopped(const char* what) {
  std::fprintf(stderr, "tbucket: stopped by signal %d; %s\n", stop_signal(), what);
  return 128 + stop_signal();
}

// Unless the user set it: a server restarted on its port binds it again at once, not after
// TIME_WAIT (UCX reads it when the worker is made).
void default_ucx_settings() { ::setenv("UCX_TCP_CM_REUSEADDR", "y", 0); }

}  // namespace

int run_serve(const ServeCommandOptions& options) {
  install_stop_handlers();
  default_ucx_settings();
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
  default_ucx_settings();
  net::ConnectOptions connect{.token = net::read_token_file(options.token_file),
                              .channel = options.channel,
                              .max_bucket_bytes = options.max_bucket_bytes,
                              .idle_timeout = std::chrono::milliseconds(options.idle_timeout_ms)};
  const auto& local = options.as.empty() ? options.channel : options.as;
  Republisher republisher(Publisher::create(local, {.slots = options.slots,
                                                    .max_consumers = options.max_consumers,
                                                    .min_consumers = options.consumers,
                                                    .payload_checksum = options.checksum,
                                                    .location = PayloadLocation::parse(options.device),
                                                    .policy = parse_overflow_policy(options.policy),
                                                    .update_buckets = options.update_buckets}));
  auto log = [&](const std::string& line) {
    if (!options.quiet) std::fprintf(stderr, "tbucket relay: %s\n", line.c_str());
  };
  // What was republished last: a server restarted on a channel that still holds it sends it
  // again, and it must not reach the local consumers twice.
  std::optional<std::pair<std::uint64_t, std::uint64_t>> last;  // (incarnation, sequence)
  std::uint64_t relayed = 0;
  auto backoff = 100ms;
  bool connected_once = false;
  while (stop_signal() == 0 && (options.buckets == 0 || relayed < options.buckets)) {
    std::optional<net::RemoteSubscriber> remote;
    try {
      remote.emplace(net::RemoteSubscriber::connect(options.connect, connect,
                                                    std::chrono::milliseconds(std::min<std::uint64_t>(options.timeout_ms, 5000))));
      log("connected to " + options.connect + ", channel '" + options.channel + "' → local '" + local + "'");
      connected_once = true;
      backoff = 100ms;
      bool skipping = false;  // the rest of an update of which a bucket was not republished
      while (stop_signal() == 0 && (options.buckets == 0 || relayed < options.buckets)) {
        auto bucket = remote->next(kWaitSlice);
        if (!bucket) continue;
        const auto& view = bucket->view();
        std::pair<std::uint64_t, std::uint64_t> id{bucket->incarnation(), bucket->sequence()};
        if (view.bucket_index() == 0) skipping = false;
        if (skipping || (last && last->first == id.first && id.second <= last->second)) continue;
        if (!republisher.publish(view, options.timeout_ms)) {
          if (stop_signal() != 0) break;
          log("Timeout: no local slot came free within " + std::to_string(options.timeout_ms) + " ms; waiting for " +
              republisher.publisher().waiting_for() + "; reconnecting, to resume at the next update");
          break;
        }
        last = id;
        ++relayed;
      }
    } catch (const Error& e) {
      if (e.code() == ErrorCode::Unauthorized || e.code() == ErrorCode::InvalidArgument ||
          e.code() == ErrorCode::ChannelMissing) {
        std::fprintf(stderr, "tbucket: %s: %s\n", std::string(to_string(e.code())).c_str(), e.what());
        return exit_code_for(e.code());
      }
      log(std::string(to_string(e.code())) + ": " + e.what() + "; reconnecting");
      if (!connected_once && e.code() != ErrorCode::NetworkError) throw;
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
  std::printf("relayed %llu buckets from %s to local channel '%s'\n", static_cast<unsigned long long>(relayed),
              options.connect.c_str(), local.c_str());
  return drained ? kOk : kTimeout;
}

}  // namespace tensorbucket::cli
