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

// The process a channel handle was made in. A child forked from it inherits the handle but
// not its role (docs/channel.md, "Forked children"), and handles ask on every call. getpid()
// is a system call (~0.15 us here), so a counter that pthread_atfork bumps in every child is
// read instead.
class Owner {
 public:
  Owner();  // this process
  // True in a child forked, at any depth, from the process that made this.
  bool forked() const noexcept;
  std::int32_t pid() const noexcept { return pid_; }

 private:
  std::int32_t pid_;
  std::uint64_t forks_;  // the counter when this was made
};

}  // namespace tensorbucket::ipc
