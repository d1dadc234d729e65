// A server without the token, for the network tests (tests/net): it listens on ADDRESS for
// SECONDS and floods each link it accepts, as fast as the link takes them, with messages a
// relay does not wait for in its handshake: heartbeats or welcomes where the challenge is due,
// or, after a challenge, more challenges where the welcome is due. It prints "accepted a link"
// at the first, and at the end how many links it accepted and how many messages went out.
// Usage: flooding-server ADDRESS SECONDS heartbeats|welcomes|challenges
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <list>
#include <string_view>
#include <vector>

#include "tensorbucket/error.hpp"
#include "ucx.hpp"
#include "wire.hpp"

using namespace tensorbucket::net::detail;

namespace {

void on_connection(ucp_conn_request_h request, void* arg) {
  static_cast<std::vector<ucp_conn_request_h>*>(arg)->push_back(request);
}

}  // namespace

int main(int argc, char** argv) {
  std::string_view mode = argc == 4 ? argv[3] : "";
  if (mode != "heartbeats" && mode != "welcomes" && mode != "challenges") {
    std::fprintf(stderr, "usage: flooding-server ADDRESS SECONDS heartbeats|welcomes|challenges\n");
    return 2;
  }
  // Each the size of the real thing, so that only its kind and its place are wrong.
  Challenge challenge{kMagic, kProtocolVersion, 0, 1, {}};
  Welcome welcome{};
  const std::uint64_t beat = 0;
  auto flood = mode == "heartbeats" ? std::as_bytes(std::span(&beat, 1))
               : mode == "welcomes" ? std::as_bytes(std::span(&welcome, 1))
                                    : std::as_bytes(std::span(&challenge, 1));
  auto kind = mode == "heartbeats" ? Kind::Heartbeat : mode == "welcomes" ? Kind::Welcome : Kind::Challenge;
  auto address = parse_address(argv[1], true);
  auto until = Clock::now() + std::chrono::duration<double>(std::strtod(argv[2], nullptr));
  Worker worker(interface_holding(address));
  std::vector<ucp_conn_request_h> incoming;
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = address.get();
  params.sockaddr.addrlen = address.length;
  params.conn_handler.cb = on_connection;
  params.conn_handler.arg = &incoming;
  ucp_listener_h listener = nullptr;
  if (auto status = ucp_listener_create(worker.get(), &params, &listener); status != UCS_OK) {
    fail_ucx("listening", status);
  }
  std::printf("listening\n");
  std::fflush(stdout);
  std::list<Endpoint> links;  // a list: UCX holds each one's address
  std::deque<Request> sending;  // a bounded number under way
  std::uint64_t flooded = 0;
  int accepted = 0;
  while (Clock::now() < until) {
    worker.progress();
    for (auto* request : std::exchange(incoming, {})) {
      auto& link = links.emplace_back();
      accept(worker.get(), link, request);
      if (++accepted == 1) {
        std::printf("accepted a link\n");  // the flood is on
        std::fflush(stdout);
      }
      if (mode == "challenges") {
        sending.push_back(send(worker.get(), link.ep, std::as_bytes(std::span(&challenge, 1)), tag(Kind::Challenge)));
      }
    }
    while (!sending.empty() && sending.front().ended()) sending.pop_front();
    for (auto it = links.begin(); it != links.end();) {
      if (it->failed != UCS_OK) {  // the relay gave up on this one: it connects again
        close(worker, *it, std::chrono::milliseconds(100));
        it = links.erase(it);
        continue;
      }
      for (int i = 0; i < 64 && sending.size() < 4096; ++i, ++flooded) {
        try {
          sending.push_back(send(worker.get(), it->ep, flood, tag(kind)));
        } catch (const tensorbucket::Error&) {
          break;
        }
      }
      ++it;
    }
  }
  for (auto& request : sending) request.cancel();
  std::printf("accepted %d flooded %llu\n", accepted, static_cast<unsigned long long>(flooded));
  std::fflush(stdout);
  for (auto& link : links) close(worker, link, std::chrono::milliseconds(500));
  ucp_listener_destroy(listener);
  return 0;
}
