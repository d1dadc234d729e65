#include "segment.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>

#include "serialize/text.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::ipc {

namespace bip = boost::interprocess;
using text::fail;
using text::Quoted;

Segment Segment::create(const std::string& name, std::size_t bytes, mode_t mode) {
  try {
    bip::permissions permissions(static_cast<int>(mode));
    bip::shared_memory_object shm(bip::create_only, name.c_str(), bip::read_write, permissions);
    try {
      shm.truncate(static_cast<bip::offset_t>(bytes));
      return Segment(bip::mapped_region(shm, bip::read_write));
    } catch (...) {
      bip::shared_memory_object::remove(name.c_str());
      throw;
    }
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::already_exists_error) {
      fail(ErrorCode::ChannelExists, "shared memory ", Quoted{name}, " already exists");
    }
    fail(ErrorCode::SystemError, "cannot create shared memory ", Quoted{name}, " of ", bytes,
         " bytes: ", e.what());
  }
}

std::optional<Segment> Segment::open(const std::string& name, std::size_t min_bytes,
                                     bool writable) {
  auto mode = writable ? bip::read_write : bip::read_only;
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
    if (static_cast<std::size_t>(status.st_size) < min_bytes) {
      fail(ErrorCode::SystemError, "shared memory ", Quoted{name}, " has ", status.st_size,
           " bytes, fewer than the ", min_bytes, " it must hold");
    }
    return Segment(bip::mapped_region(shm, mode));
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::not_found_error) return std::nullopt;
    if (e.get_error_code() == bip::security_error) {
      fail(ErrorCode::PermissionDenied, "no permission to open shared memory ", Quoted{name});
    }
    fail(ErrorCode::SystemError, "cannot open shared memory ", Quoted{name}, ": ", e.what());
  }
}

void Segment::remove(const std::string& name) noexcept {
  bip::shared_memory_object::remove(name.c_str());
}

}  // namespace tensorbucket::ipc
