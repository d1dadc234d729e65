// Device channels on a real GPU, through the CUDA driver: producers and consumers are forked
// processes, so that this process never initialises CUDA (a process must not fork after it
// did). Bytes are written by a pattern kernel and checked, every one, by a kernel on the
// consumer's stream. Without a driver or a device every test here is skipped, saying why;
// test_device_channel runs the same protocol against the host stand-in everywhere.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include "channel_support.hpp"
#include "ipc/cuda/cuda_driver.hpp"
#include "ipc/slot_storage.hpp"
#include "pattern.hpp"
#include "serialize/block_hash.hpp"

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;
using test::Child;
using test::Signal;

// Asked in a child, so that this process stays free of CUDA.
const std::string& why_no_device() {
  static const std::string why = [] {
    Signal answer;
    Child probe([&] {
      try {
        int count = 0;
        ipc::check_device(ipc::device_api().device_count(&count), "cuDeviceGetCount");
        answer.send(count > 0 ? 'y' : 'n');
      } catch (const Error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        answer.send('n');
      }
      return 0;
    });
    auto reply = answer.receive();
    probe.wait();
    return reply == 'y' ? std::string() : std::string("no CUDA driver or device here (see the message above)");
  }();
  return why;
}

#define SKIP_WITHOUT_GPU() \
  if (!why_no_device().empty()) GTEST_SKIP() << why_no_device()

constexpr std::uint32_t kTensors = 8;

std::uint64_t seed_of(std::uint64_t bucket, std::uint32_t tensor) { return bucket * 131 + tensor; }

// Publishes `buckets` buckets of kTensors pattern-filled tensors of `tensor_bytes` each from
// `device`; `created`, when given, runs once the channel exists, before the first bucket
// (false: give up). The exit status says how it went.
int produce(const std::string& channel, int device, std::uint64_t buckets, std::uint64_t tensor_bytes,
            const std::function<bool()>& created = {}) {
  std::string error;
  if (!cuda::select_device(device, error)) return 10;
  auto* stream = cuda::make_stream(error);
  std::vector<void*> tensors;
  for (std::uint32_t t = 0; t < kTensors; ++t) tensors.push_back(cuda::allocate(tensor_bytes, error));
  if (!stream || !error.empty()) return 11;
  auto publisher = Publisher::create(channel, {.location = PayloadLocation::cuda(device)});
  if (created && !created()) return 15;
  for (std::uint64_t b = 0; b < buckets; ++b) {
    BucketBuilder builder;
    builder.version(b);
    for (std::uint32_t t = 0; t < kTensors; ++t) {
      // Queued on the stream the copy runs on, so it waits for the copy of the bucket before.
      if (!cuda::fill_pattern(tensors[t], tensor_bytes, seed_of(b, t), stream, error)) return 12;
      builder.add("t" + std::to_string(t), DType::U8, Shape{static_cast<std::int64_t>(tensor_bytes)}, tensors[t]);
    }
    if (!publisher.publish(builder, 60s, stream)) return 13;
  }
  if (!publisher.drain(60s)) return 14;
  // For scripts/gpu-check's summary: batches the driver refused, copied entry by entry instead.
  std::printf("producer: %llu of %llu batches copied entry by entry\n",
              static_cast<unsigned long long>(ipc::device_batches_copied_entry_by_entry()),
              static_cast<unsigned long long>(buckets));
  std::fflush(stdout);
  return 0;
}

// Receives `buckets` buckets and checks every byte on the device; then that it opened no more
// than `imports` handles (one per slot and epoch: none per bucket). Says it attached through
// `attached`, when given. The exit status says how it went.
int consume(const std::string& channel, std::uint64_t buckets, std::uint64_t imports, Signal* attached = nullptr) {
  std::string error;
  auto subscriber = Subscriber::attach(channel, 120s, {.expected_location = PayloadLocation::Kind::Cuda});
  if (attached != nullptr) attached->send();
  if (!cuda::select_device(subscriber.location().device, error)) return 20;
  auto* stream = cuda::make_stream(error);
  if (!stream) return 21;
  for (std::uint64_t i = 0; i < buckets; ++i) {
    auto bucket = subscriber.next(60s, {}, stream);
    if (!bucket) return 22;
    const auto& view = bucket->view();
    if (view.location().on_host() || view.size() != kTensors) return 23;
    for (std::uint32_t t = 0; t < kTensors; ++t) {
      auto bytes = view[t].bytes;
      auto wrong = cuda::count_mismatches(bytes.data(), bytes.size(), seed_of(view.version(), t), stream, error);
      if (wrong != 0) {
        std::fprintf(stderr, "bucket %llu tensor %u: %lld bytes wrong %s\n",
                     static_cast<unsigned long long>(view.version()), t, static_cast<long long>(wrong), error.c_str());
        return 24;
      }
    }
    bucket->release(stream);
  }
  if (ipc::device_imports_made() > imports) {
    std::fprintf(stderr, "%llu handles opened for %llu buckets\n",
                 static_cast<unsigned long long>(ipc::device_imports_made()), static_cast<unsigned long long>(buckets));
    return 25;
  }
  return 0;
}

class CudaChannel : public test::ChannelTest {};

// The kernel's block hash (ipc/cuda/block_hash.cu, loaded from the library's PTX) against the
// host's (serialize/block_hash.cpp) of the same bytes, at sizes around the block and word
// boundaries.
TEST(CudaBlockHash, TheKernelHashesAsTheHostDoes) {
  SKIP_WITHOUT_GPU();
  if (ipc::cuda::kBlockHashPtx == nullptr) GTEST_SKIP() << "this build has no kernel (no nvcc at configure time)";
  Child checker([] {
    std::string error;
    if (!cuda::select_device(0, error)) return 10;
    auto* stream = cuda::make_stream(error);
    for (std::uint64_t bytes : {std::uint64_t{1}, std::uint64_t{8}, std::uint64_t{65536}, std::uint64_t{65537},
                                std::uint64_t{3 * 65536 + 13}, std::uint64_t{(64 << 20) + 5}}) {
      auto* memory = cuda::allocate(bytes, error);
      if (!memory || !cuda::fill_pattern(memory, bytes, bytes, stream, error)) return 11;
      std::uint64_t on_gpu = 0;
      {
        ipc::DeviceScope scope(0);
        on_gpu = ipc::device_block_hash(0, reinterpret_cast<ipc::DeviceAddress>(memory), bytes, stream);
      }
      std::vector<std::byte> copy(bytes);
      if (!cuda::copy_to_host(copy.data(), memory, bytes, stream, error)) return 12;
      if (on_gpu != block_hash::hash_of(copy)) {
        std::fprintf(stderr, "%llu bytes: the kernel says %llx, the host %llx\n", static_cast<unsigned long long>(bytes),
                     static_cast<unsigned long long>(on_gpu), static_cast<unsigned long long>(block_hash::hash_of(copy)));
        return 13;
      }
      cuda::release(memory);
    }
    // 14: the hashes agree, but the driver refused the kernel (a driver older than the nvcc
    // that made its PTX) and each was taken on a host copy.
    return ipc::device_block_hashes_on_host() == 0 ? 0 : 14;
  });
  auto status = checker.wait(120s);
  if (status == 14) GTEST_SKIP() << "the driver here does not load the kernel's PTX: hashes taken on the host";
  EXPECT_EQ(status, 0);
}

TEST_F(CudaChannel, TwoProcessesExchange200DeviceBucketsWithCachedHandles) {
  SKIP_WITHOUT_GPU();
  Child consumer([&] { return consume(channel, 200, 2); });
  Child producer([&] { return produce(channel, 0, 200, 64 * 1024 + 100); });
  EXPECT_EQ(consumer.wait(120s), 0);
  EXPECT_EQ(producer.wait(120s), 0);
}

TEST_F(CudaChannel, AGrowingBucketTakesItsSlotToANewEpoch) {
  SKIP_WITHOUT_GPU();
  Child reader([&] { return consume(channel, 2, 2); });  // one slot, two epochs
  Child grower([&] {
    std::string error;
    if (!cuda::select_device(0, error)) return 10;
    auto* stream = cuda::make_stream(error);
    if (!stream) return 11;
    auto publisher = Publisher::create(channel, {.slots = 1, .location = PayloadLocation::cuda(0)});
    for (std::uint64_t b = 0; b < 2; ++b) {
      std::uint64_t bytes = b == 0 ? 4096 : 8 << 20;  // the second does not fit the first's slot
      BucketBuilder builder;
      builder.version(b);
      std::vector<void*> tensors;
      for (std::uint32_t t = 0; t < kTensors; ++t) {
        tensors.push_back(cuda::allocate(bytes, error));
        if (!tensors.back() || !cuda::fill_pattern(tensors.back(), bytes, seed_of(b, t), stream, error)) return 12;
        builder.add("t" + std::to_string(t), DType::U8, Shape{static_cast<std::int64_t>(bytes)}, tensors.back());
      }
      if (!publisher.publish(builder, 60s, stream) || !publisher.drain(60s)) return 13;
      for (auto* tensor : tensors) cuda::release(tensor);
    }
    return inspect_channel(channel).slot_states[0].epoch == 2 ? 0 : 14;
  });
  EXPECT_EQ(grower.wait(120s), 0);
  EXPECT_EQ(reader.wait(60s), 0);
}

// The producer is killed once its channel exists and five buckets went out, with its stream
// finished: a producer killed with its ready event's record still queued can leave a
// consumer's stream waiting for good, which the consumer's bounded check would report
// (docs/channel.md, "CUDA").
TEST_F(CudaChannel, AKilledProducerLeavesNoHangAndARestartedOneIsReceived) {
  SKIP_WITHOUT_GPU();
  {
    Signal published;
    Child producer([&] {
      std::string error;
      if (!cuda::select_device(0, error)) return 10;
      auto* stream = cuda::make_stream(error);
      auto* tensor = cuda::allocate(256 * 1024, error);
      if (!stream || !tensor) return 11;
      auto publisher = Publisher::create(channel, {.location = PayloadLocation::cuda(0)});
      for (std::uint64_t b = 0; b < 5; ++b) {
        BucketBuilder builder;
        builder.version(b);
        for (std::uint32_t t = 0; t < kTensors; ++t) {
          builder.add("t" + std::to_string(t), DType::U8, Shape{256 * 1024}, tensor);
        }
        if (!cuda::fill_pattern(tensor, 256 * 1024, 0, stream, error)) return 12;
        if (!publisher.publish(builder, 60s, stream)) return 13;
      }
      if (!cuda::finish(stream, error) || !published.send()) return 14;
      for (;;) ::pause();
    });
    Child consumer([&] {
      try {
        auto subscriber = Subscriber::attach(channel, 120s);
        std::string error;
        if (!cuda::select_device(subscriber.location().device, error)) return 20;
        auto* stream = cuda::make_stream(error);
        for (std::uint64_t received = 0;; ++received) {
          auto bucket = subscriber.next(60s, {}, stream);
          if (!bucket) return 31;
          if (received == 5) return 32;  // more than were published
          for (std::uint32_t t = 0; t < kTensors; ++t) {
            auto bytes = bucket->view()[t].bytes;
            if (cuda::count_mismatches(bytes.data(), bytes.size(), 0, stream, error) != 0) {
              std::fprintf(stderr, "bucket %llu: %s\n", static_cast<unsigned long long>(received), error.c_str());
              return 33;
            }
          }
        }
      } catch (const Error& e) {
        return e.code() == ErrorCode::ProducerGone ? 0 : 30;
      }
    });
    ASSERT_NE(published.receive(120s), 0);
    producer.kill_now();
    EXPECT_EQ(consumer.wait(120s), 0);  // five whole buckets, then ProducerGone
  }
  Child consumer([&] { return consume(channel, 20, 2); });
  Child producer([&] { return produce(channel, 0, 20, 4096); });
  EXPECT_EQ(consumer.wait(120s), 0);
  EXPECT_EQ(producer.wait(120s), 0);
}

// The producer creates the channel first: a consumer's attach waits for a live producer, so
// consumers that say "attached" before anything exists would wait for it forever.
TEST_F(CudaChannel, AConsumerKilledHoldingABucketDoesNotStallTheProducer) {
  SKIP_WITHOUT_GPU();
  Signal attached, holding;
  Child survivor([&] { return consume(channel, 60, 2, &attached); });
  Child doomed([&] {
    auto subscriber = Subscriber::attach(channel, 120s);
    attached.send();
    auto bucket = subscriber.next(60s);
    holding.send();
    ::pause();  // holding its lease until killed
    return bucket ? 0 : 1;
  });
  Child producer([&] {
    return produce(channel, 0, 60, 4096, [&] { return attached.receive(120s) != 0 && attached.receive(120s) != 0; });
  });
  ASSERT_NE(holding.receive(180s), 0);
  doomed.kill_now();
  EXPECT_EQ(producer.wait(120s), 0);
  EXPECT_EQ(survivor.wait(60s), 0);
}

// With several GPUs, the producer's last device is the consumer's device 0; with one, the
// consumer names it in CUDA_VISIBLE_DEVICES by its UUID. Either way it is found by UUID.
TEST_F(CudaChannel, AConsumerSeeingOtherVisibleDevicesFindsTheDeviceByUuid) {
  SKIP_WITHOUT_GPU();
  Signal count;
  auto uuid_file = std::filesystem::temp_directory_path() / (channel + ".uuid");
  Child probe([&] {
    int devices = 0;
    ipc::device_api().device_count(&devices);
    std::ofstream(uuid_file) << ipc::describe(ipc::device_uuid(devices - 1));
    count.send_int(devices);
    return 0;
  });
  auto devices = count.receive_int();
  probe.wait();
  ASSERT_TRUE(devices && *devices > 0);
  auto last = static_cast<int>(*devices - 1);
  std::string uuid;
  std::ifstream(uuid_file) >> uuid;
  std::filesystem::remove(uuid_file);
  Child consumer([&] {
    ::setenv("CUDA_VISIBLE_DEVICES", (last > 0 ? std::to_string(last) : uuid).c_str(), 1);
    {
      // Attached for a look only: a record that reads nothing would hold the producer back.
      auto subscriber = Subscriber::attach(channel, 60s);
      if (subscriber.location() != PayloadLocation::cuda(0)) return 50;
    }
    return consume(channel, 10, 2);
  });
  Child producer([&] { return produce(channel, last, 10, 4096); });
  EXPECT_EQ(consumer.wait(120s), 0);
  EXPECT_EQ(producer.wait(120s), 0);
}

}  // namespace
}  // namespace tensorbucket
