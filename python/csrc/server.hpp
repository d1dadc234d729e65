// The Python Server: a channel exported to other hosts (tensorbucket/net.hpp), served without
// the GIL until a deadline that Ctrl+C, close() from another thread and the interpreter's exit
// interrupt (PyWait), so that they all end a serve() that has no time limit.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "tensorbucket/net.hpp"
#include "waits.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

class PyServer {
 public:
  PyServer(const std::string& channel, const std::string& listen, const std::string& token_file,
           double peer_timeout, std::uint32_t max_peers, std::uint32_t window, std::optional<double> timeout)
      : channel_(channel) {
    net::ServeOptions options{.listen = listen,
                              .token = net::read_token_file(token_file),
                              .peer_timeout = limit_in_ms(peer_timeout, "peer_timeout"),
                              .max_peers = max_peers,
                              .window = window};
    PyWait wait(timeout);
    server_ = wait.in_seconds(timeout).run(
        [&](const Deadline& deadline) { return net::Server::start(channel, options, deadline); });
    address_ = server_->address();
  }

  // Serves for `duration` seconds (None: until close() or Ctrl+C), without the GIL.
  void serve(std::optional<double> duration) {
    PyWait wait(duration);
    // The wait for the turn counts against the duration: while another thread serves, this one
    // returns at its deadline, having served nothing itself.
    auto turn = take_turn(turn_, wait);
    if (!turn) return;
    auto& server = live();
    if (turn_.closing) return;  // close() is next
    wait.run(
        [&](const Deadline& deadline) {
          auto counting = deadline;  // each time it is asked, the counters are brought up to date
          counting.unless([&] {
            peers_ = server.peers();
            served_ = server.buckets_served();
            return deadline.ask();
          });
          server.serve_for(counting);
          peers_ = server.peers();
          served_ = server.buckets_served();
        },
        &turn_.closing);
  }

  const std::string& address() const { return address_; }
  // As of at most Deadline::kAskEvery ago: readable while another thread serves.
  std::uint32_t peers() const { return peers_; }
  std::uint64_t buckets_served() const { return served_; }

  // Disconnects every peer and detaches from the channel; a serve() in another thread returns.
  void close() {
    auto turn = take_last_turn(turn_);
    server_.reset();
    peers_ = 0;
  }

 private:
  net::Server& live() {
    if (!server_) text::fail(ErrorCode::InvalidArgument, "server of channel ", text::Quoted{channel_}, " is closed");
    return *server_;
  }

  Turns turn_;
  std::string channel_;
  std::string address_;
  std::optional<net::Server> server_;  // none once closed
  std::atomic<std::uint32_t> peers_ = 0;
  std::atomic<std::uint64_t> served_ = 0;
};

}  // namespace tensorbucket::python
