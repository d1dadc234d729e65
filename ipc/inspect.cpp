#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>

#include "control.hpp"
#include "ipc/os/liveness.hpp"
#include "ipc/os/process.hpp"
#include "ipc/os/segment.hpp"
#include "base/text.hpp"
#include "slot_storage.hpp"
#include "tensorbucket/channel.hpp"

namespace tensorbucket {

namespace {

// The manifest of the bucket in `slot`, read through a consumer's reader (its frame alone),
// copied out and decoded only if the slot still holds the same bucket afterwards (the seqlock
// check); nullopt otherwise.
std::optional<Manifest> read_manifest(std::string_view channel, std::uint32_t s, ipc::SlotControl& slot,
                                      ipc::PayloadHome home) {
  auto generation = ipc::atomic(slot.generation).load(std::memory_order_acquire);
  try {
    ipc::SlotReader reader{std::string(channel), s, home};
    auto mapping = reader.map_frame(slot);
    if (!mapping) return std::nullopt;
    std::vector<std::byte> frame(mapping->frame.begin(), mapping->frame.end());
    if (ipc::atomic(slot.generation).load(std::memory_order_acquire) != generation || mapping->segment->damaged()) {
      return std::nullopt;
    }
    auto header = read_header(frame);
    return decode_manifest(manifest_bytes(header, frame));
  } catch (const Error& e) {  // a frame that does not fit its segment, or does not decode
    if (!failed_verification(e.code())) throw;  // a segment that cannot be opened says so
    return std::nullopt;
  }
}

}  // namespace

ChannelInfo inspect_channel(std::string_view channel) {
  ipc::validate_channel_name(channel);
  auto name = ipc::control_segment_name(channel);
  std::optional<ipc::Segment> segment;
  try {
    segment = ipc::Segment::open(name, sizeof(ipc::ControlBlock), false, ipc::Locks::kKept);
  } catch (const Error& e) {
    // A producer creates the object, then sizes it: until then, as until it writes the magic,
    // there is no channel yet (Subscriber::attach waits through the same window).
    if (e.code() != ErrorCode::SystemError) throw;
    text::fail(ErrorCode::ChannelMissing, "channel ", text::Quoted{channel}, " does not exist (yet): ",
               e.what());
  }
  auto* control = segment ? reinterpret_cast<ipc::ControlBlock*>(segment->data()) : nullptr;
  if (!control || ipc::atomic(control->magic).load(std::memory_order_acquire) != ipc::kControlMagic) {
    text::fail(ErrorCode::ChannelMissing, "channel ", text::Quoted{channel}, " does not exist");
  }
  ChannelInfo info;
  info.channel = channel;
  info.control_segment = name;
  info.slots = std::min<std::uint32_t>(control->slot_count, ipc::kMaxSlots);
  info.max_consumers = std::min<std::uint32_t>(control->max_consumers, ipc::kMaxConsumers);
  info.min_consumers = control->min_consumers;
  info.payload_checksum = control->payload_checksum != 0;
  auto home_word = ipc::atomic(control->payload_home).load(std::memory_order_relaxed);
  auto home = static_cast<ipc::PayloadHome>(home_word);
  info.location = home == ipc::PayloadHome::kHost   ? "host"
                  : home == ipc::PayloadHome::kCuda ? "cuda " + ipc::describe(control->device)
                                                    : text::message("unknown (payload home ", home_word, ")");
  auto ours = ipc::pid_namespace();
  auto elsewhere = [&](const ipc::ProcessLabel& label) {
    return label.pid_namespace != 0 && ours != 0 && label.pid_namespace != ours;
  };
  auto producer = ipc::load_label(control->producer);
  info.producer_pid = producer.pid;
  info.producer_incarnation = ipc::atomic(control->incarnation).load(std::memory_order_relaxed);
  info.producer_pid_elsewhere = elsewhere(producer);
  auto closed = ipc::atomic(control->closed).load(std::memory_order_acquire);
  // A remover holds a dead producer's byte while it removes the channel, which it marked first.
  info.producer_alive = ipc::held_by_other(segment->descriptor(), ipc::kProducerLockByte) &&
                        closed != static_cast<std::uint16_t>(ipc::Closed::kByRemover);
  info.closed = closed != 0;
  info.published = ipc::atomic(control->published).load(std::memory_order_acquire);
  auto policy = ipc::atomic(control->policy).load(std::memory_order_relaxed);
  info.policy = policy == static_cast<std::uint16_t>(ipc::SlotPolicy::kBlock)    ? "block"
                : policy == static_cast<std::uint16_t>(ipc::SlotPolicy::kLatest) ? "latest"
                                                                                 : text::message("unknown (", policy, ")");
  info.update_buckets = ipc::atomic(control->update_buckets).load(std::memory_order_relaxed);
  info.updates = ipc::atomic(control->updates).load(std::memory_order_relaxed);

  std::optional<std::uint32_t> newest;
  for (std::uint32_t s = 0; s < info.slots; ++s) {
    auto& slot = control->slots[s];
    ChannelInfo::Slot state{};
    state.generation = ipc::atomic(slot.generation).load(std::memory_order_acquire);
    if (ipc::holds_bucket(state.generation)) state.bucket = ipc::bucket_in(state.generation);
    state.release_count = ipc::atomic(slot.release_count).load(std::memory_order_relaxed);
    auto epoch = ipc::atomic(slot.segment_epoch).load(std::memory_order_relaxed);
    if (epoch != 0) {
      state.segment = ipc::slot_segment_name(channel, s, epoch);
      state.epoch = epoch - ipc::epoch_base(info.producer_incarnation);  // counted from 1, for people
    }
    state.payload_capacity = ipc::atomic(slot.payload_capacity).load(std::memory_order_relaxed);
    state.segment_bytes = ipc::atomic(slot.segment_bytes).load(std::memory_order_relaxed);
    if (state.bucket) {
      auto& place = control->slot_updates[s];
      state.version = ipc::atomic(place.version).load(std::memory_order_relaxed);
      state.bucket_index = ipc::atomic(place.bucket_index).load(std::memory_order_relaxed);
      state.bucket_count = ipc::atomic(place.bucket_count).load(std::memory_order_relaxed);
      state.published_ns = ipc::atomic(slot.published_ns).load(std::memory_order_relaxed);
    }
    if (state.bucket && (!newest || *state.bucket > *info.slot_states[*newest].bucket)) newest = s;
    info.slot_states.push_back(state);
  }
  for (std::uint32_t r = 0; r < info.max_consumers; ++r) {
    auto& record = control->consumers[r];
    auto claim = ipc::atomic(record.claim).load(std::memory_order_acquire);
    if (ipc::claim_token(claim) == 0) continue;
    auto process = ipc::load_label(record.process);
    info.consumers.push_back({r, process.pid, elsewhere(process),
                              ipc::held_by_other(segment->descriptor(), ipc::consumer_lock_byte(r)),
                              ipc::atomic(record.next_bucket).load(std::memory_order_relaxed),
                              ipc::atomic(record.next_update).load(std::memory_order_relaxed),
                              ipc::claim_leases(claim)});
  }
  bool known_home = home == ipc::PayloadHome::kHost || home == ipc::PayloadHome::kCuda;
  if (newest && known_home) info.newest_manifest = read_manifest(channel, *newest, control->slots[*newest], home);
  return info;
}

std::vector<std::string> list_channels() {
  // POSIX shared memory objects are the files of /dev/shm on Linux. A name that is no channel
  // name (a slot's segment ends in ".slot<s>.<epoch>", which no channel name may) is not a
  // channel.
  const std::string prefix = ipc::control_segment_name("");
  std::vector<std::string> channels;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    auto name = entry.path().filename().string();
    if (!name.starts_with(prefix)) continue;
    try {
      ipc::validate_channel_name(std::string_view(name).substr(prefix.size()));
    } catch (const Error&) {
      continue;
    }
    channels.push_back(name.substr(prefix.size()));
  }
  if (error) text::fail(ErrorCode::SystemError, "cannot list /dev/shm: ", error.message());
  std::sort(channels.begin(), channels.end());
  return channels;
}

}  // namespace tensorbucket
