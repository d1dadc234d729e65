// Internal: which process a channel handle belongs to.
#pragma once

#include "base/private.hpp"

#include <cstdint>

namespace tensorbucket::ipc {

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

// The inode of this process's pid namespace (/proc/self/ns/pid), which tells whether a pid
// another process wrote down is one we can see; 0 when /proc does not say.
std::uint64_t pid_namespace();

}  // namespace tensorbucket::ipc
