// Serving semantics: updates as units, the `latest` overflow policy, and producer
// incarnations (a consumer never attaches to a dead producer's leftovers, and may follow a
// channel across producer restarts). Peers are threads of this process or forked processes.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "channel_support.hpp"
#include "ipc/os/liveness.hpp"
#include "support.hpp"

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;
using cli::Workload;
using test::Child;
using test::expect_error;
using test::next_bucket;
using test::segments_of;

using Updates = test::ChannelTest;

bool publish(Publisher& publisher, const Workload& workload, std::uint64_t index,
             std::chrono::milliseconds timeout = 10s) {
  return publisher.publish(cli::make_bucket(workload, index).builder, timeout);
}

// (version, bucket index) of each bucket of an update, for messages.
std::string places(const ReceivedUpdate& update) {
  std::string out;
  for (const auto& bucket : update.buckets()) {
    out += "(" + std::to_string(bucket.view().version()) + "," + std::to_string(bucket.view().bucket_index()) + ")";
  }
  return out;
}

// Every bucket of `update` is the workload's bucket of its version and index, byte for byte,
// and the update is whole: indices 0..count-1 of one version.
void expect_whole(const ReceivedUpdate& update, const Workload& workload) {
  auto count = update.buckets().front().view().bucket_count();
  ASSERT_EQ(update.buckets().size(), count) << places(update);
  for (std::uint32_t i = 0; i < count; ++i) {
    const auto& bucket = update.buckets()[i];
    EXPECT_EQ(bucket.view().bucket_index(), i) << places(update);
    EXPECT_EQ(bucket.view().version(), update.version()) << places(update);
    EXPECT_EQ(cli::check_bucket(bucket.view(), workload.seed, update.version() * count + i), "");
  }
}

// The case: with updates split into 4 buckets, a server that attached while version
// 1 was under way took its buckets 2 and 3, then version 2, and applied half of version 1.
TEST_F(Updates, ALateJoinerStartsAtTheNextUpdatesFirstBucket) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 4};
  auto publisher = Publisher::create(channel, {.slots = 2});
  auto early = Subscriber::attach(channel, 1s);
  for (std::uint64_t i = 0; i < 7; ++i) {  // version 0 whole, version 1 up to its bucket 2
    ASSERT_TRUE(publish(publisher, workload, i));
    next_bucket(early);
  }
  auto late = Subscriber::attach(channel, 1s);  // the slots hold (1, 1) and (1, 2)
  for (std::uint64_t i = 7; i < 9; ++i) {
    // Not held back by the late consumer for the buckets it skipped when it attached.
    ASSERT_TRUE(publish(publisher, workload, i, 0ms)) << publisher.waiting_for();
    next_bucket(early);
  }
  for (std::uint64_t version = 2; version < 4; ++version) {
    for (std::uint32_t i = 0; i < 4; ++i) {
      auto bucket = next_bucket(late);
      EXPECT_EQ(bucket.view().version(), version);
      EXPECT_EQ(bucket.view().bucket_index(), i);
      EXPECT_EQ(bucket.sequence(), version * 4 + i);
      EXPECT_EQ(cli::check_bucket(bucket.view(), workload.seed, version * 4 + i), "");
      if (version * 4 + i + 1 < 16) {
        ASSERT_TRUE(publish(publisher, workload, version * 4 + i + 1));
        next_bucket(early);
      }
    }
  }
}

// A joiner that passes over the tail of an update counts each bucket it skips as released:
// else, under `block` with min_consumers 1, a bucket nobody else read stalled the producer.
TEST_F(Updates, BucketsAJoinerSkipsDoNotStallTheProducer) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 2};
  auto publisher = Publisher::create(channel, {.slots = 3});
  {
    auto first = Subscriber::attach(channel, 1s);
    for (std::uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(publish(publisher, workload, i));
    next_bucket(first);  // bucket 0, then it leaves: bucket 1 was read by nobody
  }
  ASSERT_TRUE(publish(publisher, workload, 3));
  auto joiner = Subscriber::attach(channel, 1s);  // the slots hold (0, 1), (1, 0), (1, 1)
  ASSERT_TRUE(publish(publisher, workload, 4, 0ms)) << publisher.waiting_for();  // into bucket 1's slot
  auto bucket = next_bucket(joiner);
  EXPECT_EQ(bucket.sequence(), 2u);
  EXPECT_EQ(bucket.view().bucket_index(), 0u);
}

TEST_F(Updates, ATakeEverythingSubscriberStartsAtTheOldestHeldBucket) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 4};
  auto publisher = Publisher::create(channel, {.slots = 2});
  auto early = Subscriber::attach(channel, 1s);
  for (std::uint64_t i = 0; i < 7; ++i) {
    ASSERT_TRUE(publish(publisher, workload, i));
    next_bucket(early);
  }
  auto everything = Subscriber::attach(channel, 1s, {.whole_updates = false});
  auto first = next_bucket(everything);
  EXPECT_EQ(first.sequence(), 5u);
  EXPECT_EQ(first.view().version(), 1u);
  EXPECT_EQ(first.view().bucket_index(), 1u);
}

// The buckets the channel's slots hold.
std::set<std::uint64_t> held_buckets(const std::string& channel) {
  std::set<std::uint64_t> held;
  for (const auto& slot : inspect_channel(channel).slot_states) {
    if (slot.bucket) held.insert(*slot.bucket);
  }
  return held;
}

// A reservation that may be dropped halfway (Claim::SparingNewest) takes the slot publish()
// would take exactly when that slot is empty or holds a bucket older than the newest complete
// update and the update under way; dropped, it leaves every one of those held. Under both
// policies, with updates of 1 to 3 buckets, a reader that reads every bucket at once.
TEST_F(Updates, ASparingReservationTakesOnlyASlotOfAnOlderBucket) {
  struct Case {
    OverflowPolicy policy;
    std::uint32_t slots, update_buckets;
  };
  for (auto [policy, slots, update_buckets] :
       {Case{OverflowPolicy::Block, 1, 1}, Case{OverflowPolicy::Block, 2, 1}, Case{OverflowPolicy::Block, 3, 1},
        Case{OverflowPolicy::Block, 2, 2}, Case{OverflowPolicy::Block, 3, 2}, Case{OverflowPolicy::Block, 4, 3},
        Case{OverflowPolicy::Latest, 2, 1}, Case{OverflowPolicy::Latest, 3, 1}, Case{OverflowPolicy::Latest, 5, 2}}) {
    SCOPED_TRACE(std::string(to_string(policy)) + ", " + std::to_string(slots) + " slots, updates of " +
                 std::to_string(update_buckets));
    Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = update_buckets};
    auto publisher = Publisher::create(channel, {.slots = slots,
                                                 .max_consumers = 1,
                                                 .policy = policy,
                                                 .update_buckets = policy == OverflowPolicy::Latest ? update_buckets : 1});
    auto reader = Subscriber::attach(channel, 1s, {.whole_updates = false});
    for (std::uint64_t i = 0; i < 4 * slots * update_buckets; ++i) {
      SCOPED_TRACE("bucket " + std::to_string(i));
      // What a dropped reservation must leave: the newest complete update and the one under
      // way. The slot publish() takes next holds bucket i - slots (the reader holds none).
      auto under_way = i - i % update_buckets;
      auto kept_from = under_way >= update_buckets ? under_way - update_buckets : under_way;
      bool spares = i < slots || i - slots < kept_from;
      auto before = held_buckets(channel);
      {
        auto reservation = publisher.reserve(cli::make_layout(workload, i), 0ms, nullptr, Publisher::Claim::SparingNewest);
        EXPECT_EQ(reservation.has_value(), spares);
      }
      auto after = held_buckets(channel);
      for (auto bucket : before) {
        if (bucket >= kept_from) {
          EXPECT_TRUE(after.contains(bucket)) << "bucket " << bucket << " was taken";
        }
      }
      EXPECT_LE(before.size() - after.size(), 1u);
      ASSERT_TRUE(publish(publisher, workload, i, 1s)) << publisher.waiting_for();
      auto bucket = next_bucket(reader);
      EXPECT_EQ(bucket.sequence(), i);
      EXPECT_EQ(cli::check_bucket(bucket.view(), workload.seed, i), "");
    }
  }
}

// When the slot to take holds the newest bucket, a sparing reservation says no at once, however
// long its deadline: waiting cannot change that, only a publish. Under `latest`, a reader's
// lease on the older bucket leaves only the newest one's slot.
TEST_F(Updates, ASparingReservationSaysNoAtOnce) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  for (auto [policy, slots] : {std::pair{OverflowPolicy::Block, 1u}, std::pair{OverflowPolicy::Latest, 2u}}) {
    SCOPED_TRACE(to_string(policy));
    auto publisher = Publisher::create(channel, {.slots = slots, .max_consumers = 1, .policy = policy});
    auto reader = Subscriber::attach(channel, 1s);
    ASSERT_TRUE(publish(publisher, workload, 0));
    auto held = next_bucket(reader);
    if (policy == OverflowPolicy::Block) {
      held.release();
    } else {
      ASSERT_TRUE(publish(publisher, workload, 1));
    }
    auto next = publisher.published();
    auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(publisher.reserve(cli::make_layout(workload, next), 10s, nullptr, Publisher::Claim::SparingNewest));
    EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
    EXPECT_NE(publisher.waiting_for().find("SparingNewest"), std::string::npos) << publisher.waiting_for();
    EXPECT_EQ(held_buckets(channel).size(), slots);
    // The same slot for publish(), which may take it.
    ASSERT_TRUE(publish(publisher, workload, next, 0ms)) << publisher.waiting_for();
    held.release();
    auto newest = next_bucket(reader);
    EXPECT_EQ(newest.sequence(), next);
  }
}

// Nor, under `latest`, a bucket a consumer has yet to read: one within an update holds its first
// bucket while the producer publishes the next update, and still gets the second.
TEST_F(Updates, ASparingReservationLeavesWhatAConsumerHasYetToRead) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 2};
  auto publisher =
      Publisher::create(channel, {.slots = 4, .max_consumers = 1, .policy = OverflowPolicy::Latest, .update_buckets = 2});
  auto reader = Subscriber::attach(channel, 1s);
  for (std::uint64_t i = 0; i < 2; ++i) ASSERT_TRUE(publish(publisher, workload, i, 0ms));
  auto first = next_bucket(reader);
  for (std::uint64_t i = 2; i < 4; ++i) ASSERT_TRUE(publish(publisher, workload, i, 0ms));
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(publisher.reserve(cli::make_layout(workload, 4), 10s, nullptr, Publisher::Claim::SparingNewest));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  EXPECT_EQ(held_buckets(channel), (std::set<std::uint64_t>{0, 1, 2, 3}));
  first.release();
  auto second = next_bucket(reader);
  EXPECT_EQ(second.sequence(), 1u);
  EXPECT_EQ(cli::check_bucket(second.view(), workload.seed, 1), "");
}

TEST_F(Updates, NextUpdateHandsOutEveryBucketOfOneVersionLeased) {
  for (std::uint32_t buckets : {1u, 4u, 15u}) {
    SCOPED_TRACE(std::to_string(buckets) + " buckets per update");
    auto run_channel = channel + "-" + std::to_string(buckets);
    Workload workload{.tensors = 3, .tensor_bytes = 256, .update_buckets = buckets};
    auto publisher = Publisher::create(run_channel, {.slots = buckets});
    auto subscriber = Subscriber::attach(run_channel, 1s);
    for (std::uint64_t version = 0; version < 3; ++version) {
      for (std::uint32_t i = 0; i < buckets; ++i) ASSERT_TRUE(publish(publisher, workload, version * buckets + i));
      auto update = subscriber.next_update(10s);
      ASSERT_TRUE(update);
      EXPECT_EQ(update->version(), version);
      EXPECT_EQ(update->first_sequence(), version * buckets);
      expect_whole(*update, workload);
      // Every slot is leased while the update lives: the producer cannot go on.
      EXPECT_FALSE(publish(publisher, workload, (version + 1) * buckets, 0ms));
    }
  }
  // Cleaned up by each publisher's destructor: TearDown looks at `channel` only.
  for (auto buckets : {1, 4, 15}) EXPECT_EQ(segments_of(channel + "-" + std::to_string(buckets)), std::vector<std::string>{});
}

TEST_F(Updates, NextUpdateWaitsAcrossCallsForTheRestOfAnUpdate) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 3};
  auto publisher = Publisher::create(channel, {.slots = 3});
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publish(publisher, workload, 0));
  ASSERT_TRUE(publish(publisher, workload, 1));
  EXPECT_FALSE(subscriber.next_update(20ms));  // not complete yet: nothing
  ASSERT_TRUE(publish(publisher, workload, 2));
  auto update = subscriber.next_update(1s);
  ASSERT_TRUE(update);
  expect_whole(*update, workload);
}

TEST_F(Updates, NextUpdateDropsAnUpdateTheProducerLeftUnfinished) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 3};
  auto publisher = Publisher::create(channel, {.slots = 3});
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publish(publisher, workload, 0));
  ASSERT_TRUE(publish(publisher, workload, 1));
  EXPECT_FALSE(subscriber.next_update(20ms));  // holds (0, 0) and (0, 1)
  // The trainer gives up on version 0 and begins version 1.
  ASSERT_TRUE(publish(publisher, workload, 3));
  EXPECT_FALSE(subscriber.next_update(20ms));  // dropped version 0, holds (1, 0)
  ASSERT_TRUE(publish(publisher, workload, 4, 0ms));
  ASSERT_TRUE(publish(publisher, workload, 5, 0ms));
  auto update = subscriber.next_update(1s);
  ASSERT_TRUE(update);
  EXPECT_EQ(update->version(), 1u);
  EXPECT_EQ(update->first_sequence(), 2u);
}

TEST_F(Updates, NextUpdateRefusesAnUpdateLargerThanTheChannelsSlots) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 4};
  auto publisher = Publisher::create(channel, {.slots = 2});
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publish(publisher, workload, 0));
  auto error = expect_error(ErrorCode::InvalidArgument, [&] { subscriber.next_update(1s); });
  EXPECT_NE(error.find("slots >= 4"), std::string::npos) << error;
}

TEST_F(Updates, NextUpdateChecksTheWholeModelOnce) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 2};
  auto publisher = Publisher::create(channel, {.slots = 2});
  auto subscriber = Subscriber::attach(channel, 1s);
  // Each bucket holds t0 and t1: the model the update makes has each name twice.
  ASSERT_TRUE(publish(publisher, workload, 0));
  ASSERT_TRUE(publish(publisher, workload, 1));
  Manifest model = cli::make_layout(workload, 0).manifest();
  expect_error(ErrorCode::DuplicateName, [&] { subscriber.next_update(1s, {.expected = &model}); });
}

TEST_F(Updates, ProducerRefusesBucketsOutOfTheirUpdatesOrder) {
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 2};
  auto publisher = Publisher::create(channel, {.slots = 2});
  auto subscriber = Subscriber::attach(channel, 1s);
  expect_error(ErrorCode::InvalidArgument, [&] { publish(publisher, workload, 1); });  // (0, 1) first
  ASSERT_TRUE(publish(publisher, workload, 0));
  expect_error(ErrorCode::InvalidArgument, [&] { publish(publisher, workload, 3); });  // (1, 1) after (0, 0)
  EXPECT_EQ(publisher.published(), 1u);
  next_bucket(subscriber);
  ASSERT_TRUE(publish(publisher, workload, 2));  // bucket 0 begins a new update, leaving one unfinished
  EXPECT_EQ(publisher.published(), 2u);
}

TEST_F(Updates, LatestChannelNeedsASlotRuleItChecksAtCreate) {
  auto error = expect_error(ErrorCode::InvalidArgument,
                            [&] { Publisher::create(channel, {.slots = 2, .policy = OverflowPolicy::Latest}); });
  EXPECT_NE(error.find("slots >= (max_consumers + 1) x update_buckets = 9"), std::string::npos) << error;
  expect_error(ErrorCode::InvalidArgument, [&] {
    Publisher::create(channel, {.slots = 7, .max_consumers = 2, .policy = OverflowPolicy::Latest, .update_buckets = 3});
  });
  EXPECT_EQ(segments_of(channel), std::vector<std::string>{});
  auto publisher =
      Publisher::create(channel, {.slots = 9, .max_consumers = 2, .policy = OverflowPolicy::Latest, .update_buckets = 3});
  EXPECT_EQ(latest_slots_needed(2, 3), 9u);
  Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 4};
  expect_error(ErrorCode::InvalidArgument, [&] { publish(publisher, workload, 0); });  // 4 > update_buckets
}

// A consumer that holds an update (its leases) while the producer publishes ten more: the
// producer never waits, never touches the held update's bytes, and the consumer's next
// update is the newest.
TEST_F(Updates, LatestProducerNeverWaitsAndTheConsumerTakesTheNewestUpdate) {
  Workload workload{.tensors = 4, .tensor_bytes = 512, .update_buckets = 2};
  auto publisher =
      Publisher::create(channel, {.slots = 4, .max_consumers = 1, .policy = OverflowPolicy::Latest, .update_buckets = 2});
  auto subscriber = Subscriber::attach(channel, 1s);
  EXPECT_EQ(subscriber.policy(), OverflowPolicy::Latest);
  ASSERT_TRUE(publish(publisher, workload, 0, 0ms));
  ASSERT_TRUE(publish(publisher, workload, 1, 0ms));
  auto held = subscriber.next_update(1s);
  ASSERT_TRUE(held);
  for (std::uint64_t i = 2; i < 22; ++i) ASSERT_TRUE(publish(publisher, workload, i, 0ms)) << "bucket " << i;
  expect_whole(*held, workload);  // its slots were never rewritten
  EXPECT_EQ(held->version(), 0u);
  held.reset();
  auto newest = subscriber.next_update(1s);
  ASSERT_TRUE(newest);
  EXPECT_EQ(newest->version(), 10u);
  EXPECT_EQ(newest->first_sequence(), 20u);
  expect_whole(*newest, workload);
}

TEST_F(Updates, LatestConsumerInAnotherProcessSeesOnlyWholeUpdatesInOrder) {
  Workload workload{.tensors = 4, .tensor_bytes = 1024, .update_buckets = 3};
  constexpr std::uint64_t kVersions = 300;
  auto publisher =
      Publisher::create(channel, {.slots = 6, .max_consumers = 1, .policy = OverflowPolicy::Latest, .update_buckets = 3});
  test::Signal ready;
  Child slow([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    ready.send();
    std::uint64_t last = 0;
    bool any = false;
    for (;;) {
      std::optional<ReceivedUpdate> update;
      try {
        update = subscriber.next_update(10s);
      } catch (const Error& e) {
        if (e.code() == ErrorCode::ProducerGone) return any && last == kVersions - 1 ? 0 : 7;
        throw;
      }
      if (!update) return 3;
      if (update->buckets().size() != 3) return 4;
      if (any && update->version() <= last) return 5;
      for (const auto& bucket : update->buckets()) {
        if (!cli::check_bucket(bucket.view(), workload.seed, bucket.sequence()).empty()) return 6;
      }
      any = true;
      last = update->version();
      std::this_thread::sleep_for(1ms);  // slower than the producer
    }
  });
  ASSERT_TRUE(ready.receive());
  for (std::uint64_t i = 0; i < kVersions * 3; ++i) {
    ASSERT_TRUE(publish(publisher, workload, i, 0ms)) << "bucket " << i << ": " << publisher.waiting_for();
  }
  ASSERT_TRUE(publisher.drain(30s)) << publisher.waiting_for();
  publisher.close();
  EXPECT_EQ(slow.wait(), 0);
}

// The case: a server reconnecting after its trainer was killed re-attached to the
// dead trainer's segments and replayed its buckets, while the new trainer timed out.
TEST_F(Updates, AttachNeverAttachesToADeadProducersLeftovers) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  Child dead([&] {
    auto publisher = Publisher::create(channel);
    publish(publisher, workload, 0);
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  EXPECT_EQ(dead.wait(), -SIGKILL);
  ASSERT_FALSE(segments_of(channel).empty());
  auto error = expect_error(ErrorCode::ChannelMissing, [&] { Subscriber::attach(channel, 100ms); });
  EXPECT_NE(error.find("dead producer"), std::string::npos) << error;
  EXPECT_EQ(segments_of(channel), std::vector<std::string>{});  // the attacher removed them
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  EXPECT_EQ(subscriber.incarnation(), publisher.incarnation());
  ASSERT_TRUE(publish(publisher, workload, 0));
  auto bucket = next_bucket(subscriber);
  EXPECT_EQ(bucket.incarnation(), publisher.incarnation());
}

// Whoever removes a dead producer's leftovers holds its lock byte meanwhile: an attacher must
// not take that for a live producer and attach to the dead one's channel.
TEST_F(Updates, AnAttacherDoesNotTakeARemoverForALiveProducer) {
  Child dead([&] {
    auto publisher = Publisher::create(channel);
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  EXPECT_EQ(dead.wait(), -SIGKILL);
  int fd = ::shm_open(("/" + test::control_name(channel)).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto lock = [&](off_t byte, short type) {
    struct flock range{};
    range.l_type = type;
    range.l_whence = SEEK_SET;
    range.l_start = byte;
    range.l_len = 1;
    return ::fcntl(fd, F_OFD_SETLK, &range) == 0;
  };
  ASSERT_TRUE(lock(ipc::kRemoverLockByte, F_WRLCK));  // as a remover does: its byte first,
  ASSERT_TRUE(lock(ipc::kProducerLockByte, F_WRLCK));  // then the dead producer's (not yet marked)
  auto error = expect_error(ErrorCode::ChannelMissing, [&] { Subscriber::attach(channel, 100ms); });
  EXPECT_NE(error.find("are being removed by another process"), std::string::npos) << error;
  EXPECT_FALSE(segments_of(channel).empty());  // left to the remover
  // A new producer waits for the remover as long as its deadline says, and not past an
  // interruption (a stopped remover held it 10 s, deaf to Ctrl+C, then blamed other producers).
  auto start = std::chrono::steady_clock::now();
  error = expect_error(ErrorCode::ChannelExists, [&] { Publisher::create(channel, {}, 200ms); });
  EXPECT_GE(std::chrono::steady_clock::now() - start, 200ms);
  EXPECT_NE(error.find("is being removed by another process (a dead producer's leftovers), which did not finish within "
                       "200 ms"),
            std::string::npos)
      << error;
  int asked = 0;
  error = expect_error(ErrorCode::ChannelExists, [&] {
    Publisher::create(channel, {}, Deadline::after(10s).unless([&] { return ++asked == 2; }));
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_NE(error.find("did not finish before the wait was interrupted"), std::string::npos) << error;
  EXPECT_FALSE(segments_of(channel).empty());
  lock(ipc::kProducerLockByte, F_UNLCK);
  lock(ipc::kRemoverLockByte, F_UNLCK);
  ::close(fd);
  expect_error(ErrorCode::ChannelMissing, [&] { Subscriber::attach(channel, 100ms); });
  EXPECT_EQ(segments_of(channel), std::vector<std::string>{});  // the attacher removed them
}

// A consumer still attached to a killed producer opens that producer's slots by name when it
// first needs them. A restarted producer of the name used to make its slots under the same
// names (epochs 1, 2, ...), and that consumer took the new producer's bytes for the dead one's
// bucket 1, while they changed under its lease. It gets ProducerGone now, and the restarted
// producer's buckets once, through a new attach.
TEST_F(Updates, ARestartedProducersSlotsAreNotTakenForTheDeadOnes) {
  Workload workload{.tensors = 2, .tensor_bytes = 256};
  test::Signal attached;
  Child dead([&] {
    auto publisher = Publisher::create(channel, {.slots = 2});
    attached.receive();
    if (!publish(publisher, workload, 0) || !publish(publisher, workload, 1)) return 3;
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  auto subscriber = Subscriber::attach(channel, 10s);
  attached.send();
  EXPECT_EQ(cli::check_bucket(next_bucket(subscriber).view(), workload.seed, 0), "");  // slot 1 not opened yet
  EXPECT_EQ(dead.wait(), -SIGKILL);
  auto restarted = Publisher::create(channel, {.slots = 2, .min_consumers = 0});
  ASSERT_TRUE(publish(restarted, workload, 101));
  ASSERT_TRUE(publish(restarted, workload, 102));
  expect_error(ErrorCode::ProducerGone, [&] { subscriber.next(1s); });
  auto again = Subscriber::attach(channel, 1s);  // a joiner: from what the slots still hold
  EXPECT_EQ(cli::check_bucket(next_bucket(again).view(), workload.seed, 101), "");
  EXPECT_EQ(cli::check_bucket(next_bucket(again).view(), workload.seed, 102), "");
}

// A remover takes its own lock byte before it looks at the producer's: a `tbucket rm` refused
// because the producer lives, or a second producer of the name, holds it for a moment. Its
// consumers used to take that for the producer's death (ProducerGone; under follow_restarts, a
// re-attach that delivered buckets twice).
TEST_F(Updates, ARefusedRemoverDoesNotMakeALiveProducerLookGone) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  int fd = ::shm_open(("/" + test::control_name(channel)).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  struct flock range{};
  range.l_type = F_WRLCK;
  range.l_whence = SEEK_SET;
  range.l_start = ipc::kRemoverLockByte;
  range.l_len = 1;
  ASSERT_EQ(::fcntl(fd, F_OFD_SETLK, &range), 0);
  EXPECT_FALSE(subscriber.next(50ms).has_value());  // waits past the liveness check (5 ms), no ProducerGone
  ::close(fd);
  expect_error(ErrorCode::ChannelExists, [&] { remove_channel(channel); });
  expect_error(ErrorCode::ChannelExists, [&] { Publisher::create(channel); });
  EXPECT_FALSE(subscriber.next(50ms).has_value());
  ASSERT_TRUE(publish(publisher, workload, 0));
  EXPECT_EQ(cli::check_bucket(next_bucket(subscriber).view(), workload.seed, 0), "");
}

TEST_F(Updates, AnAttacherWaitsForTheProducerThatReplacesADeadOne) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  Child dead([&] {
    auto publisher = Publisher::create(channel);
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  EXPECT_EQ(dead.wait(), -SIGKILL);
  Child restarted([&] {
    std::this_thread::sleep_for(100ms);
    auto publisher = Publisher::create(channel);
    return publish(publisher, workload, 0) && publisher.drain(10s) ? 0 : 3;
  });
  auto subscriber = Subscriber::attach(channel, 10s);
  EXPECT_EQ(cli::check_bucket(next_bucket(subscriber).view(), workload.seed, 0), "");
  EXPECT_EQ(restarted.wait(), 0);
}

// A trainer killed with SIGKILL in the middle of an update, restarted from its checkpoint: a
// following server gets every whole update of the first incarnation, ProducerGone once, then
// the second incarnation's updates; versions never go back and nothing is replayed.
TEST_F(Updates, AFollowingSubscriberGoesOnWithTheRestartedProducer) {
  Workload workload{.tensors = 3, .tensor_bytes = 512, .update_buckets = 2};
  test::Signal attached;
  auto trainer = [&](std::uint64_t from_version, std::uint64_t versions, bool die_mid_update) {
    return [&, from_version, versions, die_mid_update] {
      auto publisher = Publisher::create(channel, {.slots = 2});
      if (from_version == 0) attached.receive();
      for (std::uint64_t v = from_version; v < from_version + versions; ++v) {
        for (std::uint64_t i = 0; i < 2; ++i) {
          if (!publish(publisher, workload, v * 2 + i)) return 3;
        }
      }
      if (die_mid_update) {
        publish(publisher, workload, (from_version + versions) * 2);  // bucket 0 of the next update
        ::kill(::getpid(), SIGKILL);
      }
      return publisher.drain(10s) ? 0 : 4;
    };
  };
  Child first(trainer(0, 5, true));
  auto subscriber = Subscriber::attach(channel, 10s, {.follow_restarts = true});
  attached.send();
  std::vector<std::pair<std::uint64_t, std::uint64_t>> seen;  // (incarnation, version)
  int gone = 0;
  std::optional<Child> second;
  while (seen.empty() || seen.back().second < 9) {
    try {
      auto update = subscriber.next_update(10s);
      ASSERT_TRUE(update) << "no update within 10 s";
      expect_whole(*update, workload);
      seen.emplace_back(update->incarnation(), update->version());
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), ErrorCode::ProducerGone) << e.what();
      ++gone;
      EXPECT_EQ(first.wait(), -SIGKILL);
      second.emplace(trainer(5, 5, false));  // from the checkpoint of version 5
    }
  }
  EXPECT_EQ(gone, 1);
  ASSERT_EQ(seen.size(), 10u);
  for (std::size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].second, i);
    EXPECT_EQ(seen[i].first, seen[i < 5 ? 0 : 5].first);
  }
  EXPECT_NE(seen[0].first, seen[5].first);
  EXPECT_EQ(second->wait(), 0);
}

}  // namespace
}  // namespace tensorbucket
