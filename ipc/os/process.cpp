#include "ipc/os/process.hpp"

#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>

#include "ipc/control.hpp"

namespace tensorbucket::ipc {

namespace {
std::atomic<std::uint64_t> forks_seen{0};  // in this process and its ancestors
void count_fork() { forks_seen.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

Owner::Owner() : pid_(static_cast<std::int32_t>(::getpid())) {
  static const int registered = ::pthread_atfork(nullptr, nullptr, count_fork);
  static_cast<void>(registered);
  forks_ = forks_seen.load(std::memory_order_relaxed);
}

bool Owner::forked() const noexcept { return forks_seen.load(std::memory_order_relaxed) != forks_; }

std::uint64_t pid_namespace() {
  struct stat status {};
  if (::stat("/proc/self/ns/pid", &status) != 0) return 0;
  return status.st_ino;
}

ProcessLabel this_process() {
  return {static_cast<std::int32_t>(::getpid()), 0, pid_namespace()};
}

}  // namespace tensorbucket::ipc
