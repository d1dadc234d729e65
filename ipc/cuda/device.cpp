#include "ipc/cuda/device.hpp"

#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>

#include "ipc/cuda/cuda_driver.hpp"
#include "tensorbucket/channel.hpp"
#include "ipc/os/process.hpp"
#include "serialize/block_hash.hpp"
#include "base/text.hpp"

namespace tensorbucket::ipc {

namespace {

std::atomic<const DeviceApi*> stand_in{nullptr};
std::atomic<std::uint64_t> hashes_on_host{0};
std::atomic<bool> batches_refused{false};
std::atomic<std::uint64_t> batches_entry_by_entry{0};

struct HashScratch {
  struct Buffer {
    DeviceAddress address = 0;
    std::uint64_t bytes = 0;
  };
  std::mutex mutex;
  Owner owner;
  std::map<int, Buffer> buffers;  // by ordinal
};

HashScratch& hash_scratch() {
  static auto* scratch = new HashScratch;  // never destroyed: the memory lives with the process
  return *scratch;
}

struct EventPool {
  std::mutex mutex;
  Owner owner;
  std::map<int, std::vector<PooledEvent>> free;                              // by ordinal
  std::map<std::array<std::uint8_t, kDeviceHandleBytes>, DeviceEvent> made;  // by handle

  // In a forked child the parent's events are not ours: forgotten, not destroyed.
  void forget_if_forked() {
    if (!owner.forked()) return;
    free.clear();
    made.clear();
    owner = Owner();
  }
};

EventPool& event_pool() {
  static auto* pool = new EventPool;  // never destroyed: in use until the process ends
  return *pool;
}

}  // namespace

const DeviceApi& device_api() {
  if (const auto* api = stand_in.load(std::memory_order_acquire)) return *api;
  return cuda::driver_api();
}

void install_device_api(const DeviceApi* api) { stand_in.store(api, std::memory_order_release); }

void check_device(int code, const char* call) {
  if (code == 0) return;
  const auto& api = device_api();
  text::fail(ErrorCode::CudaFailed, call, " failed in ", api.name, ": ", api.error_name(code), " (", code, ")");
}

DeviceUuid device_uuid(int ordinal) {
  const auto& api = device_api();
  int count = 0;
  check_device(api.device_count(&count), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= count) {
    text::fail(ErrorCode::DeviceNotVisible, "CUDA device ", ordinal, " is not visible here: this process sees ",
               count, " device", count == 1 ? "" : "s");
  }
  DeviceUuid uuid{};
  check_device(api.device_uuid(ordinal, &uuid), "cuDeviceGetUuid");
  return uuid;
}

int device_ordinal(const DeviceUuid& uuid) {
  const auto& api = device_api();
  int count = 0;
  check_device(api.device_count(&count), "cuDeviceGetCount");
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    DeviceUuid seen{};
    check_device(api.device_uuid(ordinal, &seen), "cuDeviceGetUuid");
    if (seen == uuid) return ordinal;
  }
  text::fail(ErrorCode::DeviceNotVisible, "CUDA device ", describe(uuid), " is not among the ", count,
             " device", count == 1 ? "" : "s",
             " this process sees (check CUDA_VISIBLE_DEVICES)");
}

std::string describe(const DeviceUuid& uuid) {
  std::string text = "GPU-";
  char hex[3];
  for (std::size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    std::snprintf(hex, sizeof hex, "%02x", uuid[i]);
    text += hex;
  }
  return text;
}

PooledEvent take_event(int ordinal) {
  auto& pool = event_pool();
  std::lock_guard lock(pool.mutex);
  pool.forget_if_forked();
  auto& free = pool.free[ordinal];
  if (!free.empty()) {
    auto event = free.back();
    free.pop_back();
    return event;
  }
  const auto& api = device_api();
  PooledEvent made;
  check_device(api.create_event(&made.event), "cuEventCreate");
  if (auto code = api.export_event(&made.handle, made.event)) {
    api.destroy_event(made.event);  // never exported: nobody else can hold it
    check_device(code, "cuIpcGetEventHandle");
  }
  pool.made[made.handle.bytes] = made.event;
  return made;
}

void give_back_event(int ordinal, const PooledEvent& event) noexcept {
  auto& pool = event_pool();
  std::lock_guard lock(pool.mutex);
  if (pool.owner.forked()) return;  // the parent's
  try {
    pool.free[ordinal].push_back(event);
  } catch (const std::bad_alloc&) {
    // Leaked: lost to reuse, never destroyed under a waiter.
  }
}

void copy_batch(const DeviceCopy* copies, std::size_t count, DeviceStream stream) {
  const auto& api = device_api();
  if (count > 1 && !batches_refused.load(std::memory_order_relaxed)) {
    auto code = api.copy(copies, count, stream);
    if (code == 0) return;
    if (code != kDeviceInvalidValue && code != kDeviceNotSupported) check_device(code, "cuMemcpyBatchAsync");
    // Copying the whole batch again is harmless: every copy of it writes the same bytes to
    // the same place, in stream order.
    batches_refused.store(true, std::memory_order_relaxed);
  }
  if (count > 1) ++batches_entry_by_entry;
  for (std::size_t i = 0; i < count; ++i) check_device(api.copy(&copies[i], 1, stream), "cuMemcpyAsync");
}

std::uint64_t device_batches_copied_entry_by_entry() { return batches_entry_by_entry.load(); }

DeviceEvent own_event(const DeviceHandle& handle) noexcept {
  auto& pool = event_pool();
  std::lock_guard lock(pool.mutex);
  if (pool.owner.forked()) return nullptr;
  auto found = pool.made.find(handle.bytes);
  return found == pool.made.end() ? nullptr : found->second;
}

std::uint64_t device_block_hashes_on_host() { return hashes_on_host.load(); }

std::uint64_t device_block_hash(int ordinal, DeviceAddress payload, std::uint64_t bytes, DeviceStream stream) {
  const auto& api = device_api();
  std::vector<std::uint64_t> hashes(block_hash::blocks_in(bytes));
  if (hashes.empty()) return block_hash::combine(hashes);
  auto& scratch = hash_scratch();
  int code = 0;
  {
    // A buffer per device, not an allocation per hash: cuMemAlloc and cuMemFree wait for
    // the device, torch's streams included.
    std::lock_guard lock(scratch.mutex);
    if (scratch.owner.forked()) {  // the parent's buffers: forgotten, not freed
      scratch.buffers.clear();
      scratch.owner = Owner();
    }
    auto& buffer = scratch.buffers[ordinal];
    auto needed = hashes.size() * sizeof(std::uint64_t);
    if (buffer.bytes < needed) {
      if (buffer.address != 0) api.release(buffer.address);
      buffer = {};
      check_device(api.allocate(&buffer.address, needed), "cuMemAlloc");
      buffer.bytes = needed;
    }
    code = api.hash_blocks(payload, bytes, buffer.address, stream);
    if (code == 0) {
      DeviceCopy back{reinterpret_cast<DeviceAddress>(hashes.data()), buffer.address, needed};
      code = api.copy(&back, 1, stream);
      if (code == 0) code = api.synchronize(stream);
    }
  }
  if (code == 0) return block_hash::combine(hashes);
  if (code != kDeviceNotSupported) check_device(code, "tensorbucket_block_hashes");
  ++hashes_on_host;
  std::vector<std::byte> copy(bytes);
  DeviceCopy back{reinterpret_cast<DeviceAddress>(copy.data()), payload, bytes};
  check_device(api.copy(&back, 1, stream), "cuMemcpyAsync");
  check_device(api.synchronize(stream), "cuStreamSynchronize");
  return block_hash::hash_of(copy);
}

DeviceScope::DeviceScope(int ordinal) { check_device(device_api().enter(ordinal), "cuCtxPushCurrent"); }
DeviceScope::~DeviceScope() { device_api().leave(); }

}  // namespace tensorbucket::ipc

namespace tensorbucket {

void copy_on_device(int device, std::span<const CudaCopy> copies, CudaStream stream) {
  std::vector<ipc::DeviceCopy> batch;
  batch.reserve(copies.size());
  for (const auto& copy : copies) {
    batch.push_back({reinterpret_cast<ipc::DeviceAddress>(copy.to), reinterpret_cast<ipc::DeviceAddress>(copy.from), copy.bytes});
  }
  ipc::DeviceScope scope(device);
  ipc::copy_batch(batch.data(), batch.size(), stream);
}

}  // namespace tensorbucket
