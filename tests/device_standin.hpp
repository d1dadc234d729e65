// A stand-in for the CUDA driver (ipc/cuda/device.hpp's table) over host memory, so the device
// path of a channel runs where there is no GPU: allocations are memfd's that another process
// of ours imports through /proc/PID/fd, copies are memcpy, and streams run at once, so events
// have nothing to wait for; they are counted instead, for tests that check who waits on what.
// Like the driver, it refuses to import a process's own exports.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "ipc/cuda/device.hpp"

namespace tensorbucket::test {

struct StandIn {
  // The devices this process sees, in ordinal order. Set before installing (and forking).
  static inline std::vector<ipc::DeviceUuid> devices = {
      {0x11, 0x11, 0x11, 0x11, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
      {0x22, 0x22, 0x22, 0x22, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2}};

  // What this process asked of it.
  static inline std::atomic<int> memory_imports{0}, memory_closes{0}, allocations{0}, frees{0};
  static inline std::atomic<int> event_imports{0}, copy_calls{0}, copies{0}, kernel_launches{0};
  // Called by every host wait for an event (cuEventSynchronize), when set.
  static inline std::function<void()> on_event_wait;
  // The next call of this name fails with kInjectedError, once (e.g. "import_memory").
  static inline const char* fail_next = nullptr;
  static constexpr int kInjectedError = 999;
  // Every batch of more than one copy is refused with `refuse_batches` (e.g. INVALID_VALUE), as
  // some drivers refuse cuMemcpyBatchAsync; 0: batches are taken.
  static inline std::atomic<int> refuse_batches{0};

  // Event ids: what was recorded and what streams waited on, in order.
  static std::vector<std::uint64_t> recorded();
  static std::vector<std::uint64_t> waited();
  // Every record ('r', event id), wait ('w', event id) and batch of copies ('c', copies), in
  // the order they were asked for: what the stream order would be.
  struct Operation {
    char kind;
    std::uint64_t value;
  };
  static std::vector<Operation> operations();
  // The id of the event an exported handle names (0 if it names none).
  static std::uint64_t event_id(const ipc::DeviceHandle& handle);

  static void install();
  static void uninstall();
  static void reset_counts();
};

// Installs the stand-in for one test's life.
struct StandInScope {
  StandInScope() {
    StandIn::reset_counts();
    StandIn::install();
  }
  ~StandInScope() { StandIn::uninstall(); }
};

}  // namespace tensorbucket::test
