#include "slot_storage.hpp"

#include <algorithm>
#include <cstring>
#include <atomic>
#include <map>
#include <mutex>

#include "ipc/os/process.hpp"
#include "base/text.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::ipc {

using text::fail;
using text::Quoted;

namespace {

constexpr std::uint64_t kPageBytes = 4096;
// A device payload takes whole pages of the driver's allocation granularity (2 MiB): smaller
// cuMemAlloc blocks share a page with other allocations (other slots, the producer's own
// tensors), and what an importer of one block of a shared page may map or see through
// cuMemGetAddressRange is not something any user of CUDA IPC we know of relies on. A slot's
// own pages keep "an import cannot reach past its block" plainly true.
constexpr std::uint64_t kDevicePageBytes = 2 << 20;
constexpr std::uint64_t kMinFrameCapacity = 64 * 1024;

std::uint64_t round_up(std::uint64_t bytes, std::uint64_t to) { return (bytes + to - 1) / to * to; }

Segment create_segment(const std::string& name, std::uint64_t bytes, mode_t mode) {
  try {
    return Segment::create(name, bytes, mode);
  } catch (const Error& e) {
    // A dead producer's leftover the stale cleanup missed: the name is ours now, if the object
    // is (PermissionDenied when it is another user's).
    if (e.code() != ErrorCode::ChannelExists) throw;
    Segment::remove_leftover(name);
    return Segment::create(name, bytes, mode);
  }
}

}  // namespace

// One epoch's device allocation, exported once, and the slot's ready event (pooled: see
// take_event()). Shared with consumers in this process, which use it directly.
struct SlotStorage::Device {
  int ordinal;
  DeviceUuid uuid{};
  DeviceAddress address = 0;
  std::uint64_t capacity = 0;
  DeviceHandle memory{};
  PooledEvent ready;
  Owner owner;  // a forked child must not free its parent's device memory

  Device(int device_ordinal, std::uint64_t bytes) : ordinal(device_ordinal), capacity(bytes) {
    uuid = device_uuid(ordinal);
    const auto& api = device_api();
    DeviceScope scope(ordinal);
    try {
      check_device(api.allocate(&address, bytes), "cuMemAlloc");
      // Zeroed once, so that no bytes of an earlier user of the memory travel in the padding
      // between entries (the producer zeroes the padding again when a layout changes).
      check_device(api.zero(address, bytes, nullptr), "cuMemsetD8Async");
      check_device(api.synchronize(nullptr), "cuStreamSynchronize");
      check_device(api.export_memory(&memory, address), "cuIpcGetMemHandle");
      ready = take_event(ordinal);
    } catch (...) {
      free();
      throw;
    }
  }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ~Device() {
    if (owner.forked()) return;
    try {
      DeviceScope scope(ordinal);
      // Our own copies into it may still run; consumers' imports keep the memory (the
      // driver frees it when the last importer closes).
      device_api().synchronize_context();
      free();
    } catch (const Error&) {
      // The context is gone (the driver shutting down): so is the memory.
    }
  }
  void free() noexcept {
    if (address != 0) device_api().release(address);
    if (ready.event != nullptr) give_back_event(ordinal, ready);
    address = 0;
    ready = {};
  }
};

namespace {

using HandleBytes = std::array<std::uint8_t, kDeviceHandleBytes>;

// The device memory this process exported, by handle, for consumers in this process: the
// driver does not import a process's own exports.
struct LocalExports {
  std::mutex mutex;
  Owner owner;
  std::map<HandleBytes, std::weak_ptr<const void>> devices;  // a SlotStorage::Device each

  // A forked child's copy names its parent's memory, which is not the child's to use: it is
  // forgotten, and the child's own exports are kept from then on.
  void forget_if_forked() {
    if (!owner.forked()) return;
    devices.clear();
    owner = Owner();
  }
  std::shared_ptr<const void> find(const HandleBytes& handle) {
    std::lock_guard lock(mutex);
    forget_if_forked();
    std::erase_if(devices, [](const auto& entry) { return entry.second.expired(); });
    auto found = devices.find(handle);
    return found == devices.end() ? nullptr : found->second.lock();
  }
  void add(const HandleBytes& handle, std::weak_ptr<const void> device) {
    std::lock_guard lock(mutex);
    forget_if_forked();
    devices[handle] = std::move(device);
  }
};

LocalExports& local_exports() {
  static auto* exports = new LocalExports;  // never destroyed: storages may outlive statics
  return *exports;
}

}  // namespace

Home home_of(PayloadLocation location) {
  if (location.on_host()) return {};
  if (location.device < 0) {
    fail(ErrorCode::InvalidArgument, "CUDA device ", location.device, " is not a device ordinal");
  }
  return {PayloadHome::kCuda, device_uuid(location.device)};
}

PayloadLocation location_of(const Home& home) {
  if (home.home == PayloadHome::kHost) return PayloadLocation::host();
  return PayloadLocation::cuda(device_ordinal(home.device));
}

SlotStorage::SlotStorage(std::string channel, std::uint32_t slot, mode_t mode, std::optional<int> device,
                         std::uint64_t incarnation)
    : channel_(std::move(channel)), slot_(slot), mode_(mode), ordinal_(device), epoch_(epoch_base(incarnation)) {}
SlotStorage::SlotStorage(SlotStorage&&) noexcept = default;
SlotStorage::~SlotStorage() = default;

bool SlotStorage::fit(std::uint64_t payload_bytes, std::uint64_t frame_bytes) {
  if (segment_ && !segment_->damaged() && payload_bytes <= payload_capacity_ && frame_bytes <= frame_capacity_) {
    return false;
  }
  // A device payload has one page at least: cuMemAlloc refuses 0 bytes, and a channel's first
  // bucket may be empty.
  auto page = ordinal_ ? kDevicePageBytes : kPageBytes;
  auto least = ordinal_ ? kDevicePageBytes : 0;
  auto payload_capacity = round_up(std::max({payload_bytes, payload_capacity_, least}), page);
  auto frame_capacity = round_up(std::max({frame_bytes, frame_capacity_, kMinFrameCapacity}), kPageBytes);
  auto epoch = epoch_ + 1;
  // New storage under a new epoch, all of it: consumers key what they imported by the epoch.
  std::shared_ptr<Device> device;
  if (ordinal_) {
    device = std::make_shared<Device>(*ordinal_, payload_capacity);
    local_exports().add(device->memory.bytes, device);
  }
  auto host_payload = ordinal_ ? 0 : payload_capacity;
  auto segment = create_segment(slot_segment_name(channel_, slot_, epoch), host_payload + frame_capacity, mode_);
  remove();
  segment_ = std::move(segment);
  device_ = std::move(device);
  epoch_ = epoch;
  payload_capacity_ = payload_capacity;
  frame_capacity_ = frame_capacity;
  return true;
}

std::span<std::byte> SlotStorage::frame() const noexcept {
  auto home = device_ ? PayloadHome::kCuda : PayloadHome::kHost;
  return segment_->bytes().subspan(frame_offset(home, payload_capacity_), frame_capacity_);
}

std::byte* SlotStorage::payload() const noexcept {
  return device_ ? reinterpret_cast<std::byte*>(device_->address) : segment_->data();
}

void SlotStorage::describe(SlotControl& shared, SlotDevice& device, std::uint64_t frame_bytes) const {
  atomic(shared.segment_epoch).store(epoch_, std::memory_order_relaxed);
  atomic(shared.segment_bytes).store(segment_->size(), std::memory_order_relaxed);
  atomic(shared.payload_capacity).store(payload_capacity_, std::memory_order_relaxed);
  atomic(shared.frame_bytes).store(frame_bytes, std::memory_order_relaxed);
  if (!device_) return;
  // Plain stores: a consumer reads these only after the generation's release store, and a
  // peer that scribbles on them meanwhile is what the consumer's checks are for.
  device.device = device_->uuid;
  device.epoch = epoch_;
  device.capacity = device_->capacity;
  device.memory = device_->memory;
  device.ready_event = device_->ready.handle;
}

void SlotStorage::record_ready(DeviceStream stream) const {
  if (!device_) return;
  DeviceScope scope(device_->ordinal);
  check_device(device_api().record_event(device_->ready.event, stream), "cuEventRecord");
}

void SlotStorage::remove() noexcept {
  if (!segment_) return;
  auto name = slot_segment_name(channel_, slot_, epoch_);
  if (segment_->named(name)) Segment::remove(name);
}

// A slot's payload as a consumer holds it: memory and ready event imported from another
// process, or, when the producer is this process, its own (kept alive by `local`).
struct ImportedPayload {
  int ordinal = -1;
  DeviceAddress address = 0;
  std::uint64_t bytes = 0;
  DeviceEvent ready = nullptr;
  bool imported_event = false;
  std::shared_ptr<const void> local;  // the producer's SlotStorage::Device, when in this process
  Owner owner;

  ImportedPayload() = default;
  ImportedPayload(const ImportedPayload&) = delete;
  ImportedPayload& operator=(const ImportedPayload&) = delete;
  ~ImportedPayload() {
    if (owner.forked()) return;
    try {
      DeviceScope scope(ordinal);
      const auto& api = device_api();
      // Work of ours that reads the memory may still run; closing does not wait for it.
      if (address != 0 || ready != nullptr) api.synchronize_context();
      if (imported_event) api.destroy_event(ready);
      if (!local && address != 0) api.close_memory(address);
    } catch (const Error&) {
      // The context is gone (the driver shutting down): so are the imports.
    }
  }
};

namespace {

// Imports of this process, by memory handle: every Subscriber of one producer in this process
// shares them (the driver maps a handle once per process), and the last holder closes them.
std::mutex imports_mutex;
std::map<HandleBytes, std::weak_ptr<const ImportedPayload>> imports;
std::atomic<std::uint64_t> imports_made{0};

std::shared_ptr<const ImportedPayload> import_payload(const SlotDevice& fields, int ordinal) {
  std::lock_guard lock(imports_mutex);
  std::erase_if(imports, [](const auto& entry) { return entry.second.expired(); });
  if (auto known = imports[fields.memory.bytes].lock()) return known;
  auto imported = std::make_shared<ImportedPayload>();
  imported->ordinal = ordinal;
  const auto& api = device_api();
  DeviceScope scope(ordinal);
  if (auto local = local_exports().find(fields.memory.bytes)) {
    const auto& device = *static_cast<const SlotStorage::Device*>(local.get());
    imported->address = device.address;
    imported->bytes = device.capacity;
    imported->ready = device.ready.event;
    imported->local = std::move(local);
  } else {
    check_device(api.import_memory(&imported->address, &imported->bytes, fields.memory), "cuIpcOpenMemHandle");
    ++imports_made;
    imported->ready = own_event(fields.ready_event);
    if (imported->ready == nullptr) {
      check_device(api.import_event(&imported->ready, fields.ready_event), "cuIpcOpenEventHandle");
      imported->imported_event = true;
    }
  }
  imports[fields.memory.bytes] = imported;
  return imported;
}

}  // namespace

std::size_t open_device_imports() {
  std::lock_guard lock(imports_mutex);
  return std::count_if(imports.begin(), imports.end(), [](const auto& entry) { return !entry.second.expired(); });
}

std::uint64_t device_imports_made() { return imports_made.load(); }

SlotReader::SlotReader(std::string channel, std::uint32_t slot, PayloadHome home, DeviceUuid device, int ordinal)
    : channel_(std::move(channel)), slot_(slot), home_(home), device_(device), ordinal_(ordinal) {}

std::optional<SlotMapping> SlotReader::map_frame(SlotControl& shared) {
  auto epoch = atomic(shared.segment_epoch).load(std::memory_order_relaxed);
  auto payload_capacity = atomic(shared.payload_capacity).load(std::memory_order_relaxed);
  return map_frame(shared, epoch, payload_capacity);
}

// With the fields the caller read once: what it checks and uses beside the frame.
std::optional<SlotMapping> SlotReader::map_frame(SlotControl& shared, std::uint64_t epoch,
                                                 std::uint64_t payload_capacity) {
  auto frame_bytes = atomic(shared.frame_bytes).load(std::memory_order_relaxed);
  if (!segment_ || epoch_ != epoch || segment_->damaged()) {
    segment_.reset();
    imported_.reset();
    auto segment = epoch == 0 ? std::nullopt : Segment::open(slot_segment_name(channel_, slot_, epoch), 0, false);
    if (!segment) return std::nullopt;
    segment_ = std::make_shared<Segment>(std::move(*segment));
    epoch_ = epoch;
  }
  auto size = segment_->size();
  auto offset = frame_offset(home_, payload_capacity);
  if (offset > size || frame_bytes > size - offset) {
    fail(ErrorCode::HeaderCorrupt, "slot ", slot_, " of channel ", Quoted{channel_}, " declares a ", frame_bytes,
         "-byte frame at byte ", offset, ", but its segment has ", size, " bytes");
  }
  return SlotMapping{segment_, nullptr, segment_->bytes().subspan(offset, frame_bytes), {}, nullptr, -1};
}

std::optional<SlotMapping> SlotReader::map(SlotControl& shared, SlotDevice& device) {
  auto epoch = atomic(shared.segment_epoch).load(std::memory_order_relaxed);
  auto payload_capacity = atomic(shared.payload_capacity).load(std::memory_order_relaxed);
  auto mapping = map_frame(shared, epoch, payload_capacity);
  if (!mapping) return std::nullopt;
  if (home_ == PayloadHome::kHost) {
    // The frame follows the payload: map_frame() checked where it starts against the segment.
    mapping->payload = segment_->bytes().first(payload_capacity);
    return mapping;
  }
  auto fields = device;  // one copy: what is checked is what is imported
  if (fields.epoch != epoch) {
    fail(ErrorCode::HeaderCorrupt, "slot ", slot_, " of channel ", Quoted{channel_}, " carries device handles of epoch ",
         fields.epoch, " for storage epoch ", epoch);
  }
  if (fields.device != device_) {
    fail(ErrorCode::HeaderCorrupt, "slot ", slot_, " of channel ", Quoted{channel_}, " names device ",
         describe(fields.device), ", not the channel's ", describe(device_));
  }
  // The handle as imported, compared every time (64 bytes): what a peer wrote there before
  // the import is replaced by the producer with the next bucket, and imported again then.
  if (!imported_ || imported_handle_ != fields.memory.bytes) {
    imported_.reset();
    imported_ = import_payload(fields, ordinal_);
    imported_handle_ = fields.memory.bytes;
  }
  // The size the driver gives for what it mapped, never one read from shared memory.
  mapping->imported = imported_;
  mapping->payload = {reinterpret_cast<const std::byte*>(imported_->address), imported_->bytes};
  mapping->ready = imported_->ready;
  mapping->device = imported_->ordinal;
  return mapping;
}

void SlotMapping::make_ready(const BucketView& view, bool check_payload_hash, DeviceStream stream,
                             std::uint64_t bucket) const {
  if (!imported) return;
  DeviceScope scope(device);
  check_device(device_api().wait_event(stream, ready), "cuStreamWaitEvent");
  auto expected = view.payload_checksum();
  if (!expected || !check_payload_hash) return;
  if (!expected->block_hash) {
    fail(ErrorCode::HeaderCorrupt, "bucket ", bucket, " on a device carries an xxh3-64 payload hash, not the block hash");
  }
  // Within the imported block: open() checked the payload's size against it.
  auto bytes = view.payload();
  auto hash = device_block_hash(device, reinterpret_cast<DeviceAddress>(bytes.data()), bytes.size(), stream);
  if (hash != expected->value) {
    fail(ErrorCode::ChecksumMismatch, "payload hash 0x", std::hex, hash, " of bucket ", std::dec, bucket,
         " does not match the header's 0x", std::hex, expected->value);
  }
}

void SlotMapping::wait_ready(DeviceStream stream) const {
  if (!imported) return;
  DeviceScope scope(device);
  check_device(device_api().synchronize(stream), "cuStreamSynchronize");
}

std::vector<std::byte> SlotMapping::copy_to_host(std::uint64_t bytes, DeviceStream stream) const {
  std::vector<std::byte> copy(bytes);
  if (!imported) {
    std::memcpy(copy.data(), payload.data(), bytes);
    return copy;
  }
  DeviceScope scope(device);
  const auto& api = device_api();
  DeviceCopy back{reinterpret_cast<DeviceAddress>(copy.data()), reinterpret_cast<DeviceAddress>(payload.data()), bytes};
  check_device(api.copy(&back, 1, stream), "cuMemcpyAsync");
  check_device(api.synchronize(stream), "cuStreamSynchronize");
  return copy;
}

}  // namespace tensorbucket::ipc
