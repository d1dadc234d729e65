// Internal: file descriptors that a forked child does not share.
//
// fork() copies descriptors, and a copy keeps the open file description alive, with the
// locks on it (liveness.hpp): a data loader forked from a consumer would keep the consumer
// "alive" after it died, and the producer would wait for it. So in every forked child each
// Descriptor is pointed at a placeholder (pthread_atfork): the number stays taken, so the
// child's copy of the handle closes nothing of anyone else's, and the locks stay the parent's.
// Descriptors are opened close-on-exec, so exec'd programs do not inherit them either.
#pragma once

#include "base/private.hpp"

namespace tensorbucket::ipc {

// While one lives, no fork() of this process goes ahead (it waits in pthread_atfork's prepare
// step): what a thread opens meanwhile is a Descriptor before any child can copy it raw.
class ForkPause {
 public:
  ForkPause();
  ~ForkPause();
  ForkPause(const ForkPause&) = delete;
  ForkPause& operator=(const ForkPause&) = delete;
};

class Descriptor {
 public:
  Descriptor() = default;
  // Takes `fd` over; made under a ForkPause, so that no child got it before it was registered.
  Descriptor(int fd, const ForkPause&);
  Descriptor(Descriptor&& other) noexcept;
  Descriptor& operator=(Descriptor&& other) noexcept;
  ~Descriptor();

  int get() const noexcept { return fd_; }

 private:
  void reset() noexcept;
  int fd_ = -1;
};

}  // namespace tensorbucket::ipc
