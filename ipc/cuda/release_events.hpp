// The device ordering of a slot's reuse on a CUDA channel, both ends of it: a consumer records
// an event on its stream when it releases a slot, and the producer makes the stream that
// rewrites the slot wait on every live consumer's event (control.hpp, ReleaseEvents; the
// protocol in docs/channel.md, "CUDA"). The publisher and subscriber hold one of these each
// on a device channel and say nothing else about events.
#pragma once

#include "base/private.hpp"

#include <cstdint>
#include <optional>
#include <vector>

#include "ipc/control.hpp"
#include "ipc/cuda/device.hpp"
#include "ipc/os/process.hpp"

namespace tensorbucket::ipc {

// A consumer's own release events: one per slot, taken from the process's pool at attach and
// given back at detach. Their handles go into its record's ReleaseEvents. A consumer of a host
// channel has none, and each call is then nothing.
struct OwnReleaseEvents {
  int device = -1;
  std::vector<PooledEvent> events;
  Owner owner;

  // `ordinal`: the device of a CUDA channel's payloads; none on the host.
  OwnReleaseEvents(std::optional<int> ordinal, std::uint32_t slot_count);
  OwnReleaseEvents(const OwnReleaseEvents&) = delete;
  OwnReleaseEvents& operator=(const OwnReleaseEvents&) = delete;
  ~OwnReleaseEvents();

  // Records slot `s`'s event on `stream`, before the release itself. Where the event cannot be
  // recorded (a stream of another context, say), the stream's work is waited for on the host
  // instead: the slot is given back only after it either way.
  void record(std::uint32_t s, DeviceStream stream) noexcept;
  // Waits on the host for the work each release was ordered after: the producer stops waiting
  // on our events once our record is free, so that work must be done before it is. The one
  // host wait of a consumer, at detach.
  void wait_for_releases() noexcept;
  void give_back() noexcept;
};

// The producer's side: the consumers' release events, imported once per attach of each record
// (a consumer in this process lends its own). A record whose events cannot be imported (a peer
// wrote garbage there) gets no ordering on the device.
class ReleaseWaits {
 public:
  explicit ReleaseWaits(int device) : device_(device) {}
  ReleaseWaits(const ReleaseWaits&) = delete;
  ReleaseWaits& operator=(const ReleaseWaits&) = delete;
  ~ReleaseWaits();

  // Makes `stream` wait until every live consumer that holds a record now finished, on its
  // device streams, the work it queued before releasing slot `s`. A dead one's work died with
  // it: its events are not waited on (nor is what became of them known). `locks`: the control
  // segment's descriptor, whose lock bytes say which records are live.
  void wait(ControlBlock& control, int locks, std::uint32_t s, std::uint32_t slot_count, DeviceStream stream);

 private:
  struct Record {
    std::uint64_t token = 0;
    DeviceEvent events[kMaxSlots] = {};
    bool imported[kMaxSlots] = {};  // else a consumer's in this process, or none
    void open(const ReleaseEvents& shared, std::uint32_t slot_count);
    void close() noexcept;
  };
  int device_;
  Owner owner_;
  Record records_[kMaxConsumers];
};

}  // namespace tensorbucket::ipc
