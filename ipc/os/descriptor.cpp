#include "ipc/os/descriptor.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>
#include <utility>
#include <vector>

namespace tensorbucket::ipc {
namespace {

// The descriptors this process has open as Descriptors. The fork handlers hold the mutex
// across fork(), so the child's copy of the list is whole and its mutex free.
struct Registry {
  std::mutex mutex;
  std::vector<int> open;
  int placeholder = -1;  // what children point their copies at
};

Registry& registry() {
  static Registry* instance = [] {
    auto* made = new Registry;  // never destroyed: fork handlers may run during exit
    // A memfd needs no file system path, so it is there even where /dev/null is not.
    made->placeholder = ::memfd_create("tensorbucket-placeholder", MFD_CLOEXEC);
    ::pthread_atfork([] { registry().mutex.lock(); }, [] { registry().mutex.unlock(); },
                     [] {
                       auto& in_child = registry();
                       // Without a placeholder (memfd_create failed) the copies stay: a
                       // lock kept alive by a child is safer than a number closed twice.
                       if (in_child.placeholder >= 0) {
                         for (int fd : in_child.open) ::dup3(in_child.placeholder, fd, O_CLOEXEC);
                       }
                       in_child.mutex.unlock();
                     });
    return made;
  }();
  return *instance;
}

// Whether this thread holds a ForkPause, and so the registry's mutex already.
thread_local bool pausing = false;

}  // namespace

ForkPause::ForkPause() {
  registry().mutex.lock();
  pausing = true;
}

ForkPause::~ForkPause() {
  pausing = false;
  registry().mutex.unlock();
}

Descriptor::Descriptor(int fd, const ForkPause&) : fd_(fd) { registry().open.push_back(fd); }

Descriptor::Descriptor(Descriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

Descriptor& Descriptor::operator=(Descriptor&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

Descriptor::~Descriptor() { reset(); }

void Descriptor::reset() noexcept {
  if (fd_ < 0) return;
  auto& known = registry();
  std::unique_lock lock(known.mutex, std::defer_lock);
  if (!pausing) lock.lock();  // a Descriptor dropped under a ForkPause: held already
  std::erase(known.open, fd_);
  ::close(std::exchange(fd_, -1));
}

}  // namespace tensorbucket::ipc
