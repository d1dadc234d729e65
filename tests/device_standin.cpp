#include "device_standin.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "serialize/block_hash.hpp"

namespace tensorbucket::test {

namespace {

constexpr int kInvalidValue = 1;     // CUDA_ERROR_INVALID_VALUE
constexpr int kInvalidDevice = 101;  // CUDA_ERROR_INVALID_DEVICE
constexpr int kInvalidContext = 201;  // CUDA_ERROR_INVALID_CONTEXT
constexpr int kInvalidHandle = 400;  // CUDA_ERROR_INVALID_HANDLE
constexpr std::uint32_t kMemoryMagic = 0x4D495354;  // what our memory handles start with
constexpr std::uint32_t kEventMagic = 0x45495354;   // and our event handles

struct Mapping {
  int fd;  // -1 for an import
  std::uint64_t bytes;
};
struct Event {
  std::uint64_t id;
};

std::mutex mutex;
std::map<ipc::DeviceAddress, Mapping> mappings;
std::vector<StandIn::Operation> operations_asked;
std::uint64_t events_made = 0;

bool injected(const char* call) {
  if (StandIn::fail_next == nullptr || std::strcmp(StandIn::fail_next, call) != 0) return false;
  StandIn::fail_next = nullptr;
  return true;
}

int device_count(int* count) {
  *count = static_cast<int>(StandIn::devices.size());
  return 0;
}

int device_uuid(int ordinal, ipc::DeviceUuid* uuid) {
  if (ordinal < 0 || ordinal >= static_cast<int>(StandIn::devices.size())) return kInvalidDevice;
  *uuid = StandIn::devices[ordinal];
  return 0;
}

int enter(int ordinal) {
  return ordinal >= 0 && ordinal < static_cast<int>(StandIn::devices.size()) ? 0 : kInvalidDevice;
}
int leave() { return 0; }

int allocate(ipc::DeviceAddress* address, std::uint64_t bytes) {
  if (injected("allocate")) return StandIn::kInjectedError;
  if (bytes == 0) return kInvalidValue;  // as the driver's cuMemAlloc
  int fd = ::memfd_create("tensorbucket-standin", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return kInvalidValue;
  void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (memory == MAP_FAILED) return kInvalidValue;
  *address = reinterpret_cast<ipc::DeviceAddress>(memory);
  std::lock_guard lock(mutex);
  mappings[*address] = {fd, bytes};
  ++StandIn::allocations;
  return 0;
}

int release(ipc::DeviceAddress address) {
  std::lock_guard lock(mutex);
  auto found = mappings.find(address);
  if (found == mappings.end() || found->second.fd < 0) return kInvalidValue;
  ::munmap(reinterpret_cast<void*>(address), found->second.bytes);
  ::close(found->second.fd);
  mappings.erase(found);
  ++StandIn::frees;
  return 0;
}

// A memory handle: magic, pid, fd, size.
int export_memory(ipc::DeviceHandle* handle, ipc::DeviceAddress address) {
  std::lock_guard lock(mutex);
  auto found = mappings.find(address);
  if (found == mappings.end()) return kInvalidValue;
  handle->bytes = {};
  std::uint32_t fields[2] = {kMemoryMagic, static_cast<std::uint32_t>(::getpid())};
  std::memcpy(handle->bytes.data(), fields, sizeof fields);
  std::memcpy(handle->bytes.data() + 8, &found->second.fd, sizeof(int));
  return 0;
}

int import_memory(ipc::DeviceAddress* address, std::uint64_t* bytes, const ipc::DeviceHandle& handle) {
  if (injected("import_memory")) return StandIn::kInjectedError;
  std::uint32_t fields[2];
  int fd = -1;
  std::memcpy(fields, handle.bytes.data(), sizeof fields);
  std::memcpy(&fd, handle.bytes.data() + 8, sizeof(int));
  if (fields[0] != kMemoryMagic) return kInvalidHandle;
  // As the driver: a process cannot import what it exported itself.
  if (fields[1] == static_cast<std::uint32_t>(::getpid())) return kInvalidContext;
  auto path = "/proc/" + std::to_string(fields[1]) + "/fd/" + std::to_string(fd);
  int opened = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (opened < 0) return kInvalidHandle;
  struct stat status {};
  ::fstat(opened, &status);
  auto size = static_cast<std::uint64_t>(status.st_size);
  void* memory = size == 0 ? MAP_FAILED : ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
  ::close(opened);
  if (memory == MAP_FAILED) return kInvalidHandle;
  *address = reinterpret_cast<ipc::DeviceAddress>(memory);
  *bytes = size;
  std::lock_guard lock(mutex);
  mappings[*address] = {-1, size};
  ++StandIn::memory_imports;
  return 0;
}

int close_memory(ipc::DeviceAddress address) {
  std::lock_guard lock(mutex);
  auto found = mappings.find(address);
  if (found == mappings.end() || found->second.fd >= 0) return kInvalidValue;
  ::munmap(reinterpret_cast<void*>(address), found->second.bytes);
  mappings.erase(found);
  ++StandIn::memory_closes;
  return 0;
}

int create_event(ipc::DeviceEvent* event) {
  std::lock_guard lock(mutex);
  *event = new Event{static_cast<std::uint64_t>(::getpid()) << 32 | ++events_made};
  return 0;
}

int export_event(ipc::DeviceHandle* handle, ipc::DeviceEvent event) {
  handle->bytes = {};
  std::memcpy(handle->bytes.data(), &kEventMagic, sizeof kEventMagic);
  std::memcpy(handle->bytes.data() + 8, &static_cast<Event*>(event)->id, sizeof(std::uint64_t));
  return 0;
}

int import_event(ipc::DeviceEvent* event, const ipc::DeviceHandle& handle) {
  auto id = StandIn::event_id(handle);
  if (id == 0) return kInvalidHandle;
  if (id >> 32 == static_cast<std::uint64_t>(::getpid())) return kInvalidContext;
  *event = new Event{id};
  ++StandIn::event_imports;
  return 0;
}

int destroy_event(ipc::DeviceEvent event) {
  delete static_cast<Event*>(event);
  return 0;
}

int record_event(ipc::DeviceEvent event, ipc::DeviceStream) {
  if (injected("record_event")) return StandIn::kInjectedError;
  std::lock_guard lock(mutex);
  operations_asked.push_back({'r', static_cast<Event*>(event)->id});
  return 0;
}

int wait_event(ipc::DeviceStream, ipc::DeviceEvent event) {
  std::lock_guard lock(mutex);
  operations_asked.push_back({'w', static_cast<Event*>(event)->id});
  return 0;
}

int copy(const ipc::DeviceCopy* batch, std::size_t count, ipc::DeviceStream) {
  if (injected("copy")) return StandIn::kInjectedError;
  if (count > 1 && StandIn::refuse_batches != 0) return StandIn::refuse_batches;
  for (std::size_t i = 0; i < count; ++i) {
    std::memcpy(reinterpret_cast<void*>(batch[i].to), reinterpret_cast<const void*>(batch[i].from), batch[i].bytes);
  }
  ++StandIn::copy_calls;
  StandIn::copies += static_cast<int>(count);
  std::lock_guard lock(mutex);
  operations_asked.push_back({'c', count});
  return 0;
}

int zero(ipc::DeviceAddress address, std::uint64_t bytes, ipc::DeviceStream) {
  std::memset(reinterpret_cast<void*>(address), 0, bytes);
  return 0;
}

int synchronize(ipc::DeviceStream) { return 0; }
int synchronize_event(ipc::DeviceEvent) {
  if (StandIn::on_event_wait) StandIn::on_event_wait();
  return 0;
}
int synchronize_context() { return 0; }

int hash_blocks(ipc::DeviceAddress payload, std::uint64_t bytes, ipc::DeviceAddress hashes, ipc::DeviceStream) {
  const auto* data = reinterpret_cast<const std::byte*>(payload);
  auto* out = reinterpret_cast<std::uint64_t*>(hashes);
  for (std::uint64_t b = 0; b < block_hash::blocks_in(bytes); ++b) {
    auto start = b * block_hash::kHashBlockBytes;
    out[b] = block_hash::hash_of_block({data + start, std::min(block_hash::kHashBlockBytes, bytes - start)}, b);
  }
  ++StandIn::kernel_launches;
  return 0;
}

const char* error_name(int code) {
  switch (code) {
    case kInvalidValue: return "CUDA_ERROR_INVALID_VALUE";
    case kInvalidDevice: return "CUDA_ERROR_INVALID_DEVICE";
    case kInvalidHandle: return "CUDA_ERROR_INVALID_HANDLE";
    case kInvalidContext: return "CUDA_ERROR_INVALID_CONTEXT";
    case StandIn::kInjectedError: return "STANDIN_INJECTED_ERROR";
    default: return "unknown";
  }
}

constexpr ipc::DeviceApi kStandIn{
    "the host stand-in", device_count, device_uuid,   enter,        leave,        allocate,
    release,            export_memory, import_memory, close_memory, create_event, export_event,
    import_event,       destroy_event, record_event,  wait_event,   copy,         zero,
    synchronize,        synchronize_event, synchronize_context, hash_blocks, error_name,
};

}  // namespace

std::vector<StandIn::Operation> StandIn::operations() {
  std::lock_guard lock(mutex);
  return operations_asked;
}

namespace {
std::vector<std::uint64_t> ids_of(char kind) {
  std::vector<std::uint64_t> ids;
  for (const auto& operation : StandIn::operations()) {
    if (operation.kind == kind) ids.push_back(operation.value);
  }
  return ids;
}
}  // namespace

std::vector<std::uint64_t> StandIn::recorded() { return ids_of('r'); }
std::vector<std::uint64_t> StandIn::waited() { return ids_of('w'); }

std::uint64_t StandIn::event_id(const ipc::DeviceHandle& handle) {
  std::uint32_t magic = 0;
  std::uint64_t id = 0;
  std::memcpy(&magic, handle.bytes.data(), sizeof magic);
  std::memcpy(&id, handle.bytes.data() + 8, sizeof id);
  return magic == kEventMagic ? id : 0;
}

void StandIn::install() { ipc::install_device_api(&kStandIn); }
void StandIn::uninstall() { ipc::install_device_api(nullptr); }

void StandIn::reset_counts() {
  for (auto* count : {&memory_imports, &memory_closes, &allocations, &frees, &event_imports, &copy_calls, &copies,
                      &kernel_launches}) {
    *count = 0;
  }
  fail_next = nullptr;
  refuse_batches = 0;
  on_event_wait = nullptr;
  std::lock_guard lock(mutex);
  operations_asked.clear();
}

}  // namespace tensorbucket::test
