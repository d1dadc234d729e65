// Internal: where a slot's bucket lives, the one place that knows. The protocol (control.hpp,
// publisher.cpp, subscriber.cpp) asks a slot for its frame and its payload and looks no
// further.
//
// Every slot has, per storage epoch, a shared-memory segment "<control>.slot<s>.<epoch>"
// holding the frame (header + manifest):
// - host: the payload comes first in that segment, the frame follows at payload_capacity;
// - CUDA: the frame is at offset 0, and the payload is a device allocation of the
//   producer's, exported once per epoch with an interprocess event that the producer records
//   after writing it. Consumers import both once per handle and keep them (a consumer in the
//   producer's process uses the producer's own).
// A slot gets a new epoch, with all new storage, when a bucket does not fit or another process
// truncated its segment.
#pragma once

#include "base/private.hpp"

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "control.hpp"
#include "ipc/cuda/device.hpp"
#include "ipc/os/segment.hpp"
#include "tensorbucket/bucket.hpp"

namespace tensorbucket::ipc {

// Where the frame starts in a slot's segment.
constexpr std::uint64_t frame_offset(PayloadHome home, std::uint64_t payload_capacity) {
  return home == PayloadHome::kHost ? payload_capacity : 0;
}

// The CUDA ordinal that holds a channel's payloads at `location`; none on the host.
inline std::optional<int> payload_device(PayloadLocation location) {
  return location.on_host() ? std::nullopt : std::optional<int>(location.device);
}

// How a channel's control block says where its payloads live: host shared memory, or a CUDA
// device named by its UUID, which is looked up here (InvalidArgument for a negative ordinal,
// CudaUnavailable, DeviceNotVisible), before the producer makes anything.
struct Home {
  PayloadHome home = PayloadHome::kHost;
  DeviceUuid device{};
};
Home home_of(PayloadLocation location);
// The kind of location of `home`'s payloads, before any device is looked up.
inline PayloadLocation::Kind kind_of(PayloadHome home) {
  return home == PayloadHome::kHost ? PayloadLocation::Kind::Host : PayloadLocation::Kind::Cuda;
}
// Where payloads of `kind` live, in words: "in host memory", "on a CUDA device".
inline const char* where_payloads_live(PayloadLocation::Kind kind) {
  return kind == PayloadLocation::Kind::Host ? "in host memory" : "on a CUDA device";
}
// Where payloads of `home` are in this process: the host, or its ordinal of the device
// (DeviceNotVisible when it sees none).
PayloadLocation location_of(const Home& home);

// The producer's storage of one slot. It keeps what it allocated and never reads its own
// fields back from shared memory.
class SlotStorage {
 public:
  // `device`: the CUDA ordinal (in this process) that holds the payloads; none: the host.
  // `incarnation`: the producer's, which its epochs start from (epoch_base()).
  SlotStorage(std::string channel, std::uint32_t slot, mode_t mode, std::optional<int> device,
              std::uint64_t incarnation);
  SlotStorage(SlotStorage&&) noexcept;
  SlotStorage& operator=(SlotStorage&&) = delete;
  ~SlotStorage();

  // Room for a payload of `payload_bytes` and a frame of `frame_bytes`: true when that took a
  // new epoch (the present storage was too small, or truncated by another process).
  bool fit(std::uint64_t payload_bytes, std::uint64_t frame_bytes);

  std::span<std::byte> frame() const noexcept;
  // The payload's first byte: a host address, or a device address on a CUDA slot.
  std::byte* payload() const noexcept;
  bool on_device() const noexcept { return device_ != nullptr; }
  bool damaged() const noexcept { return segment_ && segment_->damaged(); }
  std::uint64_t epoch() const noexcept { return epoch_; }

  // Writes what consumers need to find this bucket into the slot's shared fields.
  void describe(SlotControl& shared, SlotDevice& device, std::uint64_t frame_bytes) const;

  // CUDA: records the ready event on `stream`, after the work that wrote the payload.
  void record_ready(DeviceStream stream) const;

  // Unlinks the present epoch's segment (mappings stay valid), while its name is still ours:
  // after a `tbucket rm --force` it may be another producer's.
  void remove() noexcept;

  struct Device;  // slot_storage.cpp

 private:
  std::string channel_;
  std::uint32_t slot_;
  mode_t mode_;
  std::optional<int> ordinal_;
  std::optional<Segment> segment_;
  std::shared_ptr<Device> device_;
  std::uint64_t epoch_ = 0;
  std::uint64_t payload_capacity_ = 0;
  std::uint64_t frame_capacity_ = 0;
};

// A CUDA payload a consumer imported: open while any holder of it lives, closed after.
struct ImportedPayload;

// What a consumer mapped of one slot's bucket. Holding it keeps the memory mapped.
struct SlotMapping {
  std::shared_ptr<Segment> segment;
  std::shared_ptr<const ImportedPayload> imported;  // CUDA only
  std::span<const std::byte> frame;
  std::span<const std::byte> payload;  // host or device addresses, as far as is mapped
  DeviceEvent ready = nullptr;         // CUDA: wait on it before the payload is read
  int device = -1;                     // CUDA: this process's ordinal of the payload's device

  // Makes bucket `bucket`, verified as `view` over this mapping, usable on `stream`: on a
  // device, the stream waits for the producer's writing of it, and the payload's block hash is
  // checked there when `check_payload_hash` (the one check that waits for the device); on the
  // host, verification already did all of it. What is checked is the header `view` verified,
  // never the frame again: a peer may have changed it since. HeaderCorrupt for a device bucket
  // with an xxh3-64 payload hash, ChecksumMismatch.
  void make_ready(const BucketView& view, bool check_payload_hash, DeviceStream stream, std::uint64_t bucket) const;
  // Waits on the host until what `stream` queued on the payload is done (nothing to wait for
  // on the host).
  void wait_ready(DeviceStream stream) const;
  // The payload's first `bytes`, copied into host memory (on a device: on `stream`, waited for).
  std::vector<std::byte> copy_to_host(std::uint64_t bytes, DeviceStream stream) const;
};

// A consumer's reader of one slot: maps each epoch once. On a CUDA channel, `device` is the
// channel's device and `ordinal` this process's number for it.
class SlotReader {
 public:
  SlotReader(std::string channel, std::uint32_t slot, PayloadHome home, DeviceUuid device = {}, int ordinal = -1);

  // The slot's bucket, found through its shared fields. Anyone can write those: each is read
  // once and checked against what this process mapped (HeaderCorrupt when it does not fit).
  // nullopt when the slot's segment does not exist (the producer may be gone).
  std::optional<SlotMapping> map(SlotControl& shared, SlotDevice& device);
  // The slot's frame alone, as map() finds it, with no payload imported: what `tbucket
  // inspect` reads.
  std::optional<SlotMapping> map_frame(SlotControl& shared);

 private:
  std::optional<SlotMapping> map_frame(SlotControl& shared, std::uint64_t epoch, std::uint64_t payload_capacity);

  std::string channel_;
  std::uint32_t slot_;
  PayloadHome home_;
  DeviceUuid device_;
  int ordinal_;
  std::uint64_t epoch_ = 0;
  std::shared_ptr<Segment> segment_;
  std::shared_ptr<const ImportedPayload> imported_;
  std::array<std::uint8_t, kDeviceHandleBytes> imported_handle_{};
};

// Device payloads this process holds now, and the handles it has opened so far (each an
// import through the driver; a producer's own memory in this process is not one), for tests.
std::size_t open_device_imports();
std::uint64_t device_imports_made();

}  // namespace tensorbucket::ipc
