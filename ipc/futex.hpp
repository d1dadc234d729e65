// Internal: waiting on a 32-bit word in shared memory. Waiters read the word, check their
// condition, then wait on the value they read: a wake between the check and the wait
// changes the word, so the kernel returns at once instead of losing the wake-up.
#pragma once

#include <chrono>
#include <cstdint>

namespace tensorbucket::ipc {

// Blocks while *word == expected, for at most `timeout`. May return early (a wake, a signal,
// a spurious return): callers re-check their condition in a loop.
void futex_wait(std::uint32_t* word, std::uint32_t expected, std::chrono::nanoseconds timeout);

// Bumps *word and wakes every process waiting on it.
void futex_bump_and_wake(std::uint32_t* word);

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
