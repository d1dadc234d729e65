// Consumers that come and go while a producer streams: stopped inside the attach window,
// killed anywhere, crashed all at once. Whatever they do, every consumer that stays sees every
// bucket from its start, in order and intact, and the producer never stalls behind the dead.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <random>
#include <thread>

#include "channel_support.hpp"
#include "ipc/test_hooks.hpp"
#include "support.hpp"

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;
using cli::Workload;
using test::Child;
using test::consume;

using Churn = test::ChannelTest;

// How a consumer that reads until the producer is gone ended.
enum Outcome : int {
  kAllReceived = 0,  // contiguous, verified, through the last bucket published
  kGap = 10,
  kBadContent = 11,
  kTooFew = 12,
  kErrorThrown = 13,
};

// Reads from attach until ProducerGone, `pause` after each bucket; `last` is the last
// bucket the producer publishes.
int read_to_the_end(Subscriber& subscriber, const Workload& workload, std::uint64_t last,
                    std::chrono::milliseconds pause) {
  std::optional<std::uint64_t> previous;
  try {
    for (;;) {
      auto bucket = subscriber.next(30s);
      if (!bucket) return kTooFew;
      if (previous && bucket->sequence() != *previous + 1) {
        std::fprintf(stderr, "gap: bucket %llu after %llu\n",
                     static_cast<unsigned long long>(bucket->sequence()),
                     static_cast<unsigned long long>(*previous));
        return kGap;
      }
      if (!cli::check_bucket(bucket->view(), workload.seed, bucket->sequence()).empty()) return kBadContent;
      previous = bucket->sequence();
      std::this_thread::sleep_for(pause);
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::ProducerGone) {
      std::fprintf(stderr, "consumer %d: %s\n", ::getpid(), e.what());
      return kErrorThrown;
    }
  }
  return previous == last ? kAllReceived : kTooFew;
}

// A consumer stopped (SIGSTOP) right after it claimed its record. Before, the record still
// named its previous owner, who had left: the producer freed it as a dead consumer's, a second
// consumer claimed it, and when that one left, the first was orphaned and silently lost
// buckets. Now its lock says it lives: the producer waits for it, and it loses nothing. It
// reads slower than the steady consumer: an orphaned consumer that kept up would lose nothing
// either.
TEST_F(Churn, ConsumerStoppedAfterItsClaimLosesNothing) {
  Workload workload{.buckets = 500, .tensors = 3, .tensor_bytes = 512, .seed = 21};
  // The producer is a process of its own, like every peer here: this test forks consumers
  // while it streams, and a fork from a process with a second thread running can copy a lock
  // that thread holds (ASan's allocator's) into the child, locked for ever.
  test::Signal go;
  Child producer([&] {
    auto publisher = Publisher::create(channel, {.slots = 2});
    if (!go.receive()) return 1;
    for (std::uint64_t i = 0; i < workload.buckets; ++i) {
      if (!publisher.publish(cli::make_bucket(workload, i).builder, 30s)) {
        std::fprintf(stderr, "bucket %llu waited for %s\n", static_cast<unsigned long long>(i),
                     publisher.waiting_for().c_str());
        return 3;
      }
      // Paced, so that most of the stream comes after the stopped consumer resumed.
      std::this_thread::sleep_for(1ms);
    }
    return publisher.drain(30s) ? 0 : 4;
  });
  auto published = [&] {
    try {
      return inspect_channel(channel).published;
    } catch (const Error&) {
      return std::uint64_t{0};
    }
  };
  ASSERT_TRUE(test::wait_for_channel(channel));
  // A consumer that reads a bucket and leaves, so the next attacher gets a record that named
  // an owner who is gone; and a steady one. Both attached before the first bucket.
  Child previous([&] { return consume(channel, workload, 1); });
  Child steady([&] { return consume(channel, workload, workload.buckets); });
  ASSERT_TRUE(test::wait_until([&] { return inspect_channel(channel).consumers.size() == 2; }));
  ASSERT_TRUE(go.send());
  EXPECT_EQ(previous.wait(), 0);
  ASSERT_TRUE(test::wait_until([&] { return published() >= 10; }));

  Child stopped([&] {
    ipc::test_hooks::after_claim = [] { ::raise(SIGSTOP); };
    auto subscriber = Subscriber::attach(channel, 10s);
    ipc::test_hooks::after_claim = nullptr;
    return read_to_the_end(subscriber, workload, workload.buckets - 1, 2ms);
  });
  ASSERT_TRUE(stopped.wait_stopped()) << "the consumer never reached its hook";
  // Meanwhile the producer looks at its record, and another consumer comes, stays while the
  // stopped one resumes, and leaves.
  std::this_thread::sleep_for(100ms);
  test::Signal attached, leave;
  Child visitor([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    return attached.send() && leave.receive() ? 0 : 1;
  });
  ASSERT_TRUE(attached.receive());
  stopped.resume();
  std::this_thread::sleep_for(100ms);
  ASSERT_TRUE(leave.send());
  EXPECT_EQ(visitor.wait(), 0);

  EXPECT_EQ(producer.wait(), 0);
  EXPECT_EQ(stopped.wait(), kAllReceived);
  EXPECT_EQ(steady.wait(), 0);
}

// A consumer stopped after it took the lock byte of a dead consumer's record, before it
// claimed the record: the word still names the dead owner and its lease, and the producer,
// which cannot tell the two apart, waits. Resumed, the attacher takes the record over, leases
// and all, and reads from the oldest bucket held.
TEST_F(Churn, ConsumerStoppedBeforeItsClaimTakesOverADeadRecord) {
  Workload workload{.buckets = 4, .tensors = 2, .tensor_bytes = 256, .seed = 22};
  auto publisher = Publisher::create(channel, {.slots = 2, .min_consumers = 0});
  auto publish = [&](std::uint64_t i, std::chrono::milliseconds timeout) {
    return publisher.publish(cli::make_bucket(workload, i).builder, timeout);
  };
  ASSERT_TRUE(publish(0, 1s));
  test::Signal holding;
  Child dead([&] { return test::hold_a_bucket(channel, holding); });
  ASSERT_TRUE(holding.receive());
  dead.kill_now();
  test::Tampering control(test::control_name(channel));
  ASSERT_TRUE(control.mapped());
  auto& record = control.control().consumers[0];
  ASSERT_EQ(ipc::claim_leases(ipc::atomic(record.claim).load()), 1u) << "the dead consumer's lease";

  Child stopped([&] {
    ipc::test_hooks::before_claim = [] { ::raise(SIGSTOP); };
    auto subscriber = Subscriber::attach(channel, 10s);
    ipc::test_hooks::before_claim = nullptr;
    for (std::uint64_t i = 0; i < workload.buckets; ++i) {
      auto bucket = subscriber.next(10s);
      if (!bucket || bucket->sequence() != i || !cli::check_bucket(bucket->view(), workload.seed, i).empty()) {
        return 2;
      }
    }
    return 0;
  });
  ASSERT_TRUE(stopped.wait_stopped()) << "the consumer never reached its hook";
  ASSERT_TRUE(publish(1, 1s));
  EXPECT_FALSE(publish(2, 100ms)) << "the producer freed a record whose lock byte a live process holds";
  EXPECT_NE(publisher.waiting_for().find("record 0"), std::string::npos) << publisher.waiting_for();
  stopped.resume();
  ASSERT_TRUE(publish(2, 10s)) << publisher.waiting_for();
  ASSERT_TRUE(publish(3, 10s)) << publisher.waiting_for();
  EXPECT_EQ(stopped.wait(), 0);
}

// Every record held by a consumer that died holding a lease, and the producer waiting: an
// attach must take a dead consumer's record over. Before, it got ChannelFull until the
// producer gave up.
TEST_F(Churn, AttachTakesOverRecordsOfDeadConsumers) {
  Workload workload{.buckets = 6, .tensors = 2, .tensor_bytes = 256, .seed = 8};
  constexpr std::uint32_t kRecords = 4;
  auto publisher = Publisher::create(channel, {.slots = 1, .max_consumers = kRecords});
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  std::vector<std::unique_ptr<Child>> dead;
  test::Signal holding;
  for (std::uint32_t c = 0; c < kRecords; ++c) {
    dead.push_back(std::make_unique<Child>([&] { return test::hold_a_bucket(channel, holding); }));
    ASSERT_TRUE(holding.receive());
  }
  for (auto& child : dead) child->kill_now();
  // Every record names a dead owner, and the producer has not looked yet: only the attach can
  // free one.
  test::Tampering control(test::control_name(channel));
  ASSERT_TRUE(control.mapped());
  for (std::uint32_t r = 0; r < kRecords; ++r) {
    ASSERT_NE(ipc::claim_token(ipc::atomic(control.control().consumers[r].claim).load()), 0u) << r;
  }
  test::Signal attached;
  Child replacement([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    if (!attached.send()) return 1;
    for (std::uint64_t i = 0; i < workload.buckets; ++i) {
      auto bucket = subscriber.next(10s);
      if (!bucket || !cli::check_bucket(bucket->view(), workload.seed, bucket->sequence()).empty()) return 2;
    }
    return 0;
  });
  ASSERT_TRUE(attached.receive());
  for (std::uint64_t i = 1; i < workload.buckets; ++i) {
    EXPECT_TRUE(publisher.publish(cli::make_bucket(workload, i).builder, 10s)) << publisher.waiting_for();
  }
  EXPECT_EQ(replacement.wait(), 0);
}

// Consumers attach, read a few buckets and leave, or are killed at random moments (attaching,
// reading, holding a bucket), around two steady consumers, for TB_CHURN_SECONDS (10 by
// default). Every bucket is checked byte for byte and for gaps, by everyone; the producer must
// never wait 10 s for a slot. Before, ~1 in 75 short-lived consumers saw a gap, a torn or
// changed bucket, or stalled behind a leaked lease.
TEST_F(Churn, ConsumersComingAndGoingLoseNothing) {
  const char* configured = std::getenv("TB_CHURN_SECONDS");
  auto duration = std::chrono::seconds(configured ? std::atoi(configured) : 10);
  Workload workload{.buckets = 1u << 30, .tensors = 4, .tensor_bytes = 1024, .seed = 31};

  // The producer is a process of its own: see ConsumerStoppedAfterItsClaimLosesNothing. It
  // publishes from `go` until `stop`, then reports how many buckets it published.
  test::Signal go, stop, published_count;
  Child producer([&] {
    auto publisher = Publisher::create(channel, {.slots = 2, .max_consumers = 8});
    if (!go.receive()) return 1;
    std::uint64_t published = 0;
    for (; !stop.receive(0ms); ++published) {
      if (!publisher.publish(cli::make_bucket(workload, published).builder, 10s)) {
        std::fprintf(stderr, "bucket %llu waited 10 s for %s\n", static_cast<unsigned long long>(published),
                     publisher.waiting_for().c_str());
        return 3;
      }
    }
    if (!publisher.drain(30s)) return 4;
    publisher.close();
    return published_count.send_int(static_cast<std::int64_t>(published)) ? 0 : 1;
  });
  ASSERT_TRUE(test::wait_for_channel(channel));

  // A steady consumer reads every bucket until the producer is gone, then reports how many.
  test::Signal counts;
  auto steady = [&]() -> int {
    auto subscriber = Subscriber::attach(channel, 10s);
    std::int64_t received = 0;
    try {
      while (auto bucket = subscriber.next(30s)) {
        if (bucket->sequence() != static_cast<std::uint64_t>(received)) return kGap;
        if (!cli::check_bucket(bucket->view(), workload.seed, bucket->sequence()).empty()) return kBadContent;
        ++received;
      }
      return kTooFew;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ProducerGone) return kErrorThrown;
    }
    return counts.send_int(received) ? kAllReceived : 1;
  };
  Child first(steady), second(steady);
  // Both from bucket 0: a steady consumer that attached late would start later.
  ASSERT_TRUE(test::wait_until([&] { return inspect_channel(channel).consumers.size() == 2; }));
  ASSERT_TRUE(go.send());

  std::mt19937_64 rng(test::fuzz_seed(77));
  std::uint64_t visitors = 0, killed = 0, failed = 0;
  auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < duration) {
    std::vector<std::unique_ptr<Child>> wave;
    for (int c = 0; c < 6; ++c) {
      auto reads = 1 + rng() % 6;
      bool hold_and_exit = rng() % 4 == 0;
      // Some read slowly: a consumer the producer stopped waiting for would fall behind it.
      auto pause = std::chrono::microseconds(rng() % 2 == 0 ? 0 : rng() % 3000);
      wave.push_back(std::make_unique<Child>([&, reads, hold_and_exit, pause]() -> int {
        try {
          auto subscriber = Subscriber::attach(channel, 10s);
          std::optional<std::uint64_t> previous;
          std::optional<ReceivedBucket> held;  // one: holding two of two slots waits for ever
          for (std::uint64_t r = 0; r < reads; ++r) {
            auto bucket = subscriber.next(10s);
            if (!bucket) return kTooFew;
            if (previous && bucket->sequence() != *previous + 1) return kGap;
            if (!cli::check_bucket(bucket->view(), workload.seed, bucket->sequence()).empty()) {
              return kBadContent;
            }
            previous = bucket->sequence();
            std::this_thread::sleep_for(pause);
            if (hold_and_exit) held = std::move(bucket);
          }
          if (hold_and_exit) ::_exit(kAllReceived);  // leaves without releasing anything
        } catch (const Error& e) {
          std::fprintf(stderr, "visitor %d: %s\n", ::getpid(), e.what());
          return kErrorThrown;
        }
        return kAllReceived;
      }));
    }
    // Some are killed wherever they are: attaching, reading or holding a bucket.
    std::vector<bool> spared(wave.size(), true);
    for (std::size_t c = 0; c < wave.size(); ++c) {
      if (rng() % 3 != 0) continue;
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
      wave[c]->kill_now();
      spared[c] = false;
      ++killed;
    }
    for (std::size_t c = 0; c < wave.size(); ++c) {
      ++visitors;
      if (!spared[c]) continue;
      int status = wave[c]->wait(30s);
      if (status != kAllReceived) {
        ++failed;
        ADD_FAILURE() << "a visiting consumer ended with " << status;
      }
    }
  }
  ASSERT_TRUE(stop.send());
  auto published = published_count.receive_int(60s);
  EXPECT_EQ(producer.wait(), 0) << "(3: a bucket waited 10 s for a slot)";
  EXPECT_EQ(first.wait(), kAllReceived);
  EXPECT_EQ(second.wait(), kAllReceived);
  ASSERT_TRUE(published.has_value());
  for (int c = 0; c < 2; ++c) EXPECT_EQ(counts.receive_int(10s), published) << "steady consumer " << c;
  std::printf("%lld buckets, %llu visiting consumers (%llu killed, %llu failed)\n",
              static_cast<long long>(*published), static_cast<unsigned long long>(visitors),
              static_cast<unsigned long long>(killed), static_cast<unsigned long long>(failed));
}

}  // namespace
}  // namespace tensorbucket
