// A server that never sends a challenge, for the network tests (tests/net): it listens on
// ADDRESS for SECONDS, and sends each link it accepts small heartbeats, as fast as the link
// takes them, where a relay waits for the handshake. Then it prints how many links it
// accepted and how many messages went out.
// Usage: flooding-server ADDRESS SECONDS
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <list>
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
  if (argc != 3) {
    std::fprintf(stderr, "usage: flooding-server ADDRESS SECONDS\n");
    return 2;
  }
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
  const std::uint64_t beat = 0;
  std::deque<Request> sending;  // a bounded number under way
  std::uint64_t flooded = 0;
  int accepted = 0;
  while (Clock::now() < until) {
    worker.progress();
    for (auto* request : std::exchange(incoming, {})) {
      accept(worker.get(), links.emplace_back(), request);
      ++accepted;
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
          sending.push_back(send(worker.get(), it->ep, std::as_bytes(std::span(&beat, 1)), tag(Kind::Heartbeat)));
        } catch (const tensorbucket::Error&) {
          break;
        }
      }
      ++it;
    }
  }
  for (auto& request : sending) request.cancel();
  std::printf("accepted %d flooded %llu\n", accepted, static_cast<unsigned long long>(flooded));
  for (auto& link : links) close(worker, link, std::chrono::milliseconds(500));
  ucp_listener_destroy(listener);
  return 0;
}
