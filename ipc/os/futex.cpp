#include "ipc/os/futex.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>

namespace tensorbucket::ipc {

namespace {
std::atomic_ref<std::uint32_t> sleepers(WaitWord& word) {
  return std::atomic_ref<std::uint32_t>(word.sleepers);
}
}  // namespace

// Not FUTEX_PRIVATE_FLAG: the word lives in memory shared between processes.
//
// No wake is lost: the waiter counts itself (seq_cst) before the kernel compares the value,
// and the waker bumps the value (seq_cst) before it reads the count. Either the waker sees
// the count and makes the call, or the waiter's comparison sees the new value and returns.
void futex_wait(WaitWord& word, std::uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout <= std::chrono::nanoseconds::zero()) return;
  timespec relative{static_cast<time_t>(timeout.count() / 1'000'000'000),
                    static_cast<long>(timeout.count() % 1'000'000'000)};
  sleepers(word).fetch_add(1, std::memory_order_seq_cst);
  ::syscall(SYS_futex, &word.value, FUTEX_WAIT, expected, &relative, nullptr, 0);
  sleepers(word).fetch_sub(1, std::memory_order_seq_cst);
}

void futex_bump_and_wake(WaitWord& word) {
  // Release (in seq_cst): what the waker wrote before the bump is visible to a waiter that
  // sees it.
  std::atomic_ref<std::uint32_t>(word.value).fetch_add(1, std::memory_order_seq_cst);
  if (sleepers(word).load(std::memory_order_seq_cst) == 0) return;
  ::syscall(SYS_futex, &word.value, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace tensorbucket::ipc
