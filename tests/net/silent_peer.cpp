// A peer that connects and never proves the token, for the network tests (tests/net): it opens
// CONNECTIONS links to ADDRESS at once, holds them for SECONDS, and prints how many the server
// challenged, refused and cut off. Usage: silent-peer ADDRESS CONNECTIONS SECONDS
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "ucx.hpp"
#include "wire.hpp"

using namespace tensorbucket::net::detail;

namespace {

// Takes every message of `kind` off the queue; returns how many there were.
int drain(Worker& worker, Kind kind) {
  int count = 0;
  std::size_t length = 0;
  while (auto* message = probe(worker.get(), tag(kind), kKindMask, &length)) {
    std::vector<std::byte> bytes(length);
    auto receiving = receive(worker.get(), message, bytes);
    while (!receiving.done()) worker.progress();
    ++count;
  }
  return count;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: silent-peer ADDRESS CONNECTIONS SECONDS\n");
    return 2;
  }
  auto address = parse_address(argv[1], false);
  std::vector<Endpoint> links(std::strtoul(argv[2], nullptr, 10));  // sized once: they never move
  auto until = Clock::now() + std::chrono::duration<double>(std::strtod(argv[3], nullptr));
  Worker worker;
  for (auto& link : links) connect(worker.get(), link, address);
  int challenged = 0, refused = 0;
  while (Clock::now() < until) {
    worker.progress();
    challenged += drain(worker, Kind::Challenge);
    refused += drain(worker, Kind::Refused);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  int cut = 0;
  for (auto& link : links) cut += link.failed != UCS_OK ? 1 : 0;
  std::printf("challenged %d refused %d cut %d\n", challenged, refused, cut);
  for (auto& link : links) close(worker, link, std::chrono::milliseconds(500));
  return 0;
}
