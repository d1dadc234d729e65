#include "ipc/os/liveness.hpp"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "base/text.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::ipc {
namespace {

struct flock one_byte(short type, off_t byte) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = byte;
  lock.l_len = 1;
  return lock;  // l_pid stays 0, as open file description locks require
}

}  // namespace

bool try_lock(int fd, off_t byte) {
  auto lock = one_byte(F_WRLCK, byte);
  while (::fcntl(fd, F_OFD_SETLK, &lock) != 0) {
    if (errno == EAGAIN || errno == EACCES) return false;
    if (errno != EINTR) {
      text::fail(ErrorCode::SystemError, "cannot lock byte ", byte, " of a control segment: ",
                 std::strerror(errno));
    }
  }
  return true;
}

void unlock(int fd, off_t byte) noexcept {
  auto lock = one_byte(F_UNLCK, byte);
  ::fcntl(fd, F_OFD_SETLK, &lock);
}

bool held_by_other(int fd, off_t byte) noexcept {
  // A read lock conflicts with the write lock a live party holds, and may be asked about
  // through a descriptor open for reading only (tbucket inspect's).
  auto lock = one_byte(F_RDLCK, byte);
  if (::fcntl(fd, F_OFD_GETLK, &lock) != 0) return true;
  return lock.l_type != F_UNLCK;
}

}  // namespace tensorbucket::ipc
