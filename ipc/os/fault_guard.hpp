// Internal: surviving a peer that truncates a shared-memory object we have mapped.
//
// Any process of our uid can ftruncate a segment after we mapped it (tmpfs objects cannot be
// sealed, and fstat before mapping cannot stop a later truncation). Touching a page past the
// new end then raises SIGBUS, which kills the process. So each mapping is a GuardedRange: a
// SIGBUS handler, installed with the first one, maps private zero pages over the rest of the
// range that faulted and marks it damaged. The access then completes (a read sees zeros, a
// write lands where nobody sees it) and the library, which checks the mark before it hands
// data on (before publishing, after verifying), reports the damage as an error. Faults outside
// every guarded range go on to the handler that was installed before ours.
#pragma once

#include "base/private.hpp"

#include <cstddef>

namespace tensorbucket::ipc {

class GuardedRange {
 public:
  GuardedRange() = default;
  // Guards [begin, begin + bytes), mapped readable, and writable when `writable`. A range not
  // `inherited` by forked children (MADV_DONTFORK) is forgotten in them. A process guards up to
  // 1024 ranges at once; past that a range is left unguarded, as before.
  GuardedRange(void* begin, std::size_t bytes, bool writable, bool inherited) noexcept;
  GuardedRange(GuardedRange&& other) noexcept;
  GuardedRange& operator=(GuardedRange&& other) noexcept;
  ~GuardedRange();  // must run before the range is unmapped

  // True once a fault in the range was caught: part of it is no longer the shared object.
  bool damaged() const noexcept;

 private:
  void reset() noexcept;
  int index_ = -1;
};

}  // namespace tensorbucket::ipc
