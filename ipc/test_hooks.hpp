// Internal: places where a test can stop a process inside a protocol window, to check that
// the window is safe wherever it is stopped. Compiled only into the test builds of the
// library (tests/meson.build defines TENSORBUCKET_TEST_HOOKS); elsewhere they are nothing.
#pragma once

#include "base/private.hpp"

#ifdef TENSORBUCKET_TEST_HOOKS
#include <functional>

namespace tensorbucket::ipc::test_hooks {
// Subscriber::attach, holding its record's lock byte, before it claims the record.
inline std::function<void()> before_claim;
// Subscriber::attach, right after it claimed its record, before it chose where to start.
inline std::function<void()> after_claim;
// Segment::create of a control segment, after creating the object, before locking it.
inline std::function<void()> before_producer_lock;
}  // namespace tensorbucket::ipc::test_hooks

#define TENSORBUCKET_TEST_HOOK(name) \
  if (::tensorbucket::ipc::test_hooks::name) ::tensorbucket::ipc::test_hooks::name()
#else
#define TENSORBUCKET_TEST_HOOK(name) static_cast<void>(0)
#endif
