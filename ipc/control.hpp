// Internal: the channel's control block, the one structure producer and consumers share.
//
// It lives in the control segment, fixed-size and trivially copyable; every field that more
// than one process writes is accessed through std::atomic_ref (never plain), and each word is
// small enough that a crash cannot tear it. The protocol, in one place:
//
// - Bucket b always goes to slot b % slot_count. A slot's `generation` is a seqlock word:
//   0 = never written, 2(b+1) = holds published bucket b, odd = the producer is rewriting it.
// - A consumer takes a lease on slot s by setting bit s of its `held_slots`, then re-reading
//   the generation; the producer claims a slot by making its generation odd, then reading every
//   consumer's `held_slots` and `next_bucket`. Both sides use seq_cst for that store-then-load
//   pair, so at least one sees the other and backs off (the producer reverts the generation).
// - The producer reuses a slot holding bucket b only when every live registered consumer has
//   next_bucket > b and no lease on it, and release_count >= min_consumers.
// - Who reclaims what: a dead consumer's record (and leases) is freed by the producer when it
//   next waits; a dead producer leaves its segments, which the next producer of the same name
//   removes; consumers drain what was published and then report ProducerGone.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "futex.hpp"
#include "process.hpp"

namespace tensorbucket::ipc {

inline constexpr std::uint32_t kControlMagic = 0x4C434254;  // "TBCL" in memory order
inline constexpr std::uint16_t kControlLayoutVersion = 2;
inline constexpr std::uint32_t kMaxSlots = 16;
inline constexpr std::uint32_t kMaxConsumers = 64;
inline constexpr std::size_t kMaxChannelName = 64;

enum ConsumerState : std::uint32_t { kFree = 0, kClaimed = 1, kActive = 2 };

struct alignas(64) SlotControl {
  std::uint64_t generation;       // seqlock word, see above
  std::uint64_t segment_epoch;    // the slot's segment is "<control>.slot<s>.<epoch>"; 0 = none
  std::uint64_t segment_bytes;    // payload capacity + frame capacity
  std::uint64_t payload_capacity; // the payload starts at offset 0, the frame right after
  std::uint64_t frame_bytes;      // header + manifest
  std::uint64_t publish_start_ns; // CLOCK_MONOTONIC when the producer began this bucket
  std::uint64_t published_ns;     // CLOCK_MONOTONIC when it became visible
  std::uint32_t release_count;    // consumers that released the bucket in the slot
  std::uint32_t reserved;
};

struct alignas(64) ConsumerRecord {
  std::uint32_t state;       // ConsumerState
  std::uint32_t held_slots;  // bit s: this consumer holds a lease on slot s
  ProcessId process;
  std::uint64_t next_bucket; // the next bucket this consumer will read
};

struct ControlBlock {
  std::uint32_t magic;  // written last by the producer: the block is ready once it matches
  std::uint16_t layout_version;
  std::uint16_t slot_count;
  std::uint32_t max_consumers;
  std::uint32_t min_consumers;
  std::uint32_t payload_checksum;
  std::uint32_t closed;         // 1 once the producer closed the channel
  ProcessId producer;
  std::uint64_t published;      // buckets published so far
  WaitWord consumer_wake;       // bumped on claim, publish and close
  WaitWord producer_wake;       // bumped on release, attach and detach
  SlotControl slots[kMaxSlots];
  ConsumerRecord consumers[kMaxConsumers];
};

static_assert(std::is_trivially_copyable_v<ControlBlock>);
static_assert(std::is_standard_layout_v<ControlBlock>);
static_assert(offsetof(ControlBlock, layout_version) == 4);
static_assert(sizeof(SlotControl) == 64 && sizeof(ConsumerRecord) == 64);
static_assert(offsetof(ControlBlock, slots) == 64);
static_assert(sizeof(ControlBlock) == 64 + kMaxSlots * 64 + kMaxConsumers * 64);
static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free);

template <class T>
std::atomic_ref<T> atomic(T& field) {
  return std::atomic_ref<T>(field);
}

// A ProcessId in shared memory, read or written field by field (each field atomically): the
// writer stores start_time first and pid last, so a reader that sees a pid sees its start time.
inline ProcessId load_process(ProcessId& shared) {
  auto pid = atomic(shared.pid).load(std::memory_order_acquire);
  return {pid, 0, atomic(shared.start_time).load(std::memory_order_relaxed)};
}
inline void store_process(ProcessId& shared, const ProcessId& value) {
  atomic(shared.start_time).store(value.start_time, std::memory_order_relaxed);
  atomic(shared.pid).store(value.pid, std::memory_order_release);
}

// Names under /dev/shm. Channel names are [A-Za-z0-9._-]{1,64}, not starting with a dot.
void validate_channel_name(std::string_view channel);
std::string control_segment_name(std::string_view channel);
std::string slot_segment_name(std::string_view channel, std::uint32_t slot, std::uint64_t epoch);

std::uint64_t monotonic_ns();

}  // namespace tensorbucket::ipc
