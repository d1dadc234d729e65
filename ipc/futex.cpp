#include "futex.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <ctime>

namespace tensorbucket::ipc {

// Not FUTEX_PRIVATE_FLAG: the word lives in memory shared between processes.
void futex_wait(std::uint32_t* word, std::uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout <= std::chrono::nanoseconds::zero()) return;
  timespec relative{static_cast<time_t>(timeout.count() / 1'000'000'000),
                    static_cast<long>(timeout.count() % 1'000'000'000)};
  ::syscall(SYS_futex, word, FUTEX_WAIT, expected, &relative, nullptr, 0);
}

void futex_bump_and_wake(std::uint32_t* word) {
  // Release: what the waker wrote before the bump is visible to a waiter that sees it.
  std::atomic_ref<std::uint32_t>(*word).fetch_add(1, std::memory_order_release);
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace tensorbucket::ipc
