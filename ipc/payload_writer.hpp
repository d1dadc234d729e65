// Internal: the producer's writing of a bucket's payload into the slot it claimed, wherever the
// slot keeps it. With SlotStorage (what a slot is made of) and SlotMapping (a consumer's side),
// the one place that knows a host payload from a device one: publisher.cpp says when a payload
// is written, this says how.
//
// On the host, entries are copied as pack() copies them, paced so that consumers asleep are
// woken near the end of a long copy. On a CUDA device, everything is queued on the stream of
// the bucket being written, after every consumer's release of the slot (ReleaseWaits), and the
// payload's hash is the block hash, computed there.
#pragma once

#include "base/private.hpp"

#include <cstdint>
#include <optional>
#include <span>

#include "ipc/control.hpp"
#include "ipc/cuda/device.hpp"
#include "ipc/cuda/release_events.hpp"
#include "serialize/copy.hpp"
#include "tensorbucket/bucket.hpp"

namespace tensorbucket::ipc {

class PayloadWriter {
 public:
  // `device`: the CUDA ordinal (in this process) of a device channel; none: the host.
  explicit PayloadWriter(std::optional<int> device);

  // Slot `s` was claimed for a bucket laid out as `entries` in `payload`, to be written on
  // `stream`. On a device, the stream waits for every consumer's release of the slot, and the
  // padding is zeroed there unless `padding_zeroed` (the slot's last layout was this one); on
  // the host, the writing zeroes it (write_bucket(), and zero_padding() unless
  // `padding_zeroed`).
  void begin(ControlBlock& control, int locks, std::uint32_t s, std::uint32_t slot_count,
             std::span<const ManifestEntry> entries, std::span<std::byte> payload, bool padding_zeroed,
             DeviceStream stream);

  // For a reservation, whose writer fills the entries: the padding between them zeroed (on a
  // device, begin() did it), so that no bytes of an older bucket travel in it; nothing when
  // begin() was told the slot's last layout was this one, whose padding no write since has
  // touched (a Python publish of 1000 x 4-byte entries took 0.83x the time). Only the padding:
  // zeroing a whole 256 MiB payload evicted the caches the handoff then needed.
  // `streaming`: with streaming stores, as the entries are then written (fenced at commit).
  void zero_padding(std::span<const ManifestEntry> entries, std::span<std::byte> payload, bool streaming) const;

  // Every entry of `bucket` into `payload`, and the padding zeroed on the host. InvalidArgument
  // for an entry declared for in-place writing.
  void write_bucket(const BucketBuilder& bucket, std::span<std::byte> payload, detail::NearEnd& near_end) const;

  // Whether a reservation's host copies into `payload` use streaming stores (never on a device).
  bool streams(std::span<const std::byte> payload) const noexcept { return !device_ && detail::streams(payload); }

  // `from` into entry span `to` (Reservation::write), or each of `sources` into its span of
  // `to`, null ones skipped (Reservation::write_all). `host`: the reservation's host copier.
  void write_entry(std::span<std::byte> to, const void* from, detail::EntryCopier& host) const;
  void write_entries(std::span<const std::span<std::byte>> to, std::span<const void* const> sources,
                     detail::EntryCopier& host) const;

  // The payload's hash, for the header: xxh3-64 on the host; on a device the block hash
  // (docs/format.md), computed there after the writing, the one wait for the device.
  struct Hash {
    std::uint64_t value;
    bool block_hash;
  };
  Hash hash(std::span<const std::byte> payload) const;

  // The device's context current while the slot is finished; nothing on the host.
  std::optional<DeviceScope> scope() const;
  // The stream the bucket being written is queued on (null on the host).
  DeviceStream stream() const noexcept { return stream_; }

 private:
  std::optional<int> device_;
  std::optional<ReleaseWaits> release_waits_;
  DeviceStream stream_ = nullptr;
  bool padding_zeroed_ = false;  // begin()'s word for the slot claimed last
};

}  // namespace tensorbucket::ipc
