// Internal: who a process is, in a form that survives pid reuse.
#pragma once

#include <cstdint>

namespace tensorbucket::ipc {

// A pid alone is not an identity: pids are reused. The kernel's start time of the process
// (in clock ticks since boot, /proc/<pid>/stat field 22) tells a reused pid apart.
struct ProcessId {
  std::int32_t pid;
  std::uint32_t reserved;
  std::uint64_t start_time;
};

ProcessId current_process();

// True while the process `id` names still runs (a zombie counts as gone).
bool is_alive(const ProcessId& id);

}  // namespace tensorbucket::ipc
