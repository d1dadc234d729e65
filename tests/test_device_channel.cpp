// The device path of a channel (a CUDA payload location) against the host stand-in of the
// CUDA driver (device_standin.hpp): handles exported once and imported once per epoch, the
// device chosen by UUID, events plumbed through the control block both ways, errors, and
// consumers refused for the wrong location. Runs without a GPU; tests/test_cuda.cpp and
// scripts/gpu-check run the same path on one.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "channel_support.hpp"
#include "device_standin.hpp"
#include "ipc/slot_storage.hpp"
#include "serialize/block_hash.hpp"
#include "support.hpp"

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;
using cli::Workload;
using test::Child;
using test::expect_error;
using test::next_bucket;
using test::segments_of;
using test::StandIn;

class DeviceChannel : public test::ChannelTest {
 protected:
  test::StandInScope stand_in;
  PublisherOptions on_device(std::uint32_t ordinal = 0) {
    PublisherOptions options;
    options.location = PayloadLocation::cuda(static_cast<int>(ordinal));
    return options;
  }
};

bool contains(const std::vector<std::uint64_t>& ids, std::uint64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

// The public device copy (what the torch bridge loads a device bucket with): one batch on the
// stream, each byte where it was asked and none elsewhere; a failed call is named.
TEST_F(DeviceChannel, CopyOnDeviceQueuesOneBatchOfEveryCopy) {
  std::vector<std::byte> from(300), to(300, std::byte{0});
  for (std::size_t i = 0; i < from.size(); ++i) from[i] = static_cast<std::byte>(i + 1);
  std::vector<CudaCopy> copies{{to.data(), from.data(), 100}, {to.data() + 200, from.data() + 100, 100}};
  copy_on_device(0, copies, nullptr);
  EXPECT_EQ(StandIn::copy_calls, 1);
  EXPECT_EQ(StandIn::copies, 2);
  EXPECT_EQ(std::memcmp(to.data(), from.data(), 100), 0);
  EXPECT_TRUE(std::all_of(to.begin() + 100, to.begin() + 200, [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_EQ(std::memcmp(to.data() + 200, from.data() + 100, 100), 0);
  StandIn::fail_next = "copy";
  auto message = expect_error(ErrorCode::CudaFailed, [&] { copy_on_device(0, std::span(copies).first(1), nullptr); });
  EXPECT_NE(message.find("cuMemcpyAsync"), std::string::npos) << message;
}

TEST_F(DeviceChannel, ForkedConsumerReceivesEveryByteOfEveryBucket) {
  Workload workload{.buckets = 60, .tensors = 12, .tensor_bytes = 3000};
  auto publisher = Publisher::create(channel, on_device());
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 10s, {.expected_location = PayloadLocation::Kind::Cuda});
    for (std::uint64_t i = 0; i < workload.buckets; ++i) {
      auto bucket = subscriber.next(10s);
      if (!bucket || bucket->sequence() != i) return 3;
      if (bucket->view().location() != PayloadLocation::cuda(0)) return 4;
      if (!cli::check_bucket(bucket->view(), workload.seed, i).empty()) return 5;
    }
    // Two slots, one epoch each: each imported once, whatever the bucket count.
    return StandIn::memory_imports == 2 ? 0 : 6;
  });
  for (std::uint64_t i = 0; i < workload.buckets; ++i) {
    auto bucket = cli::make_bucket(workload, i);
    ASSERT_TRUE(publisher.publish(bucket.builder, 10s));
  }
  EXPECT_EQ(consumer.wait(), 0);
  // One batched copy per bucket, not one per tensor.
  EXPECT_EQ(StandIn::copy_calls, static_cast<int>(workload.buckets));
  EXPECT_EQ(StandIn::copies, static_cast<int>(workload.buckets * workload.tensors));
}

// Whole updates on a device channel, under both policies: a forked consumer holds each update
// (every bucket's slot imported and ready on its stream) and releases it on a stream.
TEST_F(DeviceChannel, WholeUpdatesTravelUnderBothPolicies) {
  for (auto policy : {OverflowPolicy::Block, OverflowPolicy::Latest}) {
    SCOPED_TRACE(std::string(to_string(policy)));
    auto run_channel = channel + "-" + std::string(to_string(policy));
    Workload workload{.tensors = 4, .tensor_bytes = 512, .update_buckets = 3};
    auto options = on_device();
    options.slots = 6;
    options.max_consumers = 1;
    options.policy = policy;
    options.update_buckets = 3;
    auto publisher = Publisher::create(run_channel, options);
    test::Signal ready;
    Child consumer([&] {
      auto subscriber = Subscriber::attach(run_channel, 10s, {.expected_location = PayloadLocation::Kind::Cuda});
      ready.send();
      std::optional<std::uint64_t> last;
      for (;;) {
        std::optional<ReceivedUpdate> update;
        try {
          update = subscriber.next_update(10s);
        } catch (const Error& e) {
          if (e.code() == ErrorCode::ProducerGone) return last == 9u ? 0 : 7;
          throw;
        }
        if (!update || update->buckets().size() != 3) return 3;
        if (last && update->version() <= *last) return 4;
        for (const auto& bucket : update->buckets()) {
          if (bucket.view().location() != PayloadLocation::cuda(0)) return 5;
          auto index = update->version() * 3 + bucket.view().bucket_index();
          if (!cli::check_bucket(bucket.view(), workload.seed, index, bucket.copy_to_host()).empty()) return 6;
        }
        last = update->version();
        update->release(reinterpret_cast<CudaStream>(0x5));
      }
    });
    ASSERT_TRUE(ready.receive());
    for (std::uint64_t i = 0; i < 30; ++i) {
      ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, i).builder, 10s)) << publisher.waiting_for();
    }
    ASSERT_TRUE(publisher.drain(10s));
    publisher.close();
    EXPECT_EQ(consumer.wait(), 0);
  }
}

// tests/test_cuda_channel.cpp's case of the same name, on the stand-in: every side a forked
// process, consumers that say when they attached, one of them killed while it holds a bucket.
// The producer creates the channel before it waits for them: they attach to a live producer
// only.
TEST_F(DeviceChannel, AConsumerKilledHoldingABucketDoesNotStallTheProducer) {
  Workload workload{.buckets = 60, .tensors = 4, .tensor_bytes = 4096};
  test::Signal attached, holding;
  Child survivor([&] {
    auto subscriber = Subscriber::attach(channel, 10s, {.expected_location = PayloadLocation::Kind::Cuda});
    attached.send();
    for (std::uint64_t i = 0; i < workload.buckets; ++i) {
      auto bucket = subscriber.next(10s);
      if (!bucket || !cli::check_bucket(bucket->view(), workload.seed, i).empty()) return 3;
    }
    return 0;
  });
  Child doomed([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    attached.send();
    auto bucket = subscriber.next(10s);
    holding.send();
    ::pause();  // holding its lease until killed
    return bucket ? 0 : 1;
  });
  Child producer([&] {
    // The channel first: an attach waits for a live producer.
    auto publisher = Publisher::create(channel, on_device());
    for (int i = 0; i < 2; ++i) {
      if (attached.receive(10s) == 0) return 40;
    }
    for (std::uint64_t i = 0; i < workload.buckets; ++i) {
      if (!publisher.publish(cli::make_bucket(workload, i).builder, 10s)) return 41;
    }
    return publisher.drain(10s) ? 0 : 42;
  });
  ASSERT_NE(holding.receive(20s), 0);
  doomed.kill_now();
  EXPECT_EQ(producer.wait(), 0);
  EXPECT_EQ(survivor.wait(), 0);
}

TEST_F(DeviceChannel, SlotsAreImportedOncePerEpochAndClosedWhenReplaced) {
  auto publisher = Publisher::create(channel, on_device());
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    for (std::uint64_t i = 0; i < 10; ++i) {
      if (!cli::check_bucket(next_bucket(subscriber).view(), 1, i).empty()) return 3;
    }
    if (StandIn::memory_imports != 2 || ipc::open_device_imports() != 2) return 4;
    // Bucket 10 does not fit: its slot's new epoch is new memory, imported once more, and the
    // import it replaced is closed, nothing holding it.
    if (!cli::check_bucket(next_bucket(subscriber).view(), 1, 10).empty()) return 5;
    if (StandIn::memory_imports != 3 || StandIn::memory_closes != 1 || ipc::open_device_imports() != 2) return 6;
    return 0;
  });
  for (std::uint64_t i = 0; i < 10; ++i) {
    ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 4, .tensor_bytes = 1024}, i).builder, 10s));
  }
  // A device payload is whole 2 MiB pages of its own, however small the bucket.
  EXPECT_EQ(inspect_channel(channel).slot_states[0].payload_capacity, 2u << 20);
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 4, .tensor_bytes = 1 << 20}, 10).builder, 10s));
  EXPECT_EQ(consumer.wait(), 0);
  auto grown = inspect_channel(channel).slot_states[0];
  EXPECT_EQ(grown.epoch, 2u);
  EXPECT_EQ(grown.payload_capacity % (2u << 20), 0u);
  EXPECT_GE(grown.payload_capacity, 4u << 20);
}

TEST_F(DeviceChannel, AnEmptyFirstBucketGetsADevicePageAndTravels) {
  auto publisher = Publisher::create(channel, on_device());
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    if (next_bucket(subscriber).view().size() != 0) return 3;
    return cli::check_bucket(next_bucket(subscriber).view(), 1, 1).empty() ? 0 : 4;
  });
  // cuMemAlloc refuses 0 bytes: the empty bucket's slot is still one whole device page.
  ASSERT_TRUE(publisher.publish(BucketBuilder{}, 10s));
  EXPECT_EQ(inspect_channel(channel).slot_states[0].payload_capacity, 2u << 20);
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, 1).builder, 10s));
  EXPECT_EQ(consumer.wait(), 0);
}

TEST_F(DeviceChannel, SubscribersOfOneProducerInOneProcessShareTheImports) {
  auto publisher = Publisher::create(channel, {.min_consumers = 2, .location = PayloadLocation::cuda(0)});
  Child consumers([&] {
    auto first = Subscriber::attach(channel, 10s);
    auto second = Subscriber::attach(channel, 10s);
    auto a = next_bucket(first);
    auto b = next_bucket(second);
    if (a.view()[0].bytes.data() != b.view()[0].bytes.data()) return 3;
    return StandIn::memory_imports == 1 ? 0 : 4;
  });
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, 0).builder, 10s));
  EXPECT_EQ(consumers.wait(), 0);
}

TEST_F(DeviceChannel, ANewProducerIsImportedAfresh) {
  test::Signal next_round;
  Child consumer([&] {
    for (int round = 0; round < 2; ++round) {
      if (next_round.receive() == 0) return 3;
      auto subscriber = Subscriber::attach(channel, 10s);
      if (!cli::check_bucket(next_bucket(subscriber).view(), 1, 0).empty()) return 4;
    }
    // Each producer's memory imported once, and closed with the last subscriber of it.
    return StandIn::memory_imports == 2 && StandIn::memory_closes == 2 ? 0 : 5;
  });
  auto bucket = cli::make_bucket({.tensors = 2}, 0);
  for (int round = 0; round < 2; ++round) {
    auto publisher = Publisher::create(channel, on_device());
    next_round.send();
    ASSERT_TRUE(publisher.publish(bucket.builder, 10s));
    ASSERT_TRUE(publisher.drain(10s));
  }
  EXPECT_EQ(consumer.wait(), 0);
}

TEST_F(DeviceChannel, AConsumerInTheProducersProcessUsesItsMemoryAndEvents) {
  // The driver imports nothing a process exported itself: the consumer takes the producer's
  // own memory and events, and the producer the consumer's.
  auto publisher = Publisher::create(channel, on_device());
  auto subscriber = Subscriber::attach(channel, 1s);
  for (std::uint64_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 3}, i).builder, 1s));
    EXPECT_TRUE(cli::check_bucket(next_bucket(subscriber).view(), 1, i).empty());
  }
  EXPECT_EQ(StandIn::memory_imports, 0);
  EXPECT_EQ(StandIn::event_imports, 0);
  EXPECT_EQ(ipc::open_device_imports(), 2u);
  test::Tampering control(test::control_name(channel));
  auto release = StandIn::event_id(control.control().release_events[0].slots[0]);
  EXPECT_TRUE(contains(StandIn::waited(), release));
}

TEST_F(DeviceChannel, ConsumerStreamWaitsOnTheReadyEventTheProducerRecorded) {
  auto publisher = Publisher::create(channel, on_device());
  auto subscriber = Subscriber::attach(channel, 1s);
  auto bucket = cli::make_bucket({.tensors = 2}, 0);
  ASSERT_TRUE(publisher.publish(bucket.builder, 1s));
  test::Tampering control(test::control_name(channel));
  auto ready = StandIn::event_id(control.control().device_slots[0].ready_event);
  ASSERT_NE(ready, 0u);
  // Recorded after the bucket's copy (itself after the wait on the consumer's release event),
  // before it was published.
  auto operations = StandIn::operations();
  ASSERT_EQ(operations.size(), 3u);
  EXPECT_EQ(operations[0].kind, 'w');
  EXPECT_EQ(operations[1].kind, 'c');
  EXPECT_EQ(operations[2].kind, 'r');
  EXPECT_EQ(operations[2].value, ready);
  auto received = next_bucket(subscriber);
  EXPECT_TRUE(contains(StandIn::waited(), ready));
}

TEST_F(DeviceChannel, ProducerWaitsOnTheConsumersReleaseEventBeforeRewritingTheSlot) {
  auto publisher = Publisher::create(channel, on_device());
  publisher.publish(cli::make_bucket({.tensors = 2}, 0).builder, 1s);
  auto subscriber = Subscriber::attach(channel, 1s);
  test::Tampering control(test::control_name(channel));
  auto release = StandIn::event_id(control.control().release_events[0].slots[0]);
  ASSERT_NE(release, 0u);
  next_bucket(subscriber).release();
  EXPECT_TRUE(contains(StandIn::recorded(), release));
  EXPECT_FALSE(contains(StandIn::waited(), release));
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, 1).builder, 1s));  // slot 1
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, 2).builder, 1s));  // slot 0 again
  // In stream order: the release recorded, then waited on, then bucket 2 copied over it.
  auto operations = StandIn::operations();
  auto at = [&](char kind, std::uint64_t value, std::size_t from) {
    for (auto i = from; i < operations.size(); ++i) {
      if (operations[i].kind == kind && (kind == 'c' || operations[i].value == value)) return i;
    }
    return operations.size();
  };
  auto recorded = at('r', release, 0);
  auto waited = at('w', release, recorded);
  ASSERT_LT(waited, operations.size());
  EXPECT_LT(at('c', 0, waited), operations.size());
  EXPECT_EQ(at('c', 0, at('c', 0, 0) + 1), at('c', 0, recorded));  // bucket 1's copy came between
}

TEST_F(DeviceChannel, ADetachingConsumerWaitsForItsReleasesBeforeItFreesItsRecord) {
  auto publisher = Publisher::create(channel, on_device());
  test::Tampering control(test::control_name(channel));
  auto& claim = control.control().consumers[0].claim;
  int waits_while_claimed = 0, waits_after = 0;
  StandIn::on_event_wait = [&] { (ipc::claim_token(ipc::atomic(claim).load()) != 0 ? waits_while_claimed : waits_after)++; };
  {
    auto subscriber = Subscriber::attach(channel, 1s);
    ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, 0).builder, 1s));
    next_bucket(subscriber).release();
  }
  // One wait per slot's release event, all while the producer could still see the record and
  // wait on its events itself.
  EXPECT_EQ(waits_while_claimed, 2);
  EXPECT_EQ(waits_after, 0);
  EXPECT_EQ(ipc::claim_token(ipc::atomic(claim).load()), 0u);
}

TEST_F(DeviceChannel, ConsumerMapsTheDeviceByUuidToItsOwnOrdinal) {
  // The producer uses its device 1; the consumer sees only that device, as its device 0.
  auto publisher = Publisher::create(channel, on_device(1));
  auto bucket = cli::make_bucket({.tensors = 3}, 0);
  ASSERT_TRUE(publisher.publish(bucket.builder, 1s));
  Child consumer([&] {
    StandIn::devices = {StandIn::devices[1]};
    auto subscriber = Subscriber::attach(channel, 10s);
    if (subscriber.location() != PayloadLocation::cuda(0)) return 3;
    auto received = subscriber.next(10s);
    if (!received || received->view().location() != PayloadLocation::cuda(0)) return 4;
    return cli::check_bucket(received->view(), 1, 0).empty() ? 0 : 5;
  });
  EXPECT_EQ(consumer.wait(), 0);
  EXPECT_EQ(inspect_channel(channel).location, "cuda GPU-22222222-0202-0202-0202-020202020202");
}

TEST_F(DeviceChannel, ConsumerWithoutTheDeviceIsToldItIsNotVisible) {
  auto publisher = Publisher::create(channel, on_device(1));
  Child consumer([&] {
    StandIn::devices = {StandIn::devices[0]};
    try {
      Subscriber::attach(channel, 10s);
    } catch (const Error& e) {
      return e.code() == ErrorCode::DeviceNotVisible &&
                     std::string(e.what()).find("GPU-22222222") != std::string::npos
                 ? 0
                 : 3;
    }
    return 4;
  });
  EXPECT_EQ(consumer.wait(), 0);
}

TEST_F(DeviceChannel, ConsumersAskingForAnotherLocationAreRefused) {
  auto device = Publisher::create(channel, on_device());
  auto message = expect_error(ErrorCode::LocationMismatch,
                              [&] { Subscriber::attach(channel, 1s, {.expected_location = PayloadLocation::Kind::Host}); });
  EXPECT_NE(message.find("on a CUDA device, not in host memory"), std::string::npos) << message;
  device.close();
  auto host = Publisher::create(channel);
  expect_error(ErrorCode::LocationMismatch, [&] { Subscriber::attach(channel, 1s, {.expected_location = PayloadLocation::Kind::Cuda}); });
  // Refused before claiming: every record is still free.
  EXPECT_TRUE(inspect_channel(channel).consumers.empty());
}

TEST_F(DeviceChannel, ProducerOnADeviceItCannotSeeCreatesNothing) {
  auto message = expect_error(ErrorCode::DeviceNotVisible, [&] { Publisher::create(channel, on_device(7)); });
  EXPECT_NE(message.find("CUDA device 7"), std::string::npos) << message;
  EXPECT_EQ(segments_of(channel), std::vector<std::string>{});
}

TEST_F(DeviceChannel, ProducerOnANegativeOrdinalCreatesNothing) {
  auto message = expect_error(ErrorCode::InvalidArgument, [&] {
    Publisher::create(channel, {.location = PayloadLocation::cuda(-1)});
  });
  EXPECT_NE(message.find("CUDA device -1 is not a device ordinal"), std::string::npos) << message;
  EXPECT_EQ(segments_of(channel), std::vector<std::string>{});
}

TEST_F(DeviceChannel, FailedDriverCallsNameTheCallPublishNothingAndLeaveTheSlotUsable) {
  auto publisher = Publisher::create(channel, {.slots = 1, .location = PayloadLocation::cuda(0)});
  auto subscriber = Subscriber::attach(channel, 1s);
  auto bucket = cli::make_bucket({.tensors = 2}, 0);
  for (const char* call : {"copy", "record_event"}) {
    StandIn::fail_next = call;
    auto message = expect_error(ErrorCode::CudaFailed, [&] { publisher.publish(bucket.builder, 1s); });
    EXPECT_NE(message.find("failed in the host stand-in: STANDIN_INJECTED_ERROR"), std::string::npos) << message;
    EXPECT_EQ(publisher.published(), 0u);
    EXPECT_FALSE(subscriber.try_next().has_value());
  }
  // The one slot was left empty, not stuck half-written: the next publish goes through.
  ASSERT_TRUE(publisher.publish(bucket.builder, 1s));
  EXPECT_TRUE(cli::check_bucket(next_bucket(subscriber).view(), 1, 0).empty());
}

TEST_F(DeviceChannel, AFailedImportIsAnErrorForThatBucketAlone) {
  auto publisher = Publisher::create(channel, on_device());
  Child consumer([&] {
    auto subscriber = Subscriber::attach(channel, 10s);
    StandIn::fail_next = "import_memory";
    try {
      subscriber.next(10s);
      return 3;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::CudaFailed || std::string(e.what()).find("cuIpcOpenMemHandle") == std::string::npos) {
        return 4;
      }
    }
    return next_bucket(subscriber).sequence() == 1 ? 0 : 5;
  });
  auto bucket = cli::make_bucket({.tensors = 2}, 0);
  ASSERT_TRUE(publisher.publish(bucket.builder, 10s));
  ASSERT_TRUE(publisher.publish(bucket.builder, 10s));
  EXPECT_EQ(consumer.wait(), 0);
}

TEST_F(DeviceChannel, PayloadChecksumIsTheBlockHashCheckedOnTheDeviceBeforeHandingOut) {
  auto options = on_device();
  options.payload_checksum = true;
  auto publisher = Publisher::create(channel, options);
  auto careless = Subscriber::attach(channel, 1s);
  auto careful = Subscriber::attach(channel, 1s);
  auto bucket = cli::make_bucket({.tensors = 2, .tensor_bytes = 100 * 1024}, 0);
  ASSERT_TRUE(publisher.publish(bucket.builder, 1s));
  auto good = next_bucket(careful);
  ASSERT_TRUE(good.view().payload_checksum());
  EXPECT_TRUE(good.view().payload_checksum()->block_hash);
  EXPECT_EQ(good.view().payload_checksum()->value, block_hash::hash_of(good.copy_to_host()));
  EXPECT_EQ(StandIn::kernel_launches, 2);  // the producer's and this consumer's, on the "device"
  good.release();
  next_bucket(careless).release();
  ASSERT_TRUE(publisher.publish(bucket.builder, 1s));
  {
    // A consumer that writes into the bucket it received (the stand-in's device memory is
    // host memory).
    auto received = careless.next(1s, {.check_payload_checksum = false});
    ASSERT_TRUE(received);
    const_cast<std::byte&>(received->view()[1].bytes[5]) ^= std::byte{1};
  }
  expect_error(ErrorCode::ChecksumMismatch, [&] { careful.next(1s); });
  EXPECT_EQ(ipc::device_block_hashes_on_host(), 0u);
}

TEST_F(DeviceChannel, DeviceHandlesOfAnotherEpochAreRefused) {
  auto publisher = Publisher::create(channel, on_device());
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, 0).builder, 1s));
  test::Tampering control(test::control_name(channel));
  control.control().device_slots[0].epoch = 9;
  auto message = expect_error(ErrorCode::HeaderCorrupt, [&] { subscriber.next(1s); });
  auto epoch = control.control().slots[0].segment_epoch;
  EXPECT_NE(message.find("device handles of epoch 9 for storage epoch " + std::to_string(epoch)), std::string::npos)
      << message;
}

TEST_F(DeviceChannel, ScribbledReleaseEventsLeaveTheProducerPublishing) {
  auto publisher = Publisher::create(channel, on_device());
  auto subscriber = Subscriber::attach(channel, 1s);
  test::Tampering control(test::control_name(channel));
  // The producer imports none of them, and goes on publishing (that consumer's device work
  // is then unordered with the producer's: docs/channel.md, "Hostile peers").
  std::memset(&control.control().release_events[0], 0xA5, sizeof(ipc::ReleaseEvents));
  for (std::uint64_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, i).builder, 1s));
    EXPECT_TRUE(cli::check_bucket(next_bucket(subscriber).view(), 1, i).empty());
  }
  // Nothing waited on but the slots' ready events (the consumer's own, in this process).
  test::Tampering check(test::control_name(channel));
  for (auto id : StandIn::waited()) {
    EXPECT_TRUE(id == StandIn::event_id(check.control().device_slots[0].ready_event) ||
                id == StandIn::event_id(check.control().device_slots[1].ready_event));
  }
}

TEST_F(DeviceChannel, AScribbledMemoryHandleCostsThatBucketOnly) {
  auto publisher = Publisher::create(channel, on_device());
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, 0).builder, 1s));
  test::Tampering control(test::control_name(channel));
  std::memset(&control.control().device_slots[0].memory, 0x5A, sizeof(ipc::DeviceHandle));
  auto message = expect_error(ErrorCode::CudaFailed, [&] { subscriber.next(1s); });
  EXPECT_NE(message.find("cuIpcOpenMemHandle"), std::string::npos) << message;
  // The producer rewrites every field from its own copy with every bucket.
  for (std::uint64_t i = 1; i < 4; ++i) {
    ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 2}, i).builder, 1s));
    EXPECT_TRUE(cli::check_bucket(next_bucket(subscriber).view(), 1, i).empty());
  }
}

TEST_F(DeviceChannel, InPlaceReservationWritesTheDeviceSlot) {
  auto publisher = Publisher::create(channel, on_device());
  auto subscriber = Subscriber::attach(channel, 1s);
  Workload workload{.tensors = 5, .tensor_bytes = 2048};
  auto layout = cli::make_layout(workload, 0);
  auto reservation = publisher.reserve(layout, 1s);
  ASSERT_TRUE(reservation);
  EXPECT_EQ(reservation->location(), PayloadLocation::cuda(0));
  auto source = cli::make_bucket(workload, 0);
  for (std::size_t t = 0; t < workload.tensors; ++t) reservation->write(t, source.tensors[t].data());
  reservation->commit();
  EXPECT_TRUE(cli::check_bucket(next_bucket(subscriber).view(), workload.seed, 0).empty());
  // Every entry at once: one batched copy.
  auto calls = StandIn::copy_calls.load();
  auto second = cli::make_bucket(workload, 1);
  auto all = publisher.reserve(cli::make_layout(workload, 1), 1s);
  ASSERT_TRUE(all);
  std::vector<const void*> sources;
  for (const auto& tensor : second.tensors) sources.push_back(tensor.data());
  all->write_all(sources);
  all->commit();
  EXPECT_EQ(StandIn::copy_calls, calls + 1);
  EXPECT_TRUE(cli::check_bucket(next_bucket(subscriber).view(), workload.seed, 1).empty());
}

// Some drivers refuse cuMemcpyBatchAsync (INVALID_VALUE on some streams, NOT_SUPPORTED where
// batching is off): that batch and every later one in the process go entry by entry. Any
// other failure of a batch is CudaFailed.
TEST_F(DeviceChannel, ARefusedBatchIsCopiedEntryByEntryFromThenOn) {
  for (int refusal : {ipc::kDeviceInvalidValue, ipc::kDeviceNotSupported, 2}) {
    SCOPED_TRACE(refusal);
    auto run_channel = channel + "-" + std::to_string(refusal);
    Child producer([&] {  // the fallback is the process's: a process for each case
      StandIn::refuse_batches = refusal;
      auto publisher = Publisher::create(run_channel, on_device());
      auto subscriber = Subscriber::attach(run_channel, 1s);
      Workload workload{.tensors = 4, .tensor_bytes = 1000};
      for (std::uint64_t i = 0; i < 3; ++i) {
        try {
          publisher.publish(cli::make_bucket(workload, i).builder, 1s);
        } catch (const Error& e) {
          bool named = std::string(e.what()).find("cuMemcpyBatchAsync") != std::string::npos;
          return refusal == 2 && e.code() == ErrorCode::CudaFailed && named ? 0 : 3;
        }
        if (!cli::check_bucket(next_bucket(subscriber).view(), workload.seed, i).empty()) return 4;
      }
      // After the refused batch, a call per entry.
      if (refusal == 2 || StandIn::copy_calls != 3 * 4 || StandIn::copies != 3 * 4) return 5;
      return ipc::device_batches_copied_entry_by_entry() == 3 ? 0 : 6;
    });
    EXPECT_EQ(producer.wait(), 0);
  }
}

TEST_F(DeviceChannel, ABucketCopiedToTheHostHoldsItsPayload) {
  auto publisher = Publisher::create(channel, on_device());
  auto subscriber = Subscriber::attach(channel, 1s);
  Workload workload{.tensors = 3, .tensor_bytes = 1000};
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  auto received = next_bucket(subscriber);
  auto copy = received.copy_to_host();
  // Entries at 256-byte aligned offsets; the padding after the last one is the payload's too.
  EXPECT_EQ(copy.size(), 3 * 1024u);
  EXPECT_EQ(copy.size(), received.view().payload().size());
  EXPECT_TRUE(cli::check_bucket(received.view(), workload.seed, 0, copy).empty());
  copy[2 * 1024] ^= std::byte{1};
  EXPECT_FALSE(cli::check_bucket(received.view(), workload.seed, 0, copy).empty());
  received.wait_ready();
  received.release();
  expect_error(ErrorCode::InvalidArgument, [&] { received.copy_to_host(); });
  expect_error(ErrorCode::InvalidArgument, [&] { received.wait_ready(); });
}

TEST_F(DeviceChannel, WithoutTheStandInOrADriverCreateIsCudaUnavailable) {
  test::StandIn::uninstall();
  try {
    ipc::device_api();
  } catch (const Error& e) {
    ASSERT_EQ(e.code(), ErrorCode::CudaUnavailable) << e.what();
    auto message = expect_error(ErrorCode::CudaUnavailable, [&] { Publisher::create(channel, on_device()); });
    EXPECT_EQ(segments_of(channel), std::vector<std::string>{});
    return;
  }
  GTEST_SKIP() << "this machine has a CUDA driver: test_cuda covers it";
}

}  // namespace
}  // namespace tensorbucket
