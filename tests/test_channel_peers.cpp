// Peers that are broken, hostile or merely elsewhere: processes of our uid writing the shared
// control block and slots, truncating segments, racing for a channel's name, sitting in
// another pid namespace, or a producer without a free descriptor. None may crash, hang or
// silently fool another process (docs/channel.md, "Hostile peers").
#include <gtest/gtest.h>

#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <thread>

#include "channel_support.hpp"
#include "ipc/os/liveness.hpp"
#include "ipc/test_hooks.hpp"
#include "support.hpp"

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;
using cli::Workload;
using test::Child;
using test::expect_error;
using test::next_bucket;
using test::Signal;
using test::Tampering;

using Peers = test::ChannelTest;

bool publish(Publisher& publisher, const Workload& workload, std::uint64_t i,
             std::chrono::milliseconds timeout = 10s) {
  return publisher.publish(cli::make_bucket(workload, i).builder, timeout);
}

// Before, liveness read /proc/<pid>/stat and answered "dead" when it could not be opened: a
// producer out of descriptors freed a live consumer's record and overwrote its bucket.
TEST_F(Peers, ConsumerStaysAliveForAProducerWithoutDescriptors) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  // min_consumers 0: only the holder's lease keeps the slot, and only while it lives.
  auto publisher = Publisher::create(channel, {.slots = 1, .min_consumers = 0});
  ASSERT_TRUE(publish(publisher, workload, 0));
  Signal holding;
  Child holder([&] { return test::hold_a_bucket(channel, holding); });
  ASSERT_TRUE(holding.receive());

  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 32;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> filler;
  for (int fd; (fd = ::dup(holding.read_end())) >= 0;) filler.push_back(fd);
  bool published = publish(publisher, workload, 1, 100ms);
  for (int fd : filler) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);

  EXPECT_FALSE(published) << "the producer freed a live consumer's record";
  EXPECT_NE(publisher.waiting_for().find(std::to_string(holder.pid())), std::string::npos)
      << publisher.waiting_for();
  holder.kill_now();
  EXPECT_TRUE(publish(publisher, workload, 1, 1s)) << "a dead consumer's record was not freed: waited for " << publisher.waiting_for();
}

// "Cannot tell" is "alive": a lock test that fails (here on no descriptor at all) must never
// let the producer free a record.
TEST(Liveness, CannotTellMeansAlive) { EXPECT_TRUE(ipc::held_by_other(-1, ipc::kProducerLockByte)); }

// A process that forked (a data loader's workers) and then died is dead, though its children
// live: they hold neither its lock nor a mapping that would keep the lock's file description
// open. Before the control mapping was kept from children, the producer waited for such a
// consumer, and consumers took such a producer for alive.
TEST_F(Peers, ConsumerThatDiedIsDeadWhileItsForkedChildLives) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 1, .min_consumers = 0});
  ASSERT_TRUE(publish(publisher, workload, 0));
  Signal forked;
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    auto bucket = subscriber.next(10s);  // held until killed
    auto worker = test::fork_sleeper();
    if (!bucket || !forked.send_int(worker)) return 1;
    ::pause();
    return 0;
  });
  auto worker = forked.receive_int();
  ASSERT_TRUE(worker.has_value());
  consumer.kill_now();
  EXPECT_TRUE(publish(publisher, workload, 1, 5s)) << "waited for " << publisher.waiting_for();
  ::kill(static_cast<pid_t>(*worker), SIGKILL);
}

TEST_F(Peers, ProducerThatDiedIsGoneWhileItsForkedChildLives) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  Signal forked;
  Child producer([&] {
    auto publisher = Publisher::create(channel);
    if (!publish(publisher, workload, 0)) return 1;
    if (!forked.send_int(test::fork_sleeper())) return 1;
    ::pause();
    return 0;
  });
  auto worker = forked.receive_int();
  ASSERT_TRUE(worker.has_value());
  auto subscriber = Subscriber::attach(channel, 5s);
  producer.kill_now();
  EXPECT_EQ(next_bucket(subscriber, 5s).sequence(), 0u);
  auto start = std::chrono::steady_clock::now();
  expect_error(ErrorCode::ProducerGone, [&] { subscriber.next(5s); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);
  // And its name is free for the next producer.
  EXPECT_NO_THROW(Publisher::create(channel).close());
  ::kill(static_cast<pid_t>(*worker), SIGKILL);
}

// attach() reads max_consumers from shared memory; a peer that raised it lets consumers claim
// records past the producer's own bound. The producer looks at every record, so their leases
// hold.
TEST_F(Peers, ProducerHonoursRecordsPastItsMaxConsumers) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 1, .max_consumers = 1, .min_consumers = 0});
  auto first = Subscriber::attach(channel, 1s);
  Tampering control(test::control_name(channel));
  ASSERT_TRUE(control.mapped());
  ipc::atomic(control.control().max_consumers).store(std::uint16_t{8});
  auto second = Subscriber::attach(channel, 1s);  // record 1, past the producer's bound
  ASSERT_TRUE(publish(publisher, workload, 0, 1s));
  next_bucket(first, 1s).release();
  auto held = next_bucket(second, 1s);
  EXPECT_FALSE(publish(publisher, workload, 1, 50ms)) << "bucket 0 was overwritten under a lease";
  EXPECT_NE(publisher.waiting_for().find("record 1"), std::string::npos) << publisher.waiting_for();
}

// Before, a generation past the awaited bucket in every slot made next() skip one bucket per
// turn of its loop, for ever, never looking at its deadline.
TEST_F(Peers, AbsurdGenerationsEndTheWaitAtItsDeadline) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 1, .min_consumers = 0});
  ASSERT_TRUE(publish(publisher, workload, 0));
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 1s);
    next_bucket(subscriber).release();
    Tampering control(test::control_name(channel));
    if (!control.mapped()) return 1;
    ipc::atomic(control.control().slots[0].generation).store(std::uint64_t{1} << 62);
    auto start = std::chrono::steady_clock::now();
    if (subscriber.next(200ms).has_value()) return 2;
    if (std::chrono::steady_clock::now() - start > 5s) return 3;
    // A published count past any real one is damage, named as such.
    ipc::atomic(control.control().published).store(~std::uint64_t{0});
    try {
      subscriber.next(200ms);
    } catch (const Error& e) {
      return e.code() == ErrorCode::HeaderCorrupt ? 0 : 4;
    }
    return 5;
  });
  EXPECT_EQ(consumer.wait(20s), 0);
}

// Before, a consumer checked a slot's sizes against the segment size in the control block,
// not against the mapping it held: sizes grown there after it mapped the slot made it read
// past its mapping (SIGSEGV), or into a neighbouring one.
class GrownSlotSizes : public Peers, public ::testing::WithParamInterface<std::uint64_t> {};

TEST_P(GrownSlotSizes, AreRejectedAsHeaderCorrupt) {
  const auto growth = GetParam();
  Workload workload{.buckets = 2, .tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 1});
  ASSERT_TRUE(publish(publisher, workload, 0));
  Signal mapped, claimed, tampered;
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    next_bucket(subscriber).release();
    Tampering control(test::control_name(channel));
    if (!control.mapped() || !mapped.send()) return 1;
    // Between the producer's claim and its publish, as a peer racing it would.
    auto& slot = control.control().slots[0];
    if (!claimed.receive()) return 1;
    ipc::atomic(slot.segment_bytes).fetch_add(growth);
    ipc::atomic(slot.payload_capacity).fetch_add(growth);
    if (!tampered.send()) return 1;
    try {
      auto bucket = subscriber.next(10s);
      return bucket ? 2 : 3;
    } catch (const Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return e.code() == ErrorCode::HeaderCorrupt ? 0 : 4;
    }
  });
  ASSERT_TRUE(mapped.receive());
  auto reservation = publisher.reserve(cli::make_layout(workload, 1), 10s);
  ASSERT_TRUE(reservation.has_value());
  ASSERT_TRUE(claimed.send() && tampered.receive());
  for (std::uint32_t t = 0; t < workload.tensors; ++t) {
    cli::fill_tensor(reservation->entry_spans()[t], workload, 1, t);
  }
  reservation->commit();
  EXPECT_EQ(consumer.wait(), 0) << "(a negative status is the signal that killed the consumer)";
}

INSTANTIATE_TEST_SUITE_P(Growths, GrownSlotSizes, ::testing::Values(4096, 1 << 20, 1ull << 40));

// Before, the producer read its slots' sizes back from the control block, which consumers map
// read-write: a consumer that wrote them crashed the producer (SIGSEGV). It keeps its own copy
// now, and writes the true sizes again for every bucket.
TEST_F(Peers, ProducerIgnoresSlotSizesWrittenByConsumers) {
  Workload workload{.buckets = 6, .tensors = 3, .tensor_bytes = 512, .seed = 6};
  Child producer([&] {
    auto publisher = Publisher::create(channel, {.slots = 1});
    for (std::uint64_t i = 0; i < workload.buckets; ++i) {
      if (!publish(publisher, workload, i)) return 3;
    }
    return publisher.drain(10s) ? 0 : 4;
  });
  auto subscriber = Subscriber::attach(channel, 10s);
  for (std::uint64_t i = 0; i < workload.buckets; ++i) {
    auto bucket = next_bucket(subscriber);
    EXPECT_EQ(bucket.sequence(), i);
    EXPECT_EQ(cli::check_bucket(bucket.view(), workload.seed, i), "");
    // While the producer waits for this slot, write nonsense over every size it has.
    Tampering control(test::control_name(channel));
    ASSERT_TRUE(control.mapped());
    auto& slot = control.control().slots[0];
    ipc::atomic(slot.segment_bytes).store(std::uint64_t{1} << 41);
    ipc::atomic(slot.payload_capacity).store(std::uint64_t{1} << 40);
    ipc::atomic(slot.frame_bytes).store(std::uint64_t{1} << 39);
  }
  EXPECT_EQ(producer.wait(), 0) << "(a negative status is the signal that killed the producer)";
}

// Flips the first byte of `name` in a slot's frame to upper case, as a stray write would.
void flip_name(const std::string& segment, std::string_view name) {
  Tampering slot(segment);
  ASSERT_TRUE(slot.mapped());
  auto bytes = slot.bytes();
  auto found = std::search(bytes.begin(), bytes.end(), name.begin(), name.end(),
                           [](std::byte b, char c) { return b == static_cast<std::byte>(c); });
  ASSERT_NE(found, bytes.end());
  *found = static_cast<std::byte>(std::toupper(name[0]));
}

// Before, a producer that sent the same unchanged layout again wrote only its identity fields
// and hashed whatever manifest bytes the slot held: a byte another process flipped there was
// delivered as verified ('layer.weight' became 'Layer.weight'). The header's hash is now of the
// manifest the producer meant: that bucket is refused, the consumer marks the slot, and the
// producer compares the next bucket's manifest with the slot's bytes and rewrites them.
class KeptLayout : public Peers, public ::testing::WithParamInterface<bool> {
 protected:
  const float values[4] = {1, 2, 3, 4};
  std::optional<Publisher> publisher;
  BucketBuilder layout;

  void SetUp() override {
    publisher.emplace(Publisher::create(channel, {.slots = 1}));
    if (GetParam()) {
      layout.declare("layer.weight", DType::F32, Shape{4});
    } else {
      layout.add("layer.weight", DType::F32, Shape{4}, values);
    }
  }
  void TearDown() override {
    publisher.reset();
    Peers::TearDown();
  }
  bool send(std::uint64_t version) {
    layout.version(version);
    if (!GetParam()) return publisher->publish(layout, 1s);
    auto reservation = publisher->reserve(layout, 1s);
    if (!reservation) return false;
    reservation->write(0, values);
    reservation->commit();
    return true;
  }
};

TEST_P(KeptLayout, ManifestChangedInTheSlotIsRefusedThenWrittenAgain) {
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(send(1));
  next_bucket(subscriber, 1s).release();
  flip_name(test::slot_name(channel, 0), "layer.weight");
  ASSERT_TRUE(send(2));
  expect_error(ErrorCode::ChecksumMismatch, [&] { subscriber.next(1s); });
  ASSERT_TRUE(send(3));
  auto bucket = next_bucket(subscriber, 1s);
  EXPECT_EQ(bucket.view().version(), 3u);
  EXPECT_EQ(bucket.view()[0].name, "layer.weight");
}

INSTANTIATE_TEST_SUITE_P(Paths, KeptLayout, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "InPlace" : "Copy"; });

// A byte flipped between reserve() and commit() of the in-place path, after the producer
// wrote the manifest: the header's hash is of the manifest it meant, so the bucket is refused.
TEST_F(Peers, ManifestChangedWhileTheBucketIsWrittenIsRejected) {
  const float values[4] = {1, 2, 3, 4};
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  BucketBuilder layout;
  layout.declare("layer.weight", DType::F32, Shape{4});
  for (std::uint64_t version : {1, 2, 3}) {
    layout.version(version);
    auto reservation = publisher.reserve(layout, 1s);
    ASSERT_TRUE(reservation.has_value());
    if (version == 2) flip_name(test::slot_name(channel, 0), "layer.weight");
    reservation->write(0, values);
    reservation->commit();
    if (version == 2) {
      expect_error(ErrorCode::ChecksumMismatch, [&] { subscriber.next(1s); });
      continue;
    }
    auto bucket = next_bucket(subscriber, 1s);
    EXPECT_EQ(bucket.view().version(), version);
    EXPECT_EQ(bucket.view()[0].name, "layer.weight");
  }
}

// A producer stopped between creating the control segment and locking it leaves an object
// that looks like a dead producer's: another producer removes it and takes the name. Before,
// the first then went on as a second owner and, closing, unlinked the winner's live segment.
TEST_F(Peers, ProducerThatLostTheRaceForANameRemovesNothing) {
  Workload workload{.buckets = 2, .tensors = 2, .tensor_bytes = 64};
  Child slow([&] {
    ipc::test_hooks::before_producer_lock = [] { ::raise(SIGSTOP); };
    try {
      auto publisher = Publisher::create(channel);
      return 1;
    } catch (const Error& e) {
      return e.code() == ErrorCode::ChannelExists ? 0 : 2;
    }
  });
  ASSERT_TRUE(slow.wait_stopped());
  auto publisher = Publisher::create(channel);
  slow.resume();
  EXPECT_EQ(slow.wait(), 0);
  // The winner's channel is whole: named, its, and working.
  EXPECT_EQ(inspect_channel(channel).producer_pid, ::getpid());
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publish(publisher, workload, 0, 1s));
  EXPECT_EQ(cli::check_bucket(next_bucket(subscriber, 1s).view(), workload.seed, 0), "");
}

// Two producers started together for one name, with and without a dead producer's leftovers
// under it: exactly one wins, the other gets ChannelExists, and the winner's channel stays.
TEST_F(Peers, RacingProducersLeaveExactlyOneOwner) {
  constexpr int kRounds = 100;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    if (round % 2 == 1) {
      Child dead([&] {
        auto publisher = Publisher::create(channel);
        ::_exit(0);  // leaves its segments, as a crash would
        return 0;
      });
      ASSERT_EQ(dead.wait(), 0);
      ASSERT_FALSE(test::segments_of(channel).empty());
    }
    Signal go, check;
    auto contender = [&] {
      if (!go.receive()) return 1;
      std::optional<Publisher> publisher;
      try {
        publisher.emplace(Publisher::create(channel));
      } catch (const Error& e) {
        return e.code() == ErrorCode::ChannelExists ? 6 : 1;
      }
      // Won: once the loser is done, the channel must still be ours.
      if (!check.receive()) return 1;
      auto info = inspect_channel(channel);
      return info.producer_pid == ::getpid() && info.producer_alive ? 0 : 2;
    };
    Child first(contender), second(contender);
    ASSERT_TRUE(go.send() && go.send());
    // The loser ends first: the winner waits for `check`.
    std::optional<int> loser;
    Child* winner = nullptr;
    ASSERT_TRUE(test::wait_until([&] {
      if ((loser = first.poll())) winner = &second;
      if (!loser && (loser = second.poll())) winner = &first;
      return loser.has_value();
    }));
    EXPECT_EQ(*loser, 6);
    ASSERT_TRUE(check.send());
    EXPECT_EQ(winner->wait(), 0);
    EXPECT_EQ(test::segments_of(channel), std::vector<std::string>{});
  }
}

// Before, a segment truncated by another process turned the next touch of a lost page into
// SIGBUS: a consumer died reading its bucket, a producer writing the next one. Now the reads
// see zeros, the damage is reported, and the producer replaces the segment.
TEST_F(Peers, TruncatedSlotIsAnErrorNotACrash) {
  Workload workload{.buckets = 4, .tensors = 4, .tensor_bytes = 64 << 10, .seed = 9};
  auto publisher = Publisher::create(channel, {.slots = 2});
  Signal received, truncated;
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    {
      auto bucket = next_bucket(subscriber);
      if (!cli::check_bucket(bucket.view(), workload.seed, 0).empty()) return 1;
      if (!received.send() || !truncated.receive()) return 1;
      unsigned sum = 0;  // every byte of the held views, most of them now cut off
      for (std::size_t t = 0; t < bucket.view().size(); ++t) {
        for (auto b : bucket.view()[t].bytes) sum += static_cast<unsigned>(b);
      }
      std::printf("read the truncated bucket (sum %u)\n", sum);
    }
    for (std::uint64_t i = 1; i < workload.buckets; ++i) {
      auto bucket = next_bucket(subscriber);
      if (bucket.sequence() != i || !cli::check_bucket(bucket.view(), workload.seed, i).empty()) return 2;
    }
    return 0;
  });
  ASSERT_TRUE(publish(publisher, workload, 0));
  ASSERT_TRUE(received.receive());
  {
    Tampering slot(test::slot_name(channel, 0));
    ASSERT_TRUE(slot.mapped());
    slot.truncate(4096);
  }
  ASSERT_TRUE(truncated.send());
  ASSERT_TRUE(publish(publisher, workload, 1));
  // Bucket 2 goes to the truncated slot: written into lost pages, it is not published...
  auto message = expect_error(ErrorCode::SystemError, [&] { publish(publisher, workload, 2); });
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
  EXPECT_EQ(publisher.published(), 2u);
  // ...and the next try goes to a new segment.
  ASSERT_TRUE(publish(publisher, workload, 2));
  ASSERT_TRUE(publish(publisher, workload, 3));
  EXPECT_EQ(consumer.wait(), 0) << "(a negative status is the signal that killed the consumer)";
}

TEST_F(Peers, TruncatedControlSegmentIsAnErrorNotACrash) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel);
  Signal attached;
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    if (!attached.send()) return 1;
    try {
      subscriber.next(10s);
    } catch (const Error& e) {
      return e.code() == ErrorCode::SystemError ? 0 : 2;
    }
    return 3;
  });
  ASSERT_TRUE(attached.receive());
  Tampering(test::control_name(channel)).truncate(0);
  EXPECT_EQ(consumer.wait(), 0) << "(a negative status is the signal that killed the consumer)";
  expect_error(ErrorCode::SystemError, [&] { publish(publisher, workload, 0, 1s); });
}

// A record whose claim word another process rewrote is no longer this consumer's: it says so
// instead of writing into someone else's record.
TEST_F(Peers, ConsumerNoticesItsRecordWasTaken) {
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  Tampering control(test::control_name(channel));
  ASSERT_TRUE(control.mapped());
  auto& records = control.control().consumers;
  auto ours = std::find_if(std::begin(records), std::end(records),
                           [](auto& record) { return ipc::atomic(record.claim).load() != 0; });
  ASSERT_NE(ours, std::end(records));
  ipc::atomic(ours->claim).store(ipc::make_claim(ipc::kTokenLimit - 1, 0));
  auto message = expect_error(ErrorCode::SystemError, [&] { subscriber.next(100ms); });
  EXPECT_NE(message.find("taken"), std::string::npos) << message;
}

// Peers in different pid namespaces (containers sharing /dev/shm). Before, pids were compared:
// the consumer took the idle producer for dead (ProducerGone), and the producer took the
// consumer for dead and overwrote its bucket. Liveness is a lock now, blind to namespaces.
TEST_F(Peers, PeersInDifferentPidNamespacesSeeEachOtherAlive) {
  constexpr int kNotAllowed = 77;
  Workload workload{.buckets = 3, .tensors = 2, .tensor_bytes = 64, .seed = 12};
  auto publisher = Publisher::create(channel, {.slots = 1});
  Signal attached, holding;
  Child outer([&] {
    if (::unshare(CLONE_NEWPID) != 0) {
      attached.send('n');
      return kNotAllowed;
    }
    Child inner([&] {  // pid 1 of the new namespace
      auto subscriber = Subscriber::attach(channel, 10s);
      if (!attached.send('y')) return 1;
      for (std::uint64_t i = 0; i < workload.buckets; ++i) {
        auto bucket = next_bucket(subscriber);
        if (!cli::check_bucket(bucket.view(), workload.seed, i).empty()) return 2;
        if (i == 0) {
          if (!holding.send()) return 1;
          std::this_thread::sleep_for(300ms);
        }
      }
      try {
        subscriber.next(10s);
      } catch (const Error& e) {
        return e.code() == ErrorCode::ProducerGone ? 0 : 3;
      }
      return 4;
    });
    return inner.wait();
  });
  auto answer = attached.receive();
  if (answer == 'n') {
    EXPECT_EQ(outer.wait(), kNotAllowed);
    GTEST_SKIP() << "unsharing a pid namespace needs root";
  }
  ASSERT_EQ(answer, 'y');
  std::this_thread::sleep_for(100ms);  // idle: the consumer checks our liveness meanwhile
  ASSERT_TRUE(publish(publisher, workload, 0));
  ASSERT_TRUE(holding.receive());
  EXPECT_FALSE(publish(publisher, workload, 1, 50ms)) << "the producer freed a live consumer's record";
  auto info = inspect_channel(channel);
  ASSERT_EQ(info.consumers.size(), 1u);
  EXPECT_TRUE(info.consumers[0].alive);
  EXPECT_TRUE(info.consumers[0].pid_elsewhere);
  EXPECT_EQ(info.consumers[0].pid, 1);
  for (std::uint64_t i = 1; i < workload.buckets; ++i) ASSERT_TRUE(publish(publisher, workload, i));
  EXPECT_TRUE(publisher.drain(10s));
  publisher.close();
  EXPECT_EQ(outer.wait(), 0);
}

}  // namespace
}  // namespace tensorbucket
