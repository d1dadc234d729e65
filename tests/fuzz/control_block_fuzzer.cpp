// libFuzzer target: a consumer reading a control block and a slot that another process of our
// uid wrote. Each input starts from a real channel (a producer in this process published one
// bucket) and is XORed over it: its first kControlBytes over the control block (all of it but
// the parts of a CUDA channel, unused on this host channel), the rest over slot 0's frame
// (header and manifest). Then a consumer attaches, reads what it
// can without waiting, and inspect_channel() looks. Whatever the bytes, every failure must be
// a typed Error and every view must lie inside the mapping; a crash, a hang, another exception
// or a sanitizer report is a finding.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_target.hpp"
#include "ipc/control.hpp"
#include "tensorbucket/tensorbucket.hpp"

using namespace tensorbucket;

namespace {

// Reads every byte the views expose, so a view past the mapping trips ASan or faults.
unsigned touch(const BucketView& view) {
  unsigned sum = 0;
  for (std::size_t i = 0; i < view.size(); ++i) {
    for (auto b : view[i].bytes) sum += static_cast<unsigned>(b);
  }
  return sum;
}

void xor_into(std::byte* to, std::size_t room, const std::uint8_t* bytes, std::size_t size) {
  for (std::size_t i = 0; i < std::min(room, size); ++i) to[i] ^= static_cast<std::byte>(bytes[i]);
}

// A segment of this channel mapped read-write, as the writing process has it.
struct Mapped {
  Mapped(const std::string& name, std::size_t offset) {
    int fd = ::shm_open(("/" + name).c_str(), O_RDWR, 0);
    if (fd < 0) std::abort();
    bytes = static_cast<std::size_t>(::lseek(fd, 0, SEEK_END));
    data = static_cast<std::byte*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    ::close(fd);
    if (data == MAP_FAILED || offset > bytes) std::abort();
    from = offset;
  }
  ~Mapped() { ::munmap(data, bytes); }
  std::byte* data;
  std::size_t bytes;
  std::size_t from;
};

}  // namespace

std::string fuzz_outcome(const std::uint8_t* data, std::size_t size) {
  static const std::string channel = "fuzz-control-" + std::to_string(::getpid());
  const float values[6] = {1, 2, 3, 4, 5, 6};
  auto publisher = Publisher::create(channel, {.slots = 2, .min_consumers = 0, .payload_checksum = true});
  BucketBuilder bucket;
  bucket.version(7).add("layer.weight", DType::F32, Shape{2, 2}, values).add("layer.bias", DType::F32, Shape{2}, values + 4);
  if (!publisher.publish(bucket, std::chrono::milliseconds(0))) std::abort();

  constexpr auto kControlBytes = offsetof(ipc::ControlBlock, device_slots);
  auto control_bytes = std::min(size, kControlBytes);
  {
    Mapped control("tensorbucket." + channel, 0);
    xor_into(control.data, control.bytes, data, control_bytes);
    // The frame follows a page of payload.
    Mapped slot(ipc::slot_segment_name(channel, 0, ipc::epoch_base(publisher.incarnation()) + 1), 4096);
    xor_into(slot.data + slot.from, slot.bytes - slot.from, data + control_bytes, size - control_bytes);
  }

  // "attach ok, bucket 0, none, inspect manifest": what each step gave, or its error code.
  std::string outcome = "attach ";
  try {
    auto subscriber = Subscriber::attach(channel, std::chrono::milliseconds(0));
    outcome += "ok";
    for (int i = 0; i < 3; ++i) {
      auto received = subscriber.next(std::chrono::milliseconds(0));
      if (!received) {
        outcome += ", none";
        break;
      }
      touch(received->view());
      outcome += ", bucket " + std::to_string(received->sequence());
    }
  } catch (const Error& e) {
    outcome += (outcome.ends_with(' ') ? "" : ", ") + std::string(to_string(e.code()));
  }
  outcome += ", inspect ";
  try {
    auto info = inspect_channel(channel);
    outcome += info.newest_manifest ? "manifest" : "no manifest";
  } catch (const Error& e) {
    outcome += to_string(e.code());
  }
  return outcome;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_outcome(data, size);
  return 0;
}
