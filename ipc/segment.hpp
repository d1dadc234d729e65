// Internal: one mapped POSIX shared-memory object, through Boost.Interprocess.
#pragma once

#include <sys/types.h>

#include <boost/interprocess/mapped_region.hpp>

#include <cstddef>
#include <optional>
#include <span>
#include <string>

#include "descriptor.hpp"
#include "fault_guard.hpp"

namespace tensorbucket::ipc {

class Segment {
 public:
  // Creates `name` exclusively (O_EXCL) with `mode` and `bytes` (zero-filled, all allocated
  // now), mapped read-write. ChannelExists when the name is taken, SystemError otherwise:
  // among others when `bytes` do not fit in the shared-memory filesystem.
  static Segment create(const std::string& name, std::size_t bytes, mode_t mode);

  // Maps an existing `name`; nullopt when it does not exist. PermissionDenied when another
  // user owns it or its mode forbids us; SystemError when it is smaller than `min_bytes`
  // (checked with fstat before mapping; a truncation after that is caught, see damaged()).
  static std::optional<Segment> open(const std::string& name, std::size_t min_bytes,
                                     bool writable);

  // Unlinks `name`; mappings stay valid until unmapped. Missing names are ignored.
  static void remove(const std::string& name) noexcept;

  std::byte* data() const noexcept { return static_cast<std::byte*>(region_.get_address()); }
  std::size_t size() const noexcept { return region_.get_size(); }
  std::span<std::byte> bytes() const noexcept { return {data(), size()}; }

  // The object's descriptor, open as long as this Segment, for locks on it (liveness.hpp).
  int descriptor() const noexcept { return descriptor_.get(); }

  // True while `name` names this object: neither unlinked nor replaced by another.
  bool named(const std::string& name) const;

  // True once another process truncated the object under this mapping (fault_guard.hpp):
  // some of it now reads as zeros, and writes to it reach nobody.
  bool damaged() const noexcept { return guard_.damaged(); }

 private:
  Segment(Descriptor descriptor, boost::interprocess::mapped_region region, bool writable);
  Descriptor descriptor_;
  boost::interprocess::mapped_region region_;
  GuardedRange guard_;  // declared last: unguarded before the region is unmapped
};

}  // namespace tensorbucket::ipc
