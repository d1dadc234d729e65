// Eclipse iceoryx's handoff of the bucket `tbucket bench --tensor-bytes N` hands off, measured
// the same way, for bench/peers/iceoryx_sweep.py (which starts the RouDi daemon this needs).
//
//   iceoryx_handoff TENSOR_BYTES REPEATS
//
// A publisher and a forked subscriber, each its own iceoryx runtime. Each round the publisher
// loans a chunk of 1000 x TENSOR_BYTES, fills it with 1000 memcpys from private tensors (what
// tensorbucket's copy path does, without a manifest, checks or hashes), and publishes it; the
// subscriber polls take(), notes the time, releases the chunk, and acks. The next round starts
// after the ack, as tbucket bench's next handoff starts after the release. Prints one JSON
// object: the medians of loan start -> taken (fill_us), publish() -> taken (publish_us, what
// tensorbucket's in-place commit() -> views compares with), and of one memcpy of the same bytes
// between two warm buffers (memcpy_us), as tbucket bench measures it. The chunk must fit a
// mempool of RouDi's config: iceoryx 2.0 aborts the loan of one that does not, and its RouDi
// then aborts on shutdown (the sweep removes what that leaves).
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "iceoryx_posh/popo/untyped_publisher.hpp"
#include "iceoryx_posh/popo/untyped_subscriber.hpp"
#include "iceoryx_posh/runtime/posh_runtime.hpp"

namespace {

constexpr int kTensors = 1000;
constexpr int kWarmup = 2;
constexpr std::uint32_t kAlignment = 256;  // tensorbucket's entry alignment
constexpr std::uint64_t kPatience = 10'000'000'000ull;  // ns: the other side is gone

std::uint64_t now_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(now.tv_nsec);
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

// What the two processes share besides iceoryx: the round's clocks and the acks.
struct Rounds {
  std::atomic<std::uint64_t> started_ns;    // before loan()
  std::atomic<std::uint64_t> published_ns;  // just before publish()
  std::atomic<std::uint64_t> acked;         // rounds the subscriber took and released
  std::atomic<std::uint64_t> ready;         // the subscriber is subscribed
  double fill_us;                           // the subscriber's medians, read after it exited
  double publish_us;
};

const iox::capro::ServiceDescription kService{"tensorbucket", "peer", "bucket"};

[[noreturn]] void subscribe(Rounds& rounds, int count, std::uint64_t bytes) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a publisher killed (a timeout) takes us along
  iox::runtime::PoshRuntime::initRuntime(
      iox::RuntimeName_t(iox::cxx::TruncateToCapacity, ("tbpeer-sub-" + std::to_string(::getpid())).c_str()));
  iox::popo::SubscriberOptions options;
  options.queueCapacity = 1;
  iox::popo::UntypedSubscriber subscriber(kService, options);
  for (auto deadline = now_ns() + kPatience; subscriber.getSubscriptionState() != iox::SubscribeState::SUBSCRIBED;) {
    if (now_ns() > deadline) ::_exit(3);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  rounds.ready.store(1);
  std::vector<double> fill, publish;
  for (int i = 0; i < count; ++i) {
    const void* chunk = nullptr;
    auto deadline = now_ns() + kPatience;
    while (chunk == nullptr) {
      subscriber.take().and_then([&](const void* taken) { chunk = taken; });
      if (chunk == nullptr && now_ns() > deadline) ::_exit(3);
    }
    auto taken = now_ns();
    if (i >= kWarmup) {
      fill.push_back(static_cast<double>(taken - rounds.started_ns.load()) / 1000);
      publish.push_back(static_cast<double>(taken - rounds.published_ns.load()) / 1000);
    }
    // The last tensor's last byte, as a consumer that reads it would see it.
    if (static_cast<const unsigned char*>(chunk)[bytes - 1] != static_cast<unsigned char>(i)) ::_exit(4);
    subscriber.release(chunk);
    rounds.acked.store(static_cast<std::uint64_t>(i) + 1);
  }
  rounds.fill_us = median(fill);
  rounds.publish_us = median(publish);
  ::_exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: iceoryx_handoff TENSOR_BYTES REPEATS\n");
    return 2;
  }
  auto tensor_bytes = std::strtoull(argv[1], nullptr, 10);
  int repeats = std::atoi(argv[2]);
  if (tensor_bytes == 0 || tensor_bytes >= ((std::uint64_t{1} << 32) / kTensors) || repeats < 1) {
    std::fprintf(stderr, "iceoryx_handoff: a chunk holds less than 4 GiB, and repeats must be positive\n");
    return 2;
  }
  std::uint64_t bytes = kTensors * tensor_bytes;
  int count = repeats + kWarmup;
  auto* rounds = static_cast<Rounds*>(
      ::mmap(nullptr, sizeof(Rounds), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (rounds == MAP_FAILED) return 1;
  new (rounds) Rounds{};

  // Made before the fork, so that both sides are ready within moments of each other (a GiB of
  // tensors takes seconds to fault in); the subscriber never touches them.
  std::vector<std::vector<unsigned char>> tensors(kTensors, std::vector<unsigned char>(tensor_bytes, 1));
  std::fflush(nullptr);
  pid_t child = ::fork();  // before either process starts its runtime
  if (child == 0) subscribe(*rounds, count, bytes);

  iox::runtime::PoshRuntime::initRuntime(
      iox::RuntimeName_t(iox::cxx::TruncateToCapacity, ("tbpeer-pub-" + std::to_string(::getpid())).c_str()));
  iox::popo::UntypedPublisher publisher(kService);
  bool ok = true;
  for (auto deadline = now_ns() + kPatience; ok && (rounds->ready.load() == 0 || !publisher.hasSubscribers());) {
    ok = now_ns() < deadline;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!ok) std::fprintf(stderr, "iceoryx_handoff: no subscriber within 10 s\n");
  for (int i = 0; i < count && ok; ++i) {
    tensors.back().back() = static_cast<unsigned char>(i);
    rounds->started_ns.store(now_ns());
    publisher.loan(static_cast<std::uint32_t>(bytes), kAlignment)
        .and_then([&](void* chunk) {
          auto* to = static_cast<unsigned char*>(chunk);
          for (int t = 0; t < kTensors; ++t) std::memcpy(to + t * tensor_bytes, tensors[t].data(), tensor_bytes);
          rounds->published_ns.store(now_ns());
          publisher.publish(chunk);
        })
        .or_else([&](auto&) {
          std::fprintf(stderr, "iceoryx_handoff: no chunk of %llu bytes: does RouDi's config have a mempool for it?\n",
                       static_cast<unsigned long long>(bytes));
          ok = false;
        });
    auto deadline = now_ns() + kPatience;
    while (ok && rounds->acked.load() < static_cast<std::uint64_t>(i) + 1) {
      if (now_ns() > deadline) {
        std::fprintf(stderr, "iceoryx_handoff: round %d was not taken within 10 s\n", i);
        ok = false;
      }
    }
  }
  if (!ok) ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!ok) return 1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "iceoryx_handoff: the subscriber failed (wait status %d)\n", status);
    return 1;
  }

  std::vector<unsigned char> from(bytes, 1), to(bytes, 0);
  std::vector<double> copies;
  for (int i = 0; i < repeats; ++i) {
    auto start = now_ns();
    std::memcpy(to.data(), from.data(), bytes);
    copies.push_back(static_cast<double>(now_ns() - start) / 1000);
  }
  std::printf("{\"tensor_bytes\":%llu,\"bytes\":%llu,\"repeats\":%d,\"fill_us\":%.2f,\"publish_us\":%.2f,"
              "\"memcpy_us\":%.2f}\n",
              static_cast<unsigned long long>(tensor_bytes), static_cast<unsigned long long>(bytes), repeats,
              rounds->fill_us, rounds->publish_us, median(copies));
  return 0;
}
