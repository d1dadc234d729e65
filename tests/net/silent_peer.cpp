// A peer that connects and never proves the token, for the network tests (tests/net): it opens
// CONNECTIONS links to ADDRESS at once, holds them for SECONDS, and prints how many the server
// challenged, refused and cut off. With `flood`, it sends meanwhile, as fast as the links take
// them, small messages under keys the server gave no link, prints "all challenged" as soon
// as the server challenged every link, ends early once the server cut every link (a server
// slowed down by a sanitizer on a loaded host may take most of SECONDS), and prints at the end
// how many messages went out.
// Usage: silent-peer ADDRESS CONNECTIONS SECONDS [flood]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "tensorbucket/error.hpp"
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
  bool flood = argc == 5 && std::strcmp(argv[4], "flood") == 0;
  if (argc != 4 && !flood) {
    std::fprintf(stderr, "usage: silent-peer ADDRESS CONNECTIONS SECONDS [flood]\n");
    return 2;
  }
  auto address = parse_address(argv[1], false);
  std::vector<Endpoint> links(std::strtoul(argv[2], nullptr, 10));  // sized once: they never move
  auto until = Clock::now() + std::chrono::duration<double>(std::strtod(argv[3], nullptr));
  Worker worker;
  for (auto& link : links) connect(worker.get(), link, address);
  int challenged = 0, refused = 0;
  std::uint64_t flooded = 0;
  const std::uint64_t noise = 0;
  std::deque<Request> sending;  // a bounded number under way
  auto all_cut = [&] {
    for (auto& link : links) {
      if (link.failed == UCS_OK) return false;
    }
    return true;
  };
  while (Clock::now() < until && !(flood && all_cut())) {
    worker.progress();
    bool all = challenged == static_cast<int>(links.size());
    challenged += drain(worker, Kind::Challenge);
    if (flood && !all && challenged == static_cast<int>(links.size())) {
      std::printf("all challenged\n");  // the flood is on
      std::fflush(stdout);
    }
    refused += drain(worker, Kind::Refused);
    if (!flood) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    while (!sending.empty() && sending.front().ended()) sending.pop_front();
    for (auto& link : links) {
      for (int i = 0; i < 64 && link.failed == UCS_OK && sending.size() < 4096; ++i, ++flooded) {
        // Under a key whose low bit is clear: the server's keys all have it set.
        auto key = (flooded * 0x9e3779b97f4a7c15ull) & kKeyMask & ~1ull;
        try {
          sending.push_back(send(worker.get(), link.ep, std::as_bytes(std::span(&noise, 1)), tag(Kind::Ack, key)));
        } catch (const tensorbucket::Error&) {
          break;
        }
      }
    }
  }
  for (auto& request : sending) request.cancel();
  int cut = 0;
  for (auto& link : links) cut += link.failed != UCS_OK ? 1 : 0;
  std::printf("challenged %d refused %d cut %d\n", challenged, refused, cut);
  if (flood) std::printf("flooded %llu\n", static_cast<unsigned long long>(flooded));
  for (auto& link : links) close(worker, link, std::chrono::milliseconds(500));
  return 0;
}
