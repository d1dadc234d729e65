// `tbucket serve` and `tbucket relay`: a channel exported to the network, and received into a
// local channel on another host (include/tensorbucket/net.hpp, docs/network.md).
#include <algorithm>
#include <cstdio>
#include <optional>

#include "commands.hpp"
#include "exit_codes.hpp"
#include "tensorbucket/net.hpp"

namespace tensorbucket::cli {

int run_serve(const ServeCommandOptions& options) {
  install_stop_handlers();
  net::ServeOptions serve{.listen = options.listen,
                          .token = net::read_token_file(options.token_file),
                          .peer_timeout = std::chrono::milliseconds(options.peer_timeout_ms),
                          .max_peers = options.max_peers};
  auto server = unless_stopped([&] { return net::Server::start(options.channel, serve, until_stopped(options.timeout_ms)); });
  if (stop_signal() != 0) return stopped("served nothing");  // else started
  std::fprintf(stderr, "tbucket serve: channel %s on %s\n", text::message(text::Quoted{options.channel}).c_str(),
               server->address().c_str());
  server->serve_for(until_stopped());
  auto served = server->buckets_served();
  server->close();
  std::fprintf(stderr, "tbucket serve: served %llu buckets\n", static_cast<unsigned long long>(served));
  return stopped("peers disconnected");
}

int run_relay(const RelayOptions& options) {
  install_stop_handlers();
  auto timeout = as_timeout(options.timeout_ms);
  net::RelayOptions relay_options{
      .connect = options.connect,
      .remote = {.token = net::read_token_file(options.token_file),
                 .channel = options.channel,
                 .max_bucket_bytes = options.max_bucket_bytes,
                 .idle_timeout = std::chrono::milliseconds(options.idle_timeout_ms)},
      .local = options.as,
      .publisher = options.local.publisher(),
      .timeout = timeout,
      .log =
          [&](const std::string& line, bool important) {
            if (!options.quiet || important) std::fprintf(stderr, "tbucket relay: %s\n", line.c_str());
          },
      .interrupted = [] { return stop_signal() != 0; }};
  auto created = unless_stopped([&] { return net::Relay::create(relay_options, removal_wait()); });
  if (!created) return stopped("no channel was created");
  auto& relay = *created;
  relay.relay_for(Deadline::never(), options.buckets);  // until a stop signal (relay_options.interrupted)
  relay.disconnect();  // the server frees this relay's place while the local consumers finish
  if (stop_signal() != 0) return stopped("local channel closed");
  bool drained = relay.drain(timeout);
  auto stats = relay.stats();
  auto seconds = std::chrono::duration<double>(stats.after_first).count();
  auto mib = static_cast<double>(stats.bytes_after_first) / (1 << 20);
  std::printf("relayed %llu buckets from %s to local channel '%s'; after the first, %.1f MiB in %.3f s: %.1f MiB/s\n",
              static_cast<unsigned long long>(stats.buckets), options.connect.c_str(), relay.local_channel().c_str(), mib,
              seconds, seconds > 0 ? mib / seconds : 0.0);
  return drained ? kOk : kTimeout;
}

}  // namespace tensorbucket::cli
