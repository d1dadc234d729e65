#include "ipc/cuda/release_events.hpp"

#include "ipc/os/liveness.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::ipc {

OwnReleaseEvents::OwnReleaseEvents(std::optional<int> ordinal, std::uint32_t slot_count) {
  if (!ordinal) return;
  device = *ordinal;
  DeviceScope scope(device);
  try {
    for (std::uint32_t s = 0; s < slot_count; ++s) events.push_back(take_event(device));
  } catch (...) {
    give_back();
    throw;
  }
}

OwnReleaseEvents::~OwnReleaseEvents() {
  if (!owner.forked()) give_back();  // else the parent's
}

void OwnReleaseEvents::record(std::uint32_t s, DeviceStream stream) noexcept {
  if (events.empty()) return;
  try {
    DeviceScope scope(device);
    const auto& api = device_api();
    if (api.record_event(events[s].event, stream) != 0) api.synchronize(stream);
  } catch (const Error&) {
    // Without a context there is no work left to order.
  }
}

void OwnReleaseEvents::wait_for_releases() noexcept {
  if (events.empty()) return;
  try {
    DeviceScope scope(device);
    for (const auto& event : events) device_api().synchronize_event(event.event);
  } catch (const Error&) {
    // The context is gone (the driver shutting down): so is the work.
  }
}

void OwnReleaseEvents::give_back() noexcept {
  for (const auto& event : events) give_back_event(device, event);
  events.clear();
}

void ReleaseWaits::wait(ControlBlock& control, int locks, std::uint32_t s, std::uint32_t slot_count,
                        DeviceStream stream) {
  const auto& api = device_api();
  for (std::uint32_t r = 0; r < kMaxConsumers; ++r) {
    auto token = claim_token(atomic(control.consumers[r].claim).load(std::memory_order_acquire));
    auto& record = records_[r];
    if (token != 0 && !held_by_other(locks, consumer_lock_byte(r))) token = 0;
    if (record.token != token) {
      record.close();
      record.token = token;
      if (token != 0) record.open(control.release_events[r], slot_count);
    }
    if (record.events[s] != nullptr) check_device(api.wait_event(stream, record.events[s]), "cuStreamWaitEvent");
  }
}

ReleaseWaits::~ReleaseWaits() {
  if (owner_.forked()) return;  // the events are the parent's
  try {
    DeviceScope scope(device_);
    for (auto& record : records_) record.close();
  } catch (const Error&) {
    // The context is gone (the driver shutting down): so are the events.
  }
}

void ReleaseWaits::Record::open(const ReleaseEvents& shared, std::uint32_t slot_count) {
  for (std::uint32_t s = 0; s < slot_count; ++s) {
    auto handle = shared.slots[s];  // one copy of what a peer may be writing
    events[s] = own_event(handle);
    if (events[s] != nullptr) continue;
    imported[s] = device_api().import_event(&events[s], handle) == 0;
    if (!imported[s]) events[s] = nullptr;
  }
}

void ReleaseWaits::Record::close() noexcept {
  for (std::uint32_t s = 0; s < kMaxSlots; ++s) {
    if (imported[s]) device_api().destroy_event(events[s]);
    events[s] = nullptr;
    imported[s] = false;
  }
}

}  // namespace tensorbucket::ipc
