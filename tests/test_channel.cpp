// The shared-memory channel, with peers as real processes (fork), and what must hold when one
// of them is killed. Every test checks that none of its segments is left in /dev/shm. Hostile
// peers: test_channel_peers.cpp; consumers coming and going: test_channel_churn.cpp.
#include <gtest/gtest.h>

#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include "channel_support.hpp"
#include "serialize/copy.hpp"
#include "support.hpp"

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;
using cli::Workload;
using test::Child;
using test::consume;
using test::expect_error;
using test::next_bucket;
using test::segments_of;

using Channel = test::ChannelTest;

TEST_F(Channel, DeliversEveryBucketInOrderToTwoConsumers) {
  Workload workload{.buckets = 1000, .tensors = 8, .tensor_bytes = 512, .seed = 3};
  auto publisher = Publisher::create(channel, {.min_consumers = 2});
  Child first([&] { return consume(channel, workload, workload.buckets); });
  Child second([&] { return consume(channel, workload, workload.buckets); });
  for (std::uint64_t i = 0; i < workload.buckets; ++i) {
    auto bucket = cli::make_bucket(workload, i);
    ASSERT_TRUE(publisher.publish(bucket.builder, 10s)) << "bucket " << i;
  }
  EXPECT_TRUE(publisher.drain(10s));
  EXPECT_EQ(first.wait(), 0);
  EXPECT_EQ(second.wait(), 0);
}

// The same stress with peers as threads of one process: what ThreadSanitizer can see (it
// cannot follow memory shared between processes).
TEST_F(Channel, DeliversEveryBucketInOrderToTwoConsumerThreads) {
  Workload workload{.buckets = 1000, .tensors = 8, .tensor_bytes = 512, .seed = 4};
  auto publisher = Publisher::create(channel, {.min_consumers = 2});
  std::atomic<int> first{-1}, second{-1};
  std::thread a([&] { first = consume(channel, workload, workload.buckets); });
  std::thread b([&] { second = consume(channel, workload, workload.buckets); });
  for (std::uint64_t i = 0; i < workload.buckets; ++i) {
    if (!publisher.publish(cli::make_bucket(workload, i).builder, 10s)) {
      ADD_FAILURE() << "bucket " << i << " waited for " << publisher.waiting_for();
      break;  // to the joins: a test that returned here would leave them joinable
    }
  }
  EXPECT_TRUE(publisher.drain(10s));
  a.join();
  b.join();
  EXPECT_EQ(first, 0);
  EXPECT_EQ(second, 0);
}

TEST_F(Channel, OneSlotAppliesBackpressureWithoutLoss) {
  Workload workload{.buckets = 40, .tensors = 4, .tensor_bytes = 256};
  auto publisher = Publisher::create(channel, {.slots = 1});
  Child consumer([&] { return consume(channel, workload, workload.buckets, 1ms); });
  for (std::uint64_t i = 0; i < workload.buckets; ++i) {
    ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, i).builder, 10s));
  }
  EXPECT_EQ(consumer.wait(), 0);
}

TEST_F(Channel, PublishTimesOutWhileNoSlotIsFree) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 1});
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  EXPECT_FALSE(publisher.publish(cli::make_bucket(workload, 1).builder, 50ms));
  EXPECT_EQ(publisher.published(), 1u);
}

TEST_F(Channel, PublishTimeoutNamesTheReleasesMissing) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 1, .min_consumers = 2});
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  EXPECT_FALSE(publisher.publish(cli::make_bucket(workload, 1).builder, 50ms));
  EXPECT_EQ(publisher.waiting_for(), "a consumer (none is attached) to release bucket 0 (min_consumers is 2; 0 did)");
  auto subscriber = Subscriber::attach(channel, 1s);
  subscriber.next(1s)->release();
  EXPECT_FALSE(publisher.publish(cli::make_bucket(workload, 1).builder, 50ms));
  EXPECT_EQ(publisher.waiting_for(), "consumers to release bucket 0 (min_consumers is 2; 1 did)");
}

TEST_F(Channel, LongestTimeoutWaitsWithoutLimit) {
  constexpr auto forever = std::chrono::milliseconds::max();
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, forever);
  test::Tampering control(test::control_name(channel));
  ASSERT_TRUE(control.mapped());
  std::thread late([&] {
    // Only once the consumer sleeps in its wait: a bucket published before it got there
    // would be returned without any waiting, whatever the timeout did.
    auto& sleepers = control.control().consumer_wake.sleepers;
    EXPECT_TRUE(test::wait_until([&] { return ipc::atomic(sleepers).load() > 0; }));
    EXPECT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, forever));
  });
  auto bucket = subscriber.next(forever);
  late.join();
  ASSERT_TRUE(bucket.has_value());
  bucket->release();
  EXPECT_TRUE(publisher.drain(forever));
}

TEST(Deadline, SaysWhenAWaitEndsAndHowMessagesNameIt) {
  EXPECT_TRUE(Deadline(0ms).passed());
  EXPECT_TRUE(Deadline(-5ms).passed());
  EXPECT_TRUE(Deadline::after(std::chrono::duration<double>(std::nan(""))).passed());
  EXPECT_FALSE(Deadline(1h).passed());
  EXPECT_FALSE(Deadline(1h).never_ends());
  EXPECT_TRUE(Deadline(std::chrono::milliseconds::max()).never_ends());
  EXPECT_TRUE(Deadline(Deadline::kForever).never_ends());
  EXPECT_TRUE(Deadline::never().never_ends());
  EXPECT_EQ(Deadline::never().left(), std::chrono::milliseconds::max());
  EXPECT_EQ(Deadline(20ms).limit(), "20 ms");
  EXPECT_EQ(Deadline(1500us).limit(), "2 ms");  // rounded up, as the wait is
  EXPECT_EQ(Deadline::never().limit(), "no limit");
  EXPECT_EQ(Deadline(20ms).described_as("0.02 s").limit(), "0.02 s");
  auto now = Deadline::Clock::now();
  auto deadline = Deadline(1h);
  EXPECT_LE(deadline.next_sleep(10ms, now), 10ms);
  EXPECT_GE(deadline.left(now), 3599s);
}

TEST(Deadline, AsksInterruptedAtItsPaceAndRemembersTrue) {
  int asked = 0;
  auto deadline = Deadline::never().unless([&] { return ++asked == 2; });
  auto made = Deadline::Clock::now();
  EXPECT_FALSE(deadline.interrupted(made));  // too soon: a wait that ends now never asks
  EXPECT_EQ(asked, 0);
  EXPECT_LE(deadline.next_sleep(1h, made), Deadline::kAskEvery);  // the sleep ends when it is due
  EXPECT_FALSE(deadline.interrupted(made + Deadline::kAskEvery));
  EXPECT_FALSE(deadline.interrupted(made + Deadline::kAskEvery + 1ms));  // asked just now
  EXPECT_EQ(asked, 1);
  EXPECT_TRUE(deadline.interrupted(made + 2 * Deadline::kAskEvery));
  EXPECT_TRUE(deadline.interrupted(made + 2 * Deadline::kAskEvery + 1ms));  // remembered, not asked
  EXPECT_TRUE(deadline.ask());
  EXPECT_EQ(asked, 2);

  // ask() asks at once: a deadline made from another keeps that one's pace, not two in a row.
  int outer_asked = 0;
  auto outer = Deadline::never().unless([&] { return ++outer_asked > 0; });
  auto inner = Deadline::never().unless([&] { return outer.ask(); });
  EXPECT_TRUE(inner.interrupted(Deadline::Clock::now() + Deadline::kAskEvery));
  EXPECT_EQ(outer_asked, 1);
}

// Every wait ends once its deadline is interrupted, as at its timeout, with nothing done; a
// wait that does not sleep never asks.
TEST_F(Channel, InterruptedDeadlineEndsEveryWait) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  int asked = 0;
  auto interrupted = [&] {
    ++asked;
    return true;
  };
  auto interruptible = [&] { return Deadline(60s).unless(interrupted); };
  auto start = Deadline::Clock::now();
  auto message = expect_error(ErrorCode::ChannelMissing, [&] { Subscriber::attach(channel, interruptible()); });
  EXPECT_NE(message.find("interrupted"), std::string::npos) << message;

  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  EXPECT_FALSE(subscriber.next(interruptible()).has_value());
  EXPECT_EQ(asked, 2);
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, interruptible()));  // a free slot: no wait
  EXPECT_EQ(asked, 2);
  EXPECT_FALSE(publisher.publish(cli::make_bucket(workload, 1).builder, interruptible()));
  EXPECT_FALSE(publisher.reserve(cli::make_layout(workload, 1), interruptible()).has_value());
  EXPECT_FALSE(publisher.drain(interruptible()));
  EXPECT_EQ(asked, 5);
  EXPECT_EQ(publisher.published(), 1u);
  EXPECT_LT(Deadline::Clock::now() - start, 30s);  // none waited for its 60 s
  auto bucket = subscriber.next(interruptible());
  ASSERT_TRUE(bucket.has_value());
  EXPECT_EQ(bucket->view().version(), 0u);
  EXPECT_EQ(asked, 5);
}

TEST_F(Channel, LateConsumerStartsFromOldestHeldBucket) {
  Workload workload{.buckets = 3, .tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 2});
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 1).builder, 1s));
  ASSERT_FALSE(publisher.publish(cli::make_bucket(workload, 2).builder, 20ms));
  Child consumer([&] { return consume(channel, workload, 3); });
  EXPECT_TRUE(publisher.publish(cli::make_bucket(workload, 2).builder, 10s));
  EXPECT_EQ(consumer.wait(), 0);
}

// With min_consumers = 0 the producer goes on without consumers, overwriting its slots: a
// consumer that comes later starts from the oldest bucket still held, not from bucket 0.
TEST_F(Channel, LateConsumerSkipsBucketsNoLongerHeld) {
  Workload workload{.buckets = 8, .tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 3, .min_consumers = 0});
  auto publish = [&](std::uint64_t i, std::chrono::milliseconds timeout) {
    return publisher.publish(cli::make_bucket(workload, i).builder, timeout);
  };
  for (std::uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(publish(i, 1s)) << "bucket " << i;
  auto subscriber = Subscriber::attach(channel, 1s);  // the slots hold buckets 2, 3 and 4
  // Lossless once attached: bucket 5 would overwrite bucket 2, which it has not read.
  EXPECT_FALSE(publish(5, 20ms));
  auto receive = [&](std::uint64_t i) {
    auto bucket = next_bucket(subscriber, 1s);
    EXPECT_EQ(bucket.sequence(), i);
    EXPECT_EQ(cli::check_bucket(bucket.view(), workload.seed, i), "");
  };
  for (std::uint64_t i = 2; i < 5; ++i) receive(i);
  for (std::uint64_t i = 5; i < workload.buckets; ++i) {
    ASSERT_TRUE(publish(i, 1s)) << "bucket " << i;
    receive(i);
  }
}

TEST_F(Channel, InPlaceReservationPublishesWhatWasWritten) {
  Workload workload{.buckets = 4, .tensors = 5, .tensor_bytes = 1000};
  auto publisher = Publisher::create(channel);
  Child consumer([&] { return consume(channel, workload, workload.buckets); });
  for (std::uint64_t i = 0; i < workload.buckets; ++i) {
    auto reservation = publisher.reserve(cli::make_layout(workload, i), 10s);
    ASSERT_TRUE(reservation.has_value());
    for (std::uint32_t t = 0; t < workload.tensors; ++t) {
      cli::fill_tensor(reservation->entry_spans()[t], workload, i, t);
    }
    reservation->commit();
  }
  EXPECT_EQ(consumer.wait(), 0);
}

// write() copies as packing does, streaming past 4 MiB: both sizes arrive intact.
TEST_F(Channel, ReservationWriteCopiesEachEntry) {
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  for (std::uint64_t tensor_bytes : {1000ull, 9ull << 20}) {
    Workload workload{.tensors = 2, .tensor_bytes = tensor_bytes};
    auto filled = cli::make_bucket(workload, 0);
    auto packed = filled.builder.pack();
    auto source = BucketView::open(packed.frame, packed.payload.span());
    auto reservation = publisher.reserve(cli::make_layout(workload, 0), 1s);
    ASSERT_TRUE(reservation.has_value());
    for (std::size_t t = 0; t < source.size(); ++t) reservation->write(t, source[t].bytes.data());
    expect_error(ErrorCode::InvalidArgument, [&] { reservation->write(source.size(), nullptr); });
    reservation->commit();
    // A published bucket is not written again.
    expect_error(ErrorCode::InvalidArgument, [&] { reservation->write(0, source[1].bytes.data()); });
    auto bucket = subscriber.next(1s);
    ASSERT_TRUE(bucket.has_value());
    EXPECT_EQ(cli::check_bucket(bucket->view(), workload.seed, 0), "") << tensor_bytes;
  }
}

TEST_F(Channel, ReservationPaddingCarriesNoOlderBytes) {
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  // Fill the slot with non-zero bytes first: 2 x 512 bytes, no padding.
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2, .tensor_bytes = 512}, 0).builder, 1s));
  next_bucket(subscriber, 1s).release();
  // Then a layout of 2 x 8 bytes: bytes 8..255 are padding.
  auto layout = cli::make_layout({.tensors = 2, .tensor_bytes = 8}, 1);
  auto reservation = publisher.reserve(layout, 1s);
  ASSERT_TRUE(reservation.has_value());
  for (auto span : reservation->entry_spans()) std::fill(span.begin(), span.end(), std::byte{7});
  reservation->commit();
  auto bucket = subscriber.next(1s);
  ASSERT_TRUE(bucket.has_value());
  const auto* start = bucket->view()[0].bytes.data();
  for (std::size_t i = 8; i < 256; ++i) ASSERT_EQ(start[i], std::byte{0}) << "padding byte " << i;
}

// A slot whose last layout was the same one keeps its zeroed padding (reserve() does not zero
// it again), unless a writer had the whole payload(): what it wrote in the padding travels with
// its own bucket only.
TEST_F(Channel, PaddingWrittenThroughPayloadTravelsWithThatBucketOnly) {
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  auto layout = cli::make_layout({.tensors = 2, .tensor_bytes = 8}, 1);  // padding: 8..255, 264..511
  auto padding_of = [](const BucketView& view) {
    const auto* start = view[0].bytes.data();
    std::vector<std::byte> padding(start + 8, start + 256);
    padding.insert(padding.end(), start + 264, start + 512);
    return padding;
  };
  for (int round = 0; round < 2; ++round) {  // entries only, with the same layout again
    auto reservation = publisher.reserve(layout, 1s);
    ASSERT_TRUE(reservation.has_value());
    for (auto span : reservation->entry_spans()) std::fill(span.begin(), span.end(), std::byte{7});
    reservation->commit();
    auto bucket = next_bucket(subscriber, 1s);
    EXPECT_EQ(padding_of(bucket.view()), std::vector<std::byte>(496, std::byte{0})) << "round " << round;
    bucket.release();
  }
  {
    auto reservation = publisher.reserve(layout, 1s);
    ASSERT_TRUE(reservation.has_value());
    auto payload = reservation->payload();
    std::fill(payload.begin(), payload.end(), std::byte{0x55});
    reservation->commit();
    auto bucket = next_bucket(subscriber, 1s);
    EXPECT_EQ(padding_of(bucket.view()), std::vector<std::byte>(496, std::byte{0x55}));
    bucket.release();
  }
  auto reservation = publisher.reserve(layout, 1s);
  ASSERT_TRUE(reservation.has_value());
  for (auto span : reservation->entry_spans()) std::fill(span.begin(), span.end(), std::byte{7});
  reservation->commit();
  auto bucket = next_bucket(subscriber, 1s);
  EXPECT_EQ(bucket.view()[1].bytes[0], std::byte{7});
  EXPECT_EQ(padding_of(bucket.view()), std::vector<std::byte>(496, std::byte{0}));
}

// A publish() that fails after its claim (a layout declared for in-place writing, which it
// cannot pack) leaves no word that the slot's padding was zeroed: the next reservation of that
// layout zeroes it.
TEST_F(Channel, AFailedPublishLeavesThePaddingToBeZeroed) {
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2, .tensor_bytes = 512}, 0).builder, 1s));
  next_bucket(subscriber, 1s).release();
  auto layout = cli::make_layout({.tensors = 2, .tensor_bytes = 8}, 1);  // padding: 8..255, 264..511
  expect_error(ErrorCode::InvalidArgument, [&] { publisher.publish(layout, 1s); });
  auto reservation = publisher.reserve(layout, 1s);
  ASSERT_TRUE(reservation.has_value());
  for (auto span : reservation->entry_spans()) std::fill(span.begin(), span.end(), std::byte{7});
  reservation->commit();
  auto bucket = next_bucket(subscriber, 1s);
  const auto* start = bucket.view()[0].bytes.data();
  for (std::size_t i = 8; i < 256; ++i) ASSERT_EQ(start[i], std::byte{0}) << "padding byte " << i;
}

// The same for a payload whose copies stream (detail::streaming_from()), its padding
// zeroed with streaming stores too: 896-byte entries leave 128 bytes after each.
TEST_F(Channel, StreamedReservationPaddingCarriesNoOlderBytes) {
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  auto count = static_cast<std::uint32_t>(detail::streaming_from() / 1024 + 1);
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = count, .tensor_bytes = 1024}, 0).builder, 1s));
  next_bucket(subscriber, 1s).release();
  Workload workload{.tensors = count, .tensor_bytes = 896};
  auto filled = cli::make_bucket(workload, 1);
  auto packed = filled.builder.pack();
  auto source = BucketView::open(packed.frame, packed.payload.span());
  auto reservation = publisher.reserve(cli::make_layout(workload, 1), 1s);
  ASSERT_TRUE(reservation.has_value());
  std::vector<const void*> sources;
  for (std::size_t t = 0; t < source.size(); ++t) sources.push_back(source[t].bytes.data());
  reservation->write_all(sources);
  reservation->commit();
  auto bucket = subscriber.next(1s);
  ASSERT_TRUE(bucket.has_value());
  EXPECT_EQ(cli::check_bucket(bucket->view(), workload.seed, 1), "");
  const auto* start = bucket->view()[0].bytes.data();
  for (std::size_t t = 0; t < count; ++t) {
    for (std::size_t i = 896; i < 1024; ++i) ASSERT_EQ(start[t * 1024 + i], std::byte{0}) << "entry " << t << " byte " << i;
  }
}

TEST_F(Channel, AbandonedReservationPublishesNothing) {
  Workload workload{.buckets = 2, .tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel);
  {
    auto reservation = publisher.reserve(cli::make_layout(workload, 0), 1s);
    ASSERT_TRUE(reservation.has_value());
  }
  EXPECT_EQ(publisher.published(), 0u);
  auto subscriber = Subscriber::attach(channel, 1s);
  EXPECT_FALSE(subscriber.try_next().has_value());
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  auto bucket = subscriber.next(1s);
  ASSERT_TRUE(bucket.has_value());
  EXPECT_EQ(cli::check_bucket(bucket->view(), workload.seed, 0), "");
}

// A reservation's handover starts at commit(), after the caller's own writing, unless commit()
// is told it stands for a publish() and began at reserve().
TEST_F(Channel, ReservationStampsItsHandoverWhereCommitSays) {
  auto now_ns = [] {
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    return static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000 + static_cast<std::uint64_t>(now.tv_nsec);
  };
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  for (auto from : {Reservation::HandoverFrom::Commit, Reservation::HandoverFrom::Reserve}) {
    auto before_reserve = now_ns();
    auto reservation = publisher.reserve(cli::make_layout(workload, 0), 1s);
    ASSERT_TRUE(reservation.has_value());
    auto reserved = now_ns();
    std::this_thread::sleep_for(2ms);  // the writing, as long as it takes
    for (std::uint32_t t = 0; t < workload.tensors; ++t) {
      cli::fill_tensor(reservation->entry_spans()[t], workload, 0, t);
    }
    auto before_commit = now_ns();
    reservation->commit(from);
    auto bucket = next_bucket(subscriber, 1s);
    EXPECT_EQ(cli::check_bucket(bucket.view(), workload.seed, 0), "");
    if (from == Reservation::HandoverFrom::Commit) {
      EXPECT_GE(bucket.publish_start_ns(), before_commit);
    } else {
      EXPECT_GE(bucket.publish_start_ns(), before_reserve);
      EXPECT_LE(bucket.publish_start_ns(), reserved);
    }
    EXPECT_LE(bucket.publish_start_ns(), bucket.published_ns());
  }
}

// monotonic_ns() is the clock a bucket's timestamps are on: a publish between two readings of it
// is stamped between them.
TEST_F(Channel, MonotonicNsIsTheClockOfTheTimestamps) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  auto bucket = make_bucket(workload, 0);
  auto before = monotonic_ns();
  ASSERT_TRUE(publisher.publish(bucket.builder, 1s));
  auto received = next_bucket(subscriber, 1s);
  auto after = monotonic_ns();
  EXPECT_LE(before, received.publish_start_ns());
  EXPECT_LE(received.publish_start_ns(), received.published_ns());
  EXPECT_LE(received.published_ns(), after);
}

// The producer rewrites only the bytes of a slot's manifest that changed: a layout of the
// same size with other names, then the first one again, each arrives as sent.
TEST_F(Channel, SlotManifestFollowsEveryLayoutChange) {
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  const float values[2] = {1.5f, -2.5f};
  auto layout = [&](const char* second, std::uint64_t version) {
    BucketBuilder builder;
    builder.version(version).add("a", DType::F32, Shape{2}, values).add(second, DType::F32, Shape{2}, values);
    return builder;
  };
  std::uint64_t version = 10;
  for (const char* second : {"b", "c", "b", "b"}) {
    ASSERT_TRUE(publisher.publish(layout(second, version), 1s));
    auto bucket = subscriber.next(1s);
    ASSERT_TRUE(bucket.has_value());
    EXPECT_EQ(bucket->view().version(), version);
    ASSERT_EQ(bucket->view().size(), 2u);
    EXPECT_EQ(bucket->view().manifest().entries[1].name, second) << "version " << version;
    EXPECT_TRUE(bucket->view().position(second).has_value());
    ++version;
  }
}

// A producer that makes a new builder every step: each takes over the last one's layout, and
// its encoding when it repeats it whole. Whatever it repeats or changes, each step arrives with
// its own names, shapes and bytes, through both slots.
TEST_F(Channel, NewBuildersOfRepeatedAndChangedLayoutsArriveAsSent) {
  auto publisher = Publisher::create(channel, {.slots = 2});
  auto subscriber = Subscriber::attach(channel, 1s);
  std::uint64_t version = 0;
  auto send = [&](const std::vector<std::int64_t>& lengths) {
    ++version;
    std::vector<std::vector<float>> tensors;
    BucketBuilder builder;
    builder.version(version);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      tensors.emplace_back(lengths[i], static_cast<float>(version * 100 + i));
      builder.add("layers." + std::to_string(i) + ".weight.of.a.model", DType::F32, {lengths[i]}, tensors[i].data());
    }
    ASSERT_TRUE(publisher.publish(builder, 1s));
    auto bucket = subscriber.next(1s);
    ASSERT_TRUE(bucket.has_value());
    const auto& view = bucket->view();
    EXPECT_EQ(view.version(), version);
    ASSERT_EQ(view.size(), lengths.size()) << "version " << version;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      auto entry = view[i];
      EXPECT_EQ(entry.name, "layers." + std::to_string(i) + ".weight.of.a.model");
      ASSERT_EQ(entry.shape.size(), 1u);
      EXPECT_EQ(entry.shape[0], lengths[i]) << "version " << version << " entry " << i;
      ASSERT_EQ(entry.bytes.size(), tensors[i].size() * sizeof(float));
      EXPECT_EQ(std::memcmp(entry.bytes.data(), tensors[i].data(), entry.bytes.size()), 0)
          << "version " << version << " entry " << i;
    }
  };
  const std::vector<std::int64_t> layout{3, 100, 7, 64};
  for (const auto& lengths : std::vector<std::vector<std::int64_t>>{
           layout, layout, layout, {3, 100, 8, 64}, layout, {3, 100}, layout, layout, {3, 100, 7, 64, 5}, layout}) {
    send(lengths);
  }
}

// A producer that keeps one builder (the Python module does) has the slot's manifest written in
// full only when the builder changed since that slot last held it; each step arrives as sent,
// through both slots and through a copy of the builder that changed apart.
TEST_F(Channel, SlotManifestFollowsChangesOfAKeptBuilder) {
  auto publisher = Publisher::create(channel, {.slots = 2});
  auto subscriber = Subscriber::attach(channel, 1s);
  const float values[2] = {1.5f, -2.5f};
  std::uint64_t version = 0;
  auto send = [&](BucketBuilder& layout, const std::vector<std::string>& names) {
    layout.version(++version);
    auto reservation = publisher.reserve(layout, 1s);
    ASSERT_TRUE(reservation.has_value());
    for (std::size_t i = 0; i < names.size(); ++i) reservation->write(i, values);
    reservation->commit();
    auto bucket = subscriber.next(1s);
    ASSERT_TRUE(bucket.has_value());
    EXPECT_EQ(bucket->view().version(), version);
    std::vector<std::string> received;
    for (const auto& entry : bucket->view().manifest().entries) received.push_back(entry.name);
    EXPECT_EQ(received, names) << "version " << version;
  };
  BucketBuilder kept;
  kept.declare("a", DType::F32, Shape{2});
  for (int step = 0; step < 3; ++step) send(kept, {"a"});  // slots 0, 1, 0
  kept.declare("b", DType::F32, Shape{2});
  send(kept, {"a", "b"});  // slot 1
  send(kept, {"a", "b"});  // slot 0
  auto copy = kept;
  copy.declare("c", DType::F32, Shape{2});
  send(copy, {"a", "b", "c"});  // slot 1
  send(kept, {"a", "b"});       // slot 0, which holds it
  send(copy, {"a", "b", "c"});  // slot 1, which holds it
  send(copy, {"a", "b", "c"});  // slot 0, which holds the kept builder's
  send(kept, {"a", "b"});       // slot 1, which holds the copy's
}

TEST_F(Channel, SlotsGrowForLargerBuckets) {
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  for (std::uint64_t bytes : {64ull, 1ull << 20, 256ull, 3ull << 20}) {
    Workload workload{.tensors = 3, .tensor_bytes = bytes};
    ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
    auto bucket = subscriber.next(1s);
    ASSERT_TRUE(bucket.has_value());
    EXPECT_EQ(cli::check_bucket(bucket->view(), workload.seed, 0), "") << bytes;
  }
}

// Before, the slot's segment was created sparse and the reservation succeeded; writing it
// would have ended in SIGBUS or the OOM killer, leaving /dev/shm full.
TEST_F(Channel, RefusesBucketLargerThanSharedMemory) {
  struct statvfs filesystem {};
  ASSERT_EQ(::statvfs("/dev/shm", &filesystem), 0);
  std::int64_t too_large = static_cast<std::int64_t>(filesystem.f_blocks * filesystem.f_frsize) + (1 << 30);
  BucketBuilder layout;
  layout.declare("huge", DType::U8, Shape{too_large});
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  auto error = expect_error(ErrorCode::SystemError, [&] { publisher.reserve(layout, 1s); });
  EXPECT_NE(error.find(channel + ".slot0"), std::string::npos) << error;
  EXPECT_NE(error.find("free"), std::string::npos) << error;
  EXPECT_EQ(segments_of(channel), std::vector<std::string>{"tensorbucket." + channel});
  EXPECT_EQ(publisher.published(), 0u);
  EXPECT_FALSE(subscriber.try_next().has_value());

  Workload workload{.tensors = 2, .tensor_bytes = 64};
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  auto bucket = subscriber.next(1s);
  ASSERT_TRUE(bucket.has_value());
  EXPECT_EQ(cli::check_bucket(bucket->view(), workload.seed, 0), "");
}

// Runs `body` in a child process that sees its own /dev/shm, a tmpfs mounted with `options`;
// skips the test where mounting one is not allowed (it needs root).
void with_private_shm(const char* options, const std::function<int()>& body) {
  constexpr int kNotAllowed = 77;
  Child child([&] {
    if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", "/dev/shm", "tmpfs", 0, options) != 0) {
      return kNotAllowed;
    }
    return body();
  });
  int status = child.wait();
  if (status == kNotAllowed) GTEST_SKIP() << "mounting a private /dev/shm needs root";
  EXPECT_EQ(status, 0) << "(a negative status is the signal that killed the child)";
}

// Docker gives a container 64 MiB of /dev/shm unless told otherwise. Before, the second slot's
// segment was created sparse, and writing the bucket into it killed the producer with SIGBUS.
TEST_F(Channel, SlotThatDoesNotFitInSharedMemoryIsAnError) {
  with_private_shm("size=1m", [&] {
    Workload workload{.tensors = 2, .tensor_bytes = 300 << 10};
    auto publisher = Publisher::create(channel, {.slots = 2, .min_consumers = 0});
    if (!publisher.publish(cli::make_bucket(workload, 0).builder, 1s)) return 2;
    try {
      publisher.publish(cli::make_bucket(workload, 1).builder, 1s);
    } catch (const Error& e) {
      bool named = std::string(e.what()).find("free") != std::string::npos;
      return e.code() == ErrorCode::SystemError && named && publisher.published() == 1 ? 0 : 3;
    }
    return 4;
  });
}

// A tmpfs mounted with size=0 has no limit, and reports no blocks at all.
TEST_F(Channel, SharedMemoryWithoutSizeLimitTakesBuckets) {
  with_private_shm("size=0", [&] {
    Workload workload{.tensors = 2, .tensor_bytes = 64};
    auto publisher = Publisher::create(channel);
    auto subscriber = Subscriber::attach(channel, 1s);
    if (!publisher.publish(cli::make_bucket(workload, 0).builder, 1s)) return 2;
    auto bucket = subscriber.next(1s);
    return bucket && cli::check_bucket(bucket->view(), workload.seed, 0).empty() ? 0 : 3;
  });
}

TEST_F(Channel, ViewsAreSharedMemoryAndHoldTheirSlot) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 1});
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  auto bucket = subscriber.next(1s);
  ASSERT_TRUE(bucket.has_value());
  // Zero-copy: a write into the segment shows through the view.
  test::Tampering segment(test::slot_name(channel, 0));
  ASSERT_TRUE(segment.mapped());
  segment.bytes()[0] = ~bucket->view()[0].bytes[0];
  EXPECT_EQ(bucket->view()[0].bytes[0], segment.bytes()[0]);
  // Held: the only slot cannot be reused until the bucket is released.
  EXPECT_FALSE(publisher.publish(cli::make_bucket(workload, 1).builder, 30ms));
  bucket->release();
  EXPECT_TRUE(publisher.publish(cli::make_bucket(workload, 1).builder, 1s));
}

TEST_F(Channel, FlippedPayloadByteIsRejectedWithChecksumMismatch) {
  Workload workload{.buckets = 2, .tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.payload_checksum = true});
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  test::Tampering segment(test::slot_name(channel, 0));
  ASSERT_TRUE(segment.mapped());
  segment.bytes()[3] ^= std::byte{0x40};
  expect_error(ErrorCode::ChecksumMismatch, [&] { subscriber.next(1s); });
  // The bad bucket is skipped and released; the channel goes on.
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 1).builder, 1s));
  auto bucket = subscriber.next(1s);
  ASSERT_TRUE(bucket.has_value());
  EXPECT_EQ(bucket->sequence(), 1u);
}

TEST_F(Channel, FlippedManifestByteIsRejectedWithChecksumMismatch) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.payload_checksum = true});
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  test::Tampering segment(test::slot_name(channel, 0));
  ASSERT_TRUE(segment.mapped());
  // The frame follows the payload's page; byte 70 is inside the manifest.
  segment.bytes()[4096 + sizeof(BucketHeader) + 6] ^= std::byte{0x01};
  expect_error(ErrorCode::ChecksumMismatch, [&] { subscriber.next(1s); });
}

// A child forked from a producer or consumer inherits its handles. Before, the child's exit
// (which may destroy them) took the channel down and dropped the parent's leases.
TEST_F(Channel, ForkedChildCannotUseOrTakeDownItsParentsHandles) {
  Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = std::make_optional(Publisher::create(channel, {.slots = 1}));
  auto subscriber = std::make_optional(Subscriber::attach(channel, 1s));
  ASSERT_TRUE(publisher->publish(cli::make_bucket(workload, 0).builder, 1s));
  auto bucket = subscriber->next(1s);
  ASSERT_TRUE(bucket.has_value());
  Child child([&] {
    int refused = 0;
    try {
      publisher->publish(cli::make_bucket(workload, 1).builder, 0ms);
    } catch (const Error& e) {
      refused += e.code() == ErrorCode::InvalidArgument;
    }
    try {
      subscriber->next(0ms);
    } catch (const Error& e) {
      refused += e.code() == ErrorCode::InvalidArgument;
    }
    bucket.reset();
    subscriber.reset();
    publisher.reset();
    return refused == 2 ? 0 : 1;
  });
  ASSERT_EQ(child.wait(), 0);
  // The parent's lease still holds the only slot, and its channel and record are still there.
  EXPECT_FALSE(publisher->publish(cli::make_bucket(workload, 1).builder, 50ms));
  bucket.reset();
  // A reservation taken before the fork: the child's writes and commit are refused, and the
  // parent publishes what it wrote.
  auto filled = cli::make_bucket(workload, 1);
  auto source = filled.builder.pack();
  auto view = BucketView::open(source.frame, source.payload.span());
  auto reservation = publisher->reserve(cli::make_layout(workload, 1), 1s);
  ASSERT_TRUE(reservation.has_value());
  Child writer([&] {
    int refused = 0;
    const std::vector<std::byte> garbage(workload.tensor_bytes, std::byte{0xAB});
    for (auto call : {std::function<void()>([&] { reservation->write(0, garbage.data()); }),
                      std::function<void()>([&] { reservation->commit(); })}) {
      try {
        call();
      } catch (const Error& e) {
        refused += e.code() == ErrorCode::InvalidArgument;
      }
    }
    return refused == 2 ? 0 : 1;
  });
  ASSERT_EQ(writer.wait(), 0);
  for (std::size_t t = 0; t < view.size(); ++t) reservation->write(t, view[t].bytes.data());
  reservation->commit();
  auto next = subscriber->next(1s);
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->sequence(), 1u);
  EXPECT_EQ(cli::check_bucket(next->view(), workload.seed, 1), "");
  EXPECT_NO_THROW(Subscriber::attach(channel, 0ms));
}

TEST_F(Channel, KilledProducerLeavesConsumersWithProducerGone) {
  std::mt19937_64 rng(test::fuzz_seed(5));
  Workload workload{.buckets = 1u << 30, .tensors = 4, .tensor_bytes = 4096};
  for (int run = 0; run < 12; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    auto run_channel = channel + "-" + std::to_string(run);
    Child producer([&] {
      auto publisher = Publisher::create(run_channel, {.slots = 1 + static_cast<std::uint32_t>(run % 3)});
      for (std::uint64_t i = 0;; ++i) {
        if (!publisher.publish(cli::make_bucket(workload, i).builder, 10s)) return 3;
      }
    });
    auto subscriber = Subscriber::attach(run_channel, 10s);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    producer.kill_now();
    auto published = inspect_channel(run_channel).published;
    std::uint64_t received = 0;
    expect_error(ErrorCode::ProducerGone, [&] {
      while (auto bucket = subscriber.next(5s)) {
        ASSERT_EQ(bucket->sequence(), received);
        ASSERT_EQ(cli::check_bucket(bucket->view(), workload.seed, received), "");
        ++received;
      }
    });
    // Every bucket the dead producer published, and nothing else.
    EXPECT_EQ(received, published);
    // The next producer of that name removes what the dead one left.
    Publisher::create(run_channel).close();
    EXPECT_EQ(segments_of(run_channel), std::vector<std::string>{});
  }
}

TEST_F(Channel, KilledConsumerHoldingALeaseDoesNotStopTheProducer) {
  Workload workload{.buckets = 20, .tensors = 2, .tensor_bytes = 256};
  auto publisher = Publisher::create(channel, {.slots = 2});
  test::Signal holding;
  Child holder([&] { return test::hold_a_bucket(channel, holding); });
  Child steady([&] { return consume(channel, workload, workload.buckets); });
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 10s));
  ASSERT_TRUE(holding.receive());
  holder.kill_now();
  for (std::uint64_t i = 1; i < workload.buckets; ++i) {
    ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, i).builder, 10s)) << "bucket " << i;
  }
  EXPECT_EQ(steady.wait(), 0);
}

TEST_F(Channel, LiveProducerKeepsItsName) {
  auto publisher = Publisher::create(channel);
  expect_error(ErrorCode::ChannelExists, [&] { Publisher::create(channel); });
}

TEST_F(Channel, MissingChannelTimesOut) {
  auto message = expect_error(ErrorCode::ChannelMissing, [&] { Subscriber::attach(channel, 20ms); });
  EXPECT_NE(message.find(channel), std::string::npos) << message;
}

// What a producer's control segment looks like between its shm_open and its ftruncate: no
// channel yet, for inspect as for attach. Before, inspect failed with SystemError.
TEST_F(Channel, ControlSegmentNotYetSizedIsNoChannelYet) {
  auto path = "/dev/shm/tensorbucket." + channel;
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ::close(fd);
  auto message = expect_error(ErrorCode::ChannelMissing, [&] { inspect_channel(channel); });
  EXPECT_NE(message.find("does not exist (yet)"), std::string::npos) << message;
  expect_error(ErrorCode::ChannelMissing, [&] { Subscriber::attach(channel, 20ms); });
  ::unlink(path.c_str());
}

TEST_F(Channel, RefusesBadNames) {
  for (std::string name : std::vector<std::string>{"", ".hidden", "a/b", "space here",
                                                  std::string(65, 'x'), "ünï"}) {
    expect_error(ErrorCode::InvalidArgument, [&] { Publisher::create(name); });
    expect_error(ErrorCode::InvalidArgument, [&] { Subscriber::attach(name, 0ms); });
  }
}

// A name that ends like a slot's segment would be taken for one of another channel's: a
// "dead leftover" removed from under a live producer.
TEST_F(Channel, RefusesNamesThatNameAnotherChannelsSlot) {
  auto publisher = Publisher::create(channel);
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 1}, 0).builder, 1s));
  auto slot = channel + ".slot0.1";
  expect_error(ErrorCode::InvalidArgument, [&] { Publisher::create(slot); });
  expect_error(ErrorCode::InvalidArgument, [&] { remove_channel(slot); });
  EXPECT_EQ(segments_of(channel).size(), 2u);
  auto listed = list_channels();
  EXPECT_NE(std::find(listed.begin(), listed.end(), channel), listed.end());
  EXPECT_EQ(std::find(listed.begin(), listed.end(), slot), listed.end());
}

TEST_F(Channel, SegmentsGetTheRequestedMode) {
  auto publisher = Publisher::create(channel, {.mode = 0640});
  struct stat status {};
  ASSERT_EQ(::stat(("/dev/shm/tensorbucket." + channel).c_str(), &status), 0);
  EXPECT_EQ(status.st_mode & 0777, 0640u);
  expect_error(ErrorCode::InvalidArgument, [&] { Publisher::create(channel + "x", {.mode = 0400}); });
}

TEST_F(Channel, RefusesChannelOwnedByAnotherUser) {
  auto publisher = Publisher::create(channel);
  auto path = "/dev/shm/tensorbucket." + channel;
  if (::chown(path.c_str(), 12345, 12345) != 0) GTEST_SKIP() << "needs root to change the owner";
  expect_error(ErrorCode::PermissionDenied, [&] { Subscriber::attach(channel, 100ms); });
}

// A leftover in the way of a slot's name that another user owns is theirs: a producer running
// as root, whom the sticky /dev/shm would let unlink it, refuses and leaves it there.
TEST_F(Channel, AnotherUsersObjectInTheWayOfASlotIsLeftAlone) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: only root could remove another user's object";
  std::string name;
  {
    auto publisher = Publisher::create(channel);
    name = "/" + ipc::slot_segment_name(channel, 0, ipc::epoch_base(publisher.incarnation()) + 1);
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fchown(fd, 65534, 65534), 0);
    ::close(fd);
    auto message = expect_error(ErrorCode::PermissionDenied, [&] {
      publisher.publish(cli::make_bucket({.tensors = 2, .tensor_bytes = 64}, 0).builder, 1s);
    });
    EXPECT_NE(message.find("belongs to uid 65534"), std::string::npos) << message;
  }
  struct stat status {};
  ASSERT_EQ(::stat(("/dev/shm" + name).c_str(), &status), 0);
  EXPECT_EQ(status.st_uid, 65534u);
  ::shm_unlink(name.c_str());
}

// After `tbucket rm --force` the control segment's name may be another producer's, so close()
// leaves it alone; a slot grown since is this producer's alone, and close() used to leave it in
// /dev/shm for good.
TEST_F(Channel, CloseRemovesASlotGrownAfterAForcedRemoval) {
  auto publisher = Publisher::create(channel, {.min_consumers = 0});
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 1, .tensor_bytes = 64}, 0).builder, 1s));
  remove_channel(channel, true);
  EXPECT_EQ(segments_of(channel), std::vector<std::string>{});
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 4, .tensor_bytes = 1 << 20}, 1).builder, 1s));
  EXPECT_EQ(segments_of(channel).size(), 1u);  // slot 0's new epoch
  publisher.close();
  EXPECT_EQ(segments_of(channel), std::vector<std::string>{});
}

TEST_F(Channel, ConsumerSeesProducerGoneAfterCleanClose) {
  Workload workload{.buckets = 2, .tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel);
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  auto bucket = subscriber.next(1s);
  ASSERT_TRUE(bucket.has_value());
  bucket->release();
  ASSERT_TRUE(publisher.drain(1s));
  publisher.close();
  expect_error(ErrorCode::ProducerGone, [&] { subscriber.next(1s); });
}

TEST_F(Channel, TooManyConsumersIsChannelFull) {
  auto publisher = Publisher::create(channel, {.max_consumers = 1, .min_consumers = 1});
  auto first = Subscriber::attach(channel, 1s);
  expect_error(ErrorCode::ChannelFull, [&] { Subscriber::attach(channel, 1s); });
}

}  // namespace
}  // namespace tensorbucket
