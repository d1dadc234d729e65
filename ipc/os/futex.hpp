// Internal: waiting on a word in shared memory. Waiters read the word, check their condition,
// then wait on the value they read: a wake between the check and the wait changes the word,
// so the kernel returns at once instead of losing the wake-up.
#pragma once

#include "base/private.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>

namespace tensorbucket::ipc {

// A futex word and a count of the threads asleep on it. Waking costs a system call, ~1 µs
// here and several when it has someone to wake, and most wakes find nobody asleep, because
// waiters spin first: a waker skips the call while the count is zero. A waiter killed while
// asleep leaves the count high, which only costs wakers their system call again.
struct WaitWord {
  std::uint32_t value;     // bumped by every wake
  std::uint32_t sleepers;  // threads inside futex_wait() on it
};

// The value to pass to futex_wait() after checking the condition.
inline std::uint32_t wake_count(WaitWord& word) {
  return std::atomic_ref<std::uint32_t>(word.value).load(std::memory_order_acquire);
}

// Blocks while word.value == expected, for at most `timeout`. May return early (a wake, a
// signal, a spurious return): callers re-check their condition in a loop.
void futex_wait(WaitWord& word, std::uint32_t expected, std::chrono::nanoseconds timeout);

// Bumps word.value and wakes every thread waiting on it.
void futex_bump_and_wake(WaitWord& word);

// One turn of a spin loop: tells the core we are waiting, which frees its sibling
// hyper-thread and saves power.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace tensorbucket::ipc
