// Internal: who is alive, as the kernel knows it.
//
// Each live party of a channel holds a write lock on one byte of the control segment: byte 0
// the producer, byte 1 + r the consumer of record r. These are open file description locks
// (F_OFD_SETLK): the kernel drops one when the last descriptor of its open file description
// closes, so when its process dies, however it dies. Unlike pids, they need no /proc, cannot
// be confused by a reused pid, and hold across pid namespaces; unlike classic POSIX locks,
// they belong to one descriptor, not to the whole process, so a producer and its consumers
// may live in one process, and closing some other descriptor of the file drops nothing.
// A forked child does not keep them (descriptor.hpp).
#pragma once

#include "base/private.hpp"

#include <sys/types.h>

#include <cstdint>

namespace tensorbucket::ipc {

inline constexpr off_t kProducerLockByte = 0;
constexpr off_t consumer_lock_byte(std::uint32_t record) { return 1 + static_cast<off_t>(record); }
// Held by whoever removes a dead producer's channel (leftovers.hpp), from before it takes the
// producer's byte until after it let go of it: a producer's byte held while this one is free
// is the producer's own. Past every consumer's byte (control.hpp checks).
inline constexpr off_t kRemoverLockByte = 1 + 64;

// Takes the lock on `byte` through `fd` (open for writing); false when another open file
// description holds it. SystemError when the kernel refuses otherwise.
bool try_lock(int fd, off_t byte);
void unlock(int fd, off_t byte) noexcept;

// Whether an open file description other than `fd`'s holds `byte`: whether its owner lives.
// When the kernel cannot answer, the answer is true: "cannot tell" is never "dead".
bool held_by_other(int fd, off_t byte) noexcept;

}  // namespace tensorbucket::ipc
