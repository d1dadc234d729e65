#include "ipc/os/segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>

#include <boost/interprocess/shared_memory_object.hpp>

#include "ipc/os/liveness.hpp"
#include "base/text.hpp"
#include "tensorbucket/error.hpp"
#include "ipc/test_hooks.hpp"

namespace tensorbucket::ipc {

namespace bip = boost::interprocess;
using text::fail;
using text::Quoted;

namespace {

// "40.1 MiB", for messages beside the exact byte count.
std::string in_units(std::uint64_t bytes) {
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes) / 1024;
  std::size_t unit = 0;
  for (; value >= 1024 && unit + 1 < std::size(units); ++unit) value /= 1024;
  char text[32];
  std::snprintf(text, sizeof text, "%.1f %s", value, units[unit]);
  return text;
}

// Sizes a new object and allocates all of its memory now. ftruncate alone leaves it sparse:
// a bucket larger than the shared-memory filesystem's free space then fails only while being
// written, with SIGBUS, or with the OOM killer when that filesystem is as large as the memory,
// and leaves a full filesystem behind. posix_fallocate fails instead, with nothing written.
void allocate_all(int fd, const std::string& name, std::size_t bytes) {
  struct statvfs filesystem {};
  // Checked first: tmpfs would fill up before refusing, and squeeze everyone else meanwhile. A
  // tmpfs without a size limit reports no blocks at all: nothing to check against.
  if (::fstatvfs(fd, &filesystem) == 0 && filesystem.f_blocks != 0) {
    auto free_bytes = static_cast<std::uint64_t>(filesystem.f_bavail) * filesystem.f_frsize;
    if (bytes > free_bytes) {
      fail(ErrorCode::SystemError, "shared memory ", Quoted{name}, " needs ", bytes, " bytes (",
           in_units(bytes), ") but its filesystem has ", free_bytes, " (", in_units(free_bytes), ") free");
    }
  }
  int error = 0;
  do {  // a signal interrupts tmpfs's allocation; it resumes where it stopped
    error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (error == EINTR);
  if (error != 0) {
    fail(ErrorCode::SystemError, "cannot allocate ", bytes, " bytes (", in_units(bytes),
         ") of shared memory for ", Quoted{name}, ": ", std::strerror(error));
  }
}

// Our own descriptor of the object, close-on-exec and kept from forked children.
Descriptor keep(const bip::shared_memory_object& shm, const std::string& name, const ForkPause& pause) {
  int fd = ::fcntl(shm.get_mapping_handle().handle, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    fail(ErrorCode::SystemError, "cannot keep a descriptor of shared memory ", Quoted{name}, ": ",
         std::strerror(errno));
  }
  return Descriptor(fd, pause);
}

// The object an open descriptor refers to; nullopt when fstat fails.
std::optional<ObjectId> id_of(int fd) {
  struct stat status {};
  if (::fstat(fd, &status) != 0) return std::nullopt;
  return ObjectId{status.st_dev, status.st_ino};
}

// Whether `name` names the object `ours`: lstat, which needs no descriptor (a process out of
// them must still unlink its own names) and never follows a link.
bool same_object(std::optional<ObjectId> ours, const std::string& name) {
  struct stat status {};
  return ours && ::lstat(("/dev/shm/" + name).c_str(), &status) == 0 &&
         ObjectId{status.st_dev, status.st_ino} == *ours;
}

}  // namespace

Segment::Segment(Descriptor descriptor, bip::mapped_region region, std::optional<ObjectId> id, bool writable,
                 Locks locks)
    : descriptor_(std::move(descriptor)),
      region_(std::move(region)),
      id_(id),
      guard_(region_.get_address(), region_.get_size(), writable, locks == Locks::kNone) {}

bool Segment::named(const std::string& name) const { return same_object(id_, name); }

namespace {

// What a Locks::kKept segment needs kept from forked children, made while no fork can happen
// (ForkPause): Boost's descriptor, which shares the kept one's open file description, is
// closed by then, and the mapping, which references it too, is not inherited. The Segment
// itself (its GuardedRange) is made after the pause: forks take the guard's lock after ours.
struct Mapped {
  Descriptor descriptor;
  bip::mapped_region region;
  std::optional<ObjectId> id;
};

void keep_from_children(const bip::mapped_region& region) {
  if (region.get_size() != 0) ::madvise(region.get_address(), region.get_size(), MADV_DONTFORK);
}

}  // namespace

Segment Segment::create(const std::string& name, std::size_t bytes, mode_t mode, Locks locks) {
  auto mapped = [&] {
    std::optional<ForkPause> pause;
    if (locks == Locks::kKept) pause.emplace();
    try {
      bip::permissions permissions(static_cast<int>(mode));
      bip::shared_memory_object shm(bip::create_only, name.c_str(), bip::read_write, permissions);
      auto id = id_of(shm.get_mapping_handle().handle);
      Descriptor descriptor;
      if (pause) {
        descriptor = keep(shm, name, *pause);
        TENSORBUCKET_TEST_HOOK(before_producer_lock);
        if (!try_lock(descriptor.get(), kProducerLockByte)) {
          fail(ErrorCode::ChannelExists, "shared memory ", Quoted{name},
               " was taken by another producer while this one created it");
        }
      }
      try {
        allocate_all(shm.get_mapping_handle().handle, name, bytes);
        bip::mapped_region region(shm, bip::read_write);
        if (pause) keep_from_children(region);
        return Mapped{std::move(descriptor), std::move(region), id};
      } catch (...) {
        // Only what still names our object; holding its lock, nobody can replace it meanwhile.
        // Without locks the name is a slot's, which only the producer owning the channel makes.
        if (!pause || same_object(id, name)) bip::shared_memory_object::remove(name.c_str());
        throw;
      }
    } catch (const bip::interprocess_exception& e) {
      if (e.get_error_code() == bip::already_exists_error) {
        fail(ErrorCode::ChannelExists, "shared memory ", Quoted{name}, " already exists");
      }
      fail(ErrorCode::SystemError, "cannot create shared memory ", Quoted{name}, " of ", bytes,
           " bytes: ", e.what());
    }
  }();
  return Segment(std::move(mapped.descriptor), std::move(mapped.region), mapped.id, true, locks);
}

std::optional<Segment> Segment::open(const std::string& name, std::size_t min_bytes,
                                     bool writable, Locks locks) {
  auto mode = writable ? bip::read_write : bip::read_only;
  auto too_small = [&](std::uint64_t bytes) {
    if (bytes < min_bytes) {
      fail(ErrorCode::SystemError, "shared memory ", Quoted{name}, " has ", bytes,
           " bytes, fewer than the ", min_bytes, " it must hold");
    }
  };
  auto mapped = [&]() -> std::optional<Mapped> {
    std::optional<ForkPause> pause;  // see Mapped
    if (locks == Locks::kKept) pause.emplace();
    try {
      bip::shared_memory_object shm(bip::open_only, name.c_str(), mode);
      struct stat status {};
      if (::fstat(shm.get_mapping_handle().handle, &status) != 0) {
        fail(ErrorCode::SystemError, "cannot stat shared memory ", Quoted{name});
      }
      if (status.st_uid != ::geteuid()) {
        fail(ErrorCode::PermissionDenied, "shared memory ", Quoted{name}, " belongs to uid ",
             status.st_uid, ", not to us (uid ", ::geteuid(), ')');
      }
      too_small(static_cast<std::uint64_t>(status.st_size));
      auto descriptor = pause ? keep(shm, name, *pause) : Descriptor();
      // An object just created by a producer that has not sized it yet: nothing to map.
      ObjectId id{status.st_dev, status.st_ino};
      if (status.st_size == 0) return Mapped{std::move(descriptor), bip::mapped_region(), id};
      bip::mapped_region region(shm, mode);
      if (pause) keep_from_children(region);
      return Mapped{std::move(descriptor), std::move(region), id};
    } catch (const bip::interprocess_exception& e) {
      if (e.get_error_code() == bip::not_found_error) return std::nullopt;
      if (e.get_error_code() == bip::security_error) {
        fail(ErrorCode::PermissionDenied, "no permission to open shared memory ", Quoted{name});
      }
      if (e.get_native_error() == ELOOP) {  // shm_open opens with O_NOFOLLOW
        fail(ErrorCode::PermissionDenied, "shared memory ", Quoted{name},
             " is a symbolic link, which is never followed: remove it or use another channel name");
      }
      fail(ErrorCode::SystemError, "cannot open shared memory ", Quoted{name}, ": ", e.what());
    }
  }();
  if (!mapped) return std::nullopt;
  Segment segment(std::move(mapped->descriptor), std::move(mapped->region), mapped->id, writable, locks);
  too_small(segment.size());  // mapped at its size then, which may have shrunk since fstat
  return segment;
}

namespace {

// Who `name` belongs to, as /dev/shm (POSIX shared memory on Linux) says: nullopt when it does
// not exist. lstat, so that a link is seen as one, never followed.
std::optional<struct stat> shm_status(const std::string& name) {
  struct stat status {};
  if (::lstat(("/dev/shm/" + name).c_str(), &status) != 0) return std::nullopt;
  return status;
}

bool ours(const struct stat& status) { return !S_ISLNK(status.st_mode) && status.st_uid == ::geteuid(); }

}  // namespace

void Segment::remove(const std::string& name) noexcept {
  bip::shared_memory_object::remove(name.c_str());
}

bool Segment::remove_if_ours(const std::string& name) noexcept {
  auto status = shm_status(name);
  if (status && !ours(*status)) return false;
  bip::shared_memory_object::remove(name.c_str());
  return true;
}

void Segment::remove_leftover(const std::string& name) {
  auto status = shm_status(name);
  if (!status) return;
  if (S_ISLNK(status->st_mode)) {
    fail(ErrorCode::PermissionDenied, "shared memory ", Quoted{name},
         " is a symbolic link, which is never followed: remove it or use another channel name");
  }
  if (status->st_uid != ::geteuid()) {
    fail(ErrorCode::PermissionDenied, "shared memory ", Quoted{name}, " belongs to uid ", status->st_uid,
         ", not to us (uid ", ::geteuid(), "): it is left alone; remove it or use another channel name");
  }
  bip::shared_memory_object::remove(name.c_str());
}

}  // namespace tensorbucket::ipc
