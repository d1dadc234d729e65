#include "slot_storage.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "process.hpp"
#include "serialize/text.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::ipc {

using text::fail;
using text::Quoted;

namespace {

constexpr std::uint64_t kPageBytes = 4096;
constexpr std::uint64_t kMinFrameCapacity = 64 * 1024;

std::uint64_t round_up(std::uint64_t bytes, std::uint64_t to) { return (bytes + to - 1) / to * to; }

Segment create_segment(const std::string& name, std::uint64_t bytes, mode_t mode) {
  try {
    return Segment::create(name, bytes, mode);
  } catch (const Error& e) {
    // A dead producer's leftover the stale cleanup missed: the name is ours now.
    if (e.code() != ErrorCode::ChannelExists) throw;
    Segment::remove(name);
    return Segment::create(name, bytes, mode);
  }
}

}  // namespace

// One epoch's device allocation and ready event, exported once.
struct SlotStorage::Device {
  int ordinal;
  DeviceUuid uuid{};
  DeviceAddress address = 0;
  std::uint64_t capacity = 0;
  DeviceHandle memory{};
  DeviceEvent ready = nullptr;
  DeviceHandle ready_handle{};
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
      check_device(api.create_event(&ready), "cuEventCreate");
      check_device(api.export_event(&ready_handle, ready), "cuIpcGetEventHandle");
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
      free();
    } catch (const Error&) {
      // The context is gone (the driver shutting down): so is the memory.
    }
  }
  // Memory a consumer still has open stays allocated until it closes it: freeing here never
  // pulls bytes from under a reader.
  void free() noexcept {
    const auto& api = device_api();
    if (ready != nullptr) api.destroy_event(ready);
    if (address != 0) api.release(address);
    ready = nullptr;
    address = 0;
  }
};

SlotStorage::SlotStorage(std::string channel, std::uint32_t slot, mode_t mode, std::optional<int> device)
    : channel_(std::move(channel)), slot_(slot), mode_(mode), ordinal_(device) {}
SlotStorage::SlotStorage(SlotStorage&&) noexcept = default;
SlotStorage::~SlotStorage() = default;

bool SlotStorage::fit(std::uint64_t payload_bytes, std::uint64_t frame_bytes) {
  if (segment_ && !segment_->damaged() && payload_bytes <= payload_capacity_ && frame_bytes <= frame_capacity_) {
    return false;
  }
  auto payload_capacity = round_up(std::max(payload_bytes, payload_capacity_), kPageBytes);
  auto frame_capacity = round_up(std::max({frame_bytes, frame_capacity_, kMinFrameCapacity}), kPageBytes);
  auto epoch = epoch_ + 1;
  // New storage under a new epoch, all of it: consumers key what they imported by the epoch.
  std::unique_ptr<Device> device;
  if (ordinal_) device = std::make_unique<Device>(*ordinal_, payload_capacity);
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
  device.ready_event = device_->ready_handle;
}

void SlotStorage::record_ready(DeviceStream stream) const {
  if (!device_) return;
  DeviceScope scope(device_->ordinal);
  check_device(device_api().record_event(device_->ready, stream), "cuEventRecord");
}

void SlotStorage::remove() noexcept {
  if (epoch_ != 0) Segment::remove(slot_segment_name(channel_, slot_, epoch_));
}

struct ImportedPayload {
  int ordinal = -1;
  DeviceAddress address = 0;
  std::uint64_t bytes = 0;
  DeviceEvent ready = nullptr;
  Owner owner;

  ImportedPayload() = default;
  ImportedPayload(const ImportedPayload&) = delete;
  ImportedPayload& operator=(const ImportedPayload&) = delete;
  ~ImportedPayload() {
    if (owner.forked()) return;
    try {
      DeviceScope scope(ordinal);
      const auto& api = device_api();
      if (ready != nullptr) api.destroy_event(ready);
      if (address != 0) api.close_memory(address);
    } catch (const Error&) {
      // The context is gone (the driver shutting down): so are the imports.
    }
  }
};

namespace {

// Imports of this process, by (producer incarnation, slot, epoch): every Subscriber of one
// producer's channel in this process shares them, and the last holder closes them.
struct ImportKey {
  std::uint64_t incarnation;
  std::uint32_t slot;
  std::uint64_t epoch;
  friend auto operator<=>(const ImportKey&, const ImportKey&) = default;
};
std::mutex imports_mutex;
std::map<ImportKey, std::weak_ptr<const ImportedPayload>> imports;

std::shared_ptr<const ImportedPayload> import_payload(const ImportKey& key, const SlotDevice& fields) {
  std::lock_guard lock(imports_mutex);
  std::erase_if(imports, [](const auto& entry) { return entry.second.expired(); });
  if (auto known = imports[key].lock()) return known;
  auto imported = std::make_shared<ImportedPayload>();
  imported->ordinal = device_ordinal(fields.device);
  const auto& api = device_api();
  DeviceScope scope(imported->ordinal);
  check_device(api.import_memory(&imported->address, &imported->bytes, fields.memory), "cuIpcOpenMemHandle");
  check_device(api.import_event(&imported->ready, fields.ready_event), "cuIpcOpenEventHandle");
  imports[key] = imported;
  return imported;
}

}  // namespace

std::size_t open_device_imports() {
  std::lock_guard lock(imports_mutex);
  return std::count_if(imports.begin(), imports.end(), [](const auto& entry) { return !entry.second.expired(); });
}

SlotReader::SlotReader(std::string channel, std::uint32_t slot, PayloadHome home, std::uint64_t incarnation)
    : channel_(std::move(channel)), slot_(slot), home_(home), incarnation_(incarnation) {}

std::optional<SlotMapping> SlotReader::map(SlotControl& shared, SlotDevice& device) {
  auto epoch = atomic(shared.segment_epoch).load(std::memory_order_relaxed);
  auto payload_capacity = atomic(shared.payload_capacity).load(std::memory_order_relaxed);
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
  SlotMapping mapping{segment_, nullptr, segment_->bytes().subspan(offset, frame_bytes), {}, nullptr, -1};
  if (home_ == PayloadHome::kHost) {
    mapping.payload = segment_->bytes().first(payload_capacity);
    return mapping;
  }
  if (!imported_) {
    auto fields = device;  // one copy: what is checked is what is imported
    if (fields.epoch != epoch) {
      fail(ErrorCode::HeaderCorrupt, "slot ", slot_, " of channel ", Quoted{channel_}, " carries device handles of epoch ",
           fields.epoch, " for storage epoch ", epoch);
    }
    imported_ = import_payload({incarnation_, slot_, epoch}, fields);
  }
  // The size the driver gives for what it mapped, never one read from shared memory.
  mapping.imported = imported_;
  mapping.payload = {reinterpret_cast<const std::byte*>(imported_->address), imported_->bytes};
  mapping.ready = imported_->ready;
  mapping.device = imported_->ordinal;
  return mapping;
}

}  // namespace tensorbucket::ipc
