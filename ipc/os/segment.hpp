// Internal: one mapped POSIX shared-memory object, through Boost.Interprocess.
#pragma once

#include "base/private.hpp"

#include <sys/types.h>

#include <boost/interprocess/mapped_region.hpp>

#include <cstddef>
#include <optional>
#include <span>
#include <string>

#include "ipc/os/descriptor.hpp"
#include "ipc/os/fault_guard.hpp"

namespace tensorbucket::ipc {

// Whether a segment carries liveness locks (liveness.hpp): the control segment does. Such a
// segment keeps a descriptor for the locks, and its mapping is not inherited by a forked
// child: a child's mapping would keep the open file description, and with it the parent's
// lock, alive after the parent died. The child's handles never touch it (they refuse).
enum class Locks : bool { kNone, kKept };

// A shared-memory object, as the filesystem names it.
struct ObjectId {
  dev_t device;
  ino_t inode;
  bool operator==(const ObjectId&) const = default;
};

class Segment {
 public:
  // Creates `name` exclusively (O_EXCL) with `mode` and `bytes` (zero-filled, all allocated
  // now), mapped read-write. ChannelExists when the name is taken, SystemError otherwise:
  // among others when `bytes` do not fit in the shared-memory filesystem. With Locks::kKept
  // the new object's byte 0 (the producer's, liveness.hpp) is locked before it is sized, so
  // that no other producer takes it for a dead one's, and a failure removes only the name
  // that still names it; ChannelExists when another producer took it first.
  static Segment create(const std::string& name, std::size_t bytes, mode_t mode,
                        Locks locks = Locks::kNone);

  // Maps an existing `name`; nullopt when it does not exist. PermissionDenied when another
  // user owns it, its mode forbids us, or it is a symbolic link (never followed); SystemError
  // when it, or the mapping made of it, is smaller than `min_bytes` (a truncation after that
  // is caught, see damaged()).
  static std::optional<Segment> open(const std::string& name, std::size_t min_bytes,
                                     bool writable, Locks locks = Locks::kNone);

  // Unlinks `name`; mappings stay valid until unmapped. Missing names are ignored. For names
  // this process made.
  static void remove(const std::string& name) noexcept;
  // Unlinks a leftover of another process when it is ours (our uid's, not a symbolic link),
  // and leaves another user's object alone: a producer running as root must not remove what
  // belongs to someone else. remove_leftover() says so (PermissionDenied, naming the owner),
  // for a leftover in the way of a name we create; remove_if_ours() returns false.
  static void remove_leftover(const std::string& name);
  static bool remove_if_ours(const std::string& name) noexcept;

  std::byte* data() const noexcept { return static_cast<std::byte*>(region_.get_address()); }
  std::size_t size() const noexcept { return region_.get_size(); }
  std::span<std::byte> bytes() const noexcept { return {data(), size()}; }

  // With Locks::kKept, the object's descriptor, open as long as this Segment, for locks on
  // it (liveness.hpp); -1 otherwise.
  int descriptor() const noexcept { return descriptor_.get(); }

  // True while `name` names this object: neither unlinked nor replaced.
  bool named(const std::string& name) const;

  // True once another process truncated the object under this mapping (fault_guard.hpp):
  // some of it now reads as zeros, and writes to it reach nobody.
  bool damaged() const noexcept { return guard_.damaged(); }

 private:
  Segment(Descriptor descriptor, boost::interprocess::mapped_region region, std::optional<ObjectId> id,
          bool writable, Locks locks);
  Descriptor descriptor_;
  boost::interprocess::mapped_region region_;
  std::optional<ObjectId> id_;  // the object mapped, as it was when created or opened
  GuardedRange guard_;  // declared last: unguarded before the region is unmapped
};

}  // namespace tensorbucket::ipc
