#include <algorithm>
#include <cstring>

#include "control.hpp"
#include "segment.hpp"
#include "serialize/text.hpp"
#include "tensorbucket/channel.hpp"

namespace tensorbucket {

namespace {

// The manifest of the bucket in `slot`, copied out and decoded only if the slot still holds
// the same bucket afterwards (the seqlock check); nullopt otherwise.
std::optional<Manifest> read_manifest(std::string_view channel, std::uint32_t s,
                                      ipc::SlotControl& slot) {
  auto generation = ipc::atomic(slot.generation).load(std::memory_order_acquire);
  auto segment_bytes = slot.segment_bytes;
  auto payload_capacity = slot.payload_capacity;
  auto frame_bytes = slot.frame_bytes;
  if (payload_capacity > segment_bytes || frame_bytes > segment_bytes - payload_capacity) {
    return std::nullopt;
  }
  auto segment = ipc::Segment::open(ipc::slot_segment_name(channel, s, slot.segment_epoch),
                                    segment_bytes, false);
  if (!segment) return std::nullopt;
  std::vector<std::byte> frame(frame_bytes);
  std::memcpy(frame.data(), segment->data() + payload_capacity, frame_bytes);
  if (ipc::atomic(slot.generation).load(std::memory_order_acquire) != generation) return std::nullopt;
  try {
    auto header = read_header(frame);
    return decode_manifest(manifest_bytes(header, frame));
  } catch (const Error&) {
    return std::nullopt;
  }
}

}  // namespace

ChannelInfo inspect_channel(std::string_view channel) {
  ipc::validate_channel_name(channel);
  auto name = ipc::control_segment_name(channel);
  auto segment = ipc::Segment::open(name, sizeof(ipc::ControlBlock), false);
  auto* control = segment ? reinterpret_cast<ipc::ControlBlock*>(segment->data()) : nullptr;
  if (!control || ipc::atomic(control->magic).load(std::memory_order_acquire) != ipc::kControlMagic) {
    text::fail(ErrorCode::ChannelMissing, "channel ", text::Quoted{channel}, " does not exist");
  }
  ChannelInfo info;
  info.channel = channel;
  info.control_segment = name;
  info.slots = std::min<std::uint32_t>(control->slot_count, ipc::kMaxSlots);
  info.max_consumers = std::min(control->max_consumers, ipc::kMaxConsumers);
  info.min_consumers = control->min_consumers;
  info.payload_checksum = control->payload_checksum != 0;
  auto producer = ipc::load_process(control->producer);
  info.producer_pid = producer.pid;
  info.producer_alive = ipc::is_alive(producer);
  info.closed = ipc::atomic(control->closed).load(std::memory_order_acquire) != 0;
  info.published = ipc::atomic(control->published).load(std::memory_order_acquire);

  std::optional<std::uint32_t> newest;
  for (std::uint32_t s = 0; s < info.slots; ++s) {
    auto& slot = control->slots[s];
    ChannelInfo::Slot state{};
    state.generation = ipc::atomic(slot.generation).load(std::memory_order_acquire);
    if (state.generation != 0 && state.generation % 2 == 0) state.bucket = state.generation / 2 - 1;
    state.release_count = ipc::atomic(slot.release_count).load(std::memory_order_relaxed);
    if (slot.segment_epoch != 0) state.segment = ipc::slot_segment_name(channel, s, slot.segment_epoch);
    state.segment_bytes = slot.segment_bytes;
    if (state.bucket && (!newest || *state.bucket > *info.slot_states[*newest].bucket)) newest = s;
    info.slot_states.push_back(state);
  }
  for (std::uint32_t r = 0; r < info.max_consumers; ++r) {
    auto& record = control->consumers[r];
    auto state = ipc::atomic(record.state).load(std::memory_order_acquire);
    if (state == ipc::kFree) continue;
    auto process = ipc::load_process(record.process);
    info.consumers.push_back({r, process.pid, ipc::is_alive(process), state == ipc::kClaimed,
                              ipc::atomic(record.next_bucket).load(std::memory_order_relaxed),
                              ipc::atomic(record.held_slots).load(std::memory_order_relaxed)});
  }
  if (newest) info.newest_manifest = read_manifest(channel, *newest, control->slots[*newest]);
  return info;
}

}  // namespace tensorbucket
