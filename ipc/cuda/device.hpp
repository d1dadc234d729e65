// Internal: the CUDA calls a device channel makes, as one narrow table of functions.
//
// Two implementations: the CUDA driver (cuda_driver.cpp), loaded with dlopen on first use, so
// the library neither links libcuda nor ties itself to the CUDA runtime torch ships
// (docs/channel.md, "CUDA"); and, in tests, a stand-in over host memory
// (tests/device_standin.cpp), so the device path's protocol runs where there is no GPU.
// Addresses are unified: a copy's ends may each be host or device memory.
#pragma once

#include "base/private.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tensorbucket::ipc {

inline constexpr std::size_t kDeviceHandleBytes = 64;  // CU_IPC_HANDLE_SIZE
inline constexpr int kDeviceInvalidValue = 1;          // CUDA_ERROR_INVALID_VALUE
inline constexpr int kDeviceNotSupported = 801;        // CUDA_ERROR_NOT_SUPPORTED

// An exported memory or event handle, as the driver writes it: opaque bytes.
struct DeviceHandle {
  std::array<std::uint8_t, kDeviceHandleBytes> bytes;
};
using DeviceUuid = std::array<std::uint8_t, 16>;
using DeviceAddress = unsigned long long;  // CUdeviceptr
using DeviceStream = void*;           // CUstream; null: the legacy default stream
using DeviceEvent = void*;            // CUevent

struct DeviceCopy {
  DeviceAddress to;
  DeviceAddress from;
  std::uint64_t bytes;
};

// Every call returns 0 or the driver's error code (a CUresult). Calls that act on a device
// run with that device's context current (DeviceScope).
struct DeviceApi {
  const char* name;  // for messages: "the CUDA driver"
  int (*device_count)(int* count);
  int (*device_uuid)(int ordinal, DeviceUuid* uuid);
  int (*enter)(int ordinal);  // makes the device's primary context current on this thread
  int (*leave)();             // restores the context current before enter()
  int (*allocate)(DeviceAddress* address, std::uint64_t bytes);
  int (*release)(DeviceAddress address);
  int (*export_memory)(DeviceHandle* handle, DeviceAddress address);
  // The address it is mapped at, and the size of the allocation mapped there.
  int (*import_memory)(DeviceAddress* address, std::uint64_t* bytes, const DeviceHandle& handle);
  int (*close_memory)(DeviceAddress address);
  int (*create_event)(DeviceEvent* event);  // interprocess, without timing
  int (*export_event)(DeviceHandle* handle, DeviceEvent event);
  int (*import_event)(DeviceEvent* event, const DeviceHandle& handle);
  int (*destroy_event)(DeviceEvent event);
  int (*record_event)(DeviceEvent event, DeviceStream stream);
  int (*wait_event)(DeviceStream stream, DeviceEvent event);
  // Every copy of the batch, in one submission where the driver can (cuMemcpyBatchAsync).
  int (*copy)(const DeviceCopy* copies, std::size_t count, DeviceStream stream);
  int (*zero)(DeviceAddress address, std::uint64_t bytes, DeviceStream stream);
  int (*synchronize)(DeviceStream stream);
  int (*synchronize_event)(DeviceEvent event);
  int (*synchronize_context)();  // the current context: all its streams
  // The block hash (serialize/block_hash.hpp) of each block of the `bytes` at `payload`, into
  // `hashes` (device memory), on `stream`; kDeviceNotSupported where no kernel is built in.
  int (*hash_blocks)(DeviceAddress payload, std::uint64_t bytes, DeviceAddress hashes, DeviceStream stream);
  const char* (*error_name)(int code);
};

// The table device channels use: the stand-in when one is installed, else the CUDA driver,
// loaded once; CudaUnavailable when there is no driver or it has no device.
const DeviceApi& device_api();

// Tests: every later device_api() answers with `stand_in`; nullptr returns to the driver.
void install_device_api(const DeviceApi* stand_in);

// Throws CudaFailed naming `call` and the error, unless `code` is 0.
void check_device(int code, const char* call);

// The UUID of this process's device `ordinal`; DeviceNotVisible when there is no such device.
DeviceUuid device_uuid(int ordinal);
// This process's ordinal of the device with `uuid`; DeviceNotVisible when it sees none.
int device_ordinal(const DeviceUuid& uuid);
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi names devices.
std::string describe(const DeviceUuid& uuid);

// An interprocess event of this process and its exported handle.
struct PooledEvent {
  DeviceEvent event = nullptr;
  DeviceHandle handle{};
};

// Interprocess events are made on demand and never destroyed, only handed out again: another
// process may still wait on its import of one, and using an import after its exporter
// destroyed the event is undefined (cuIpcOpenEventHandle). take_event() needs the device's
// context current (DeviceScope); a forked child starts with an empty pool.
PooledEvent take_event(int ordinal);
void give_back_event(int ordinal, const PooledEvent& event) noexcept;
// Copies every entry of the batch on `stream`, in one submission (the table's `copy`). Where
// the driver refuses a batch (INVALID_VALUE or NOT_SUPPORTED: seen on some streams, and
// batching is off on some architectures), that batch and every later one in this process go
// entry by entry. Throws CudaFailed naming the call that failed otherwise.
void copy_batch(const DeviceCopy* copies, std::size_t count, DeviceStream stream);
// How many batches this process copied entry by entry after such a refusal (the GPU check
// prints it).
std::uint64_t device_batches_copied_entry_by_entry();

// This process's own event with `handle`, or null. The driver does not import a process's own
// exports, so a producer and a consumer in one process use the event itself.
DeviceEvent own_event(const DeviceHandle& handle) noexcept;

// The block hash of the `bytes` of device memory at `payload` on device `ordinal`, after the
// work queued on `stream`, waiting for it: on the GPU where the kernel is built in, else of a
// copy brought back. The device's context must be current. The block hashes land in a buffer
// kept per device (grown, never shrunk: 8 bytes per 64 KiB hashed), one hash at a time.
std::uint64_t device_block_hash(int ordinal, DeviceAddress payload, std::uint64_t bytes, DeviceStream stream);
// How many of those were taken on a host copy, for tests.
std::uint64_t device_block_hashes_on_host();

// The device's context current on this thread while it lives; the caller's afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
};

}  // namespace tensorbucket::ipc
