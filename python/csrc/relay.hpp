// The Python Relay: a channel served from another host, republished into a local channel
// (tensorbucket/net.hpp), relayed without the GIL until a deadline that close() from another
// thread, the interpreter's exit and Ctrl+C interrupt (PyWait), so that they end a relay() that
// has no time limit; Ctrl+C once a local publish that waits for a slot has ended.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "tensorbucket/net.hpp"
#include "waits.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

class PyRelay {
 public:
  PyRelay(const std::string& connect, const std::string& channel, const std::string& token_file,
          const std::string& local, std::uint32_t slots, std::uint32_t min_consumers, std::uint32_t max_consumers,
          const std::string& policy, std::uint32_t update_buckets, std::optional<double> timeout, double idle_timeout,
          std::uint64_t max_bucket_bytes) {
    net::RelayOptions options{
        .connect = connect,
        .remote = {.token = net::read_token_file(token_file),
                   .channel = channel,
                   .max_bucket_bytes = max_bucket_bytes,
                   .idle_timeout = limit_in_ms(idle_timeout, "idle_timeout")},
        .local = local,
        .publisher = {.slots = slots,
                      .max_consumers = max_consumers,
                      .min_consumers = min_consumers,
                      .policy = parse_overflow_policy(policy),
                      .update_buckets = update_buckets},
        .timeout = local_timeout(timeout),
        // As Server logs its peers: what a person watching wants to know, on stderr.
        .log = [](const std::string& line, bool) { std::fprintf(stderr, "tensorbucket relay: %s\n", line.c_str()); },
        // close() from another thread, or the interpreter's exit, ends a local publish that
        // waits for a slot (Ctrl+C, asked by relay()'s deadline, is seen after such a wait).
        .interrupted = [this] { return turn_.closing.load() || OutsideGil::exiting_now(); }};
    PyWait wait(kRemovalWait);  // for a remover of the local channel's name, as created() waits
    relay_ = wait.in_seconds(kRemovalWait).run(
        [&](const Deadline& deadline) { return net::Relay::create(options, deadline); });
    local_channel_ = relay_->local_channel();
  }

  // Relays for `duration` seconds (None: until close() or Ctrl+C), or until `buckets` more were
  // republished (0: no limit), without the GIL; returns how many it republished.
  std::uint64_t relay(std::optional<double> duration, std::uint64_t buckets) {
    PyWait wait(duration);
    auto turn = take_turn(turn_, wait);
    if (!turn) return 0;
    auto& relay = live();
    if (turn_.closing) return 0;  // close() is next
    return wait.run(
        [&](const Deadline& deadline) {
          auto counting = deadline;  // each time it is asked, the count is brought up to date
          counting.unless([&] {
            buckets_relayed_ = relay.stats().buckets;
            return deadline.ask();
          });
          auto relayed = relay.relay_for(counting, buckets);
          buckets_relayed_ = relay.stats().buckets;
          return relayed;
        },
        &turn_.closing);
  }

  // Until the local consumers released every bucket; false at `timeout` (None: no limit).
  bool drain(std::optional<double> timeout) {
    PyWait wait(timeout);
    auto turn = take_turn(turn_, wait);
    if (!turn) return false;
    auto& relay = live();
    return wait.run([&](const Deadline& deadline) { return relay.drain(deadline); }, &turn_.closing);
  }

  const std::string& local_channel() const { return local_channel_; }
  // As of at most Deadline::kAskEvery ago: readable while another thread relays.
  std::uint64_t buckets_relayed() const { return buckets_relayed_; }

  // Drops the link and closes the local channel; a relay() in another thread returns.
  void close() {
    auto turn = take_last_turn(turn_);
    relay_.reset();
  }

 private:
  net::Relay& live() {
    if (!relay_) text::fail(ErrorCode::InvalidArgument, "relay into channel ", text::Quoted{local_channel_}, " is closed");
    return *relay_;
  }

  // A local publish's wait: None, inf or past 10^9 s are the longest the network side waits;
  // 0 is one try; negative or NaN is refused.
  static std::chrono::milliseconds local_timeout(std::optional<double> seconds) {
    if (!seconds || *seconds >= 1e9) return net::kLongestTimeout;
    if (!(*seconds >= 0)) {
      text::fail(ErrorCode::InvalidArgument, "timeout must be seconds, at least 0, not ", as_text(*seconds));
    }
    return std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(*seconds));
  }

  Turns turn_;
  std::optional<net::Relay> relay_;  // none once closed
  std::string local_channel_;
  std::atomic<std::uint64_t> buckets_relayed_ = 0;
};

}  // namespace tensorbucket::python
