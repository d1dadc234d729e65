// Internal: the channel's control block, the one structure producer and consumers share.
//
// It lives in the control segment, fixed-size and trivially copyable; every field that more
// than one process writes is accessed through std::atomic_ref (never plain), and each word is
// small enough that a crash cannot tear it. Every process that maps it can write all of it, so
// whatever is read from it is checked before use (docs/channel.md, "Hostile peers"), and the
// producer never reads back what it wrote: it keeps its own copy. The protocol, in one place
// (docs/channel.md argues it case by case):
//
// - A slot's `generation` is a seqlock word: 0 = never written, 2(b+1) = holds published
//   bucket b (generation_of()), odd = the producer is rewriting it. Consumers find bucket b by
//   its generation in any slot. Under the `block` policy bucket b goes to slot b % slot_count;
//   under `latest` to the slot of the oldest bucket that no live consumer leases. Where the
//   slot's bytes live is slot_storage.hpp's business alone.
// - Each slot's `SlotUpdate` says which update its bucket belongs to, written with the bucket
//   and read under the same seqlock: a hint for finding an update's start or the newest
//   complete update without reading frames, which the verified manifest then confirms.
// - Liveness is a lock the kernel holds for a process (liveness.hpp): byte 0 of the control
//   segment for the producer, byte 1 + r for the consumer of record r.
// - A consumer record belongs to whoever holds its lock byte. Its `claim` word names the
//   owner (a token unique to one attach) and, in the same word, the owner's leases. A record
//   changes owner only by compare-and-swap of the whole word: an attacher, holding the lock
//   byte, swaps the exact word it read (free, or a dead owner's) for its own; the producer
//   frees a blocking record only by swapping the exact word it judged dead for 0. A consumer
//   changes its leases by compare-and-swap too, so it notices a record taken from it.
// - A consumer takes a lease on slot s by setting its bit s, then re-reading the generation;
//   the producer claims a slot by making its generation odd, then reading every record. Both
//   sides use seq_cst for that store-then-load pair, so at least one sees the other and backs
//   off (the producer reverts the generation).
// - `block`: the producer reuses a slot holding bucket b only when every record whose owner
//   is alive has next_bucket > b and no lease on it, and release_count >= min_consumers. An
//   attacher sets next_bucket to 0 before it claims, so it blocks every reuse until it has
//   chosen where to start. `latest`: only the leases count; a consumer's lease is its one
//   protection, and the same store-then-load pair makes it hold.
// - Who reclaims what: a dead consumer's record (and leases) is freed by the producer when it
//   blocks a slot, or taken over by the next attacher; a dead producer leaves its segments,
//   which the next producer of the same name, or the next attacher, removes (attach never
//   attaches to them); consumers drain what was published and then report ProducerGone.
#pragma once

#include "base/private.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "ipc/cuda/device.hpp"
#include "ipc/os/futex.hpp"
#include "ipc/os/liveness.hpp"

namespace tensorbucket::ipc {

inline constexpr std::uint32_t kControlMagic = 0x4C434254;  // "TBCL" in memory order
// 6: epochs count from the incarnation (epoch_base()), and a remover marks `closed` (Closed).
inline constexpr std::uint16_t kControlLayoutVersion = 6;
inline constexpr std::uint32_t kMaxSlots = 16;
inline constexpr std::uint32_t kMaxConsumers = 64;
inline constexpr std::size_t kMaxChannelName = 64;

// A record's `claim` word: the owner's token in the high 48 bits (0: free), its leases in the
// low 16 (bit s: a lease on slot s), so that the owner and its leases change together.
inline constexpr int kLeaseBits = 16;
static_assert(kMaxSlots <= kLeaseBits);
static_assert(consumer_lock_byte(kMaxConsumers - 1) < kRemoverLockByte);
inline constexpr std::uint64_t kTokenLimit = std::uint64_t{1} << (64 - kLeaseBits);
constexpr std::uint64_t claim_token(std::uint64_t claim) { return claim >> kLeaseBits; }
constexpr std::uint32_t claim_leases(std::uint64_t claim) {
  return static_cast<std::uint32_t>(claim & ((std::uint64_t{1} << kLeaseBits) - 1));
}
constexpr std::uint64_t make_claim(std::uint64_t token, std::uint32_t leases) {
  return token << kLeaseBits | leases;
}

// The seqlock arithmetic, named once.
constexpr std::uint64_t generation_of(std::uint64_t bucket) { return 2 * (bucket + 1); }
constexpr bool holds_bucket(std::uint64_t generation) { return generation != 0 && generation % 2 == 0; }
constexpr bool being_written(std::uint64_t generation) { return generation % 2 == 1; }
// The bucket a generation that holds_bucket() holds.
constexpr std::uint64_t bucket_in(std::uint64_t generation) { return generation / 2 - 1; }

// Where a channel's payloads live (ControlBlock::payload_home).
enum class PayloadHome : std::uint16_t { kHost = 0, kCuda = 1 };

// ControlBlock::policy: what the producer does when every slot is still needed.
enum class SlotPolicy : std::uint16_t { kBlock = 0, kLatest = 1 };

// ControlBlock::closed.
enum class Closed : std::uint16_t {
  kOpen = 0,
  kByProducer = 1,
  kByRemover = 2,  // its producer is dead: a remover holds its lock byte (leftovers.hpp)
};

struct alignas(64) SlotControl {
  std::uint64_t generation;       // seqlock word, see above
  std::uint64_t segment_epoch;    // the slot's storage epoch (slot_storage.hpp); 0 = none
  std::uint64_t segment_bytes;    // the size of the slot's segment
  std::uint64_t payload_capacity; // host: the payload at offset 0, the frame after it;
                                  // CUDA: the device allocation's size, the frame at 0
  std::uint64_t frame_bytes;      // header + manifest
  std::uint64_t publish_start_ns; // CLOCK_MONOTONIC when the producer began this bucket
  std::uint64_t published_ns;     // CLOCK_MONOTONIC when it became visible
  std::uint32_t release_count;    // consumers that released the bucket in the slot
  std::uint32_t manifest_doubt;   // set by a consumer that refused the slot's frame: rewrite it
};

// Who a process is, for people (inspect, messages), never for liveness: a pid and the pid
// namespace it is a pid in (the inode of /proc/self/ns/pid; 0 when unknown).
struct ProcessLabel {
  std::int32_t pid;
  std::uint32_t reserved;
  std::uint64_t pid_namespace;
};

struct alignas(64) ConsumerRecord {
  std::uint64_t claim;        // owner token and leases, see claim_token()
  std::uint64_t next_bucket;  // the next bucket this consumer will read
  ProcessLabel process;
  std::uint64_t next_update;  // the update ordinal (SlotUpdate) of next_bucket, for inspect
};

// Which update a slot's bucket belongs to (the manifest's version, bucket index and count,
// and the producer's count of updates begun before it), as the producer published it.
struct SlotUpdate {
  std::uint64_t version;
  std::uint32_t bucket_index;
  std::uint32_t bucket_count;
  std::uint64_t ordinal;
};

// A CUDA channel's slot: what a consumer needs to import its payload, written by the
// producer with the other slot fields for every bucket (slot_storage.hpp).
struct alignas(64) SlotDevice {
  DeviceUuid device;          // the device holding the payload, by UUID: ordinals differ
  std::uint64_t epoch;        // the storage epoch these handles belong to
  std::uint64_t capacity;     // bytes of the device allocation
  DeviceHandle memory;        // the allocation, exported once per epoch
  DeviceHandle ready_event;   // recorded after the payload was written, before publishing
};

// A consumer record's events on a CUDA channel, one per slot: the consumer records the slot's
// on its stream when it releases the slot, and the producer's stream waits on it before it
// rewrites the slot. Written by the attacher before it claims the record.
struct ReleaseEvents {
  DeviceHandle slots[kMaxSlots];
};

struct ControlBlock {
  std::uint32_t magic;  // written last by the producer: the block is ready once it matches
  std::uint16_t layout_version;
  std::uint16_t slot_count;
  std::uint16_t max_consumers;
  std::uint16_t min_consumers;
  std::uint16_t payload_checksum;
  std::uint16_t closed;         // a Closed: set once, by the producer or by a remover of its leftovers
  ProcessLabel producer;
  std::uint64_t published;      // buckets published so far
  std::uint64_t claims;         // attaches so far: the next one's token is claims + 1
  WaitWord consumer_wake;       // bumped on claim, near the end of a long copy, publish and close
  WaitWord producer_wake;       // bumped on release, attach and detach
  std::uint16_t payload_home;   // a PayloadHome
  std::uint16_t policy;         // a SlotPolicy
  std::uint16_t update_buckets; // buckets per update the producer declared (for `latest`)
  std::uint16_t reserved;
  std::uint64_t incarnation;    // random, new for each producer of the name
  DeviceUuid device;            // a CUDA channel's device
  std::uint64_t updates;        // updates begun so far (buckets with index 0 published)
  SlotControl slots[kMaxSlots];
  ConsumerRecord consumers[kMaxConsumers];
  SlotUpdate slot_updates[kMaxSlots];
  SlotDevice device_slots[kMaxSlots];        // CUDA channels only
  ReleaseEvents release_events[kMaxConsumers];  // CUDA channels only
};

static_assert(std::is_trivially_copyable_v<ControlBlock>);
static_assert(std::is_standard_layout_v<ControlBlock>);
static_assert(offsetof(ControlBlock, layout_version) == 4);
static_assert(offsetof(ControlBlock, producer) == 16);
static_assert(sizeof(SlotControl) == 64 && sizeof(ConsumerRecord) == 64);
static_assert(offsetof(ControlBlock, payload_home) == 64);
static_assert(offsetof(ControlBlock, slots) == 128);
static_assert(sizeof(SlotDevice) == 192 && sizeof(ReleaseEvents) == kMaxSlots * kDeviceHandleBytes);
static_assert(std::is_trivially_copyable_v<SlotDevice> && std::is_trivially_copyable_v<ReleaseEvents>);
static_assert(sizeof(SlotUpdate) == 24 && std::is_trivially_copyable_v<SlotUpdate>);
static_assert(sizeof(ControlBlock) == 128 + kMaxSlots * 64 + kMaxConsumers * 64 + kMaxSlots * sizeof(SlotUpdate) +
                                          kMaxSlots * 192 + kMaxConsumers * sizeof(ReleaseEvents));
static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free);

template <class T>
std::atomic_ref<T> atomic(T& field) {
  return std::atomic_ref<T>(field);
}

// This process's label, and one read from shared memory field by field.
ProcessLabel this_process();
inline ProcessLabel load_label(ProcessLabel& shared) {
  return {atomic(shared.pid).load(std::memory_order_relaxed), 0,
          atomic(shared.pid_namespace).load(std::memory_order_relaxed)};
}
inline void store_label(ProcessLabel& shared, const ProcessLabel& value) {
  atomic(shared.pid).store(value.pid, std::memory_order_relaxed);
  atomic(shared.pid_namespace).store(value.pid_namespace, std::memory_order_relaxed);
}

// Names under /dev/shm. Channel names are [A-Za-z0-9._-]{1,64}, not starting with a dot nor
// ending like a slot's segment (.slot<s>.<epoch>).
void validate_channel_name(std::string_view channel);
std::string control_segment_name(std::string_view channel);
std::string slot_segment_name(std::string_view channel, std::uint32_t slot, std::uint64_t epoch);

// The epoch before a producer's first: its epochs count up from its incarnation's high half,
// so that no two producers of a name share a slot segment's name. A consumer still attached
// to a dead producer opens its slots by name; under a restarted producer's epochs 1, 2, ...
// it found the new producer's segments and took their bytes for the dead one's buckets.
constexpr std::uint64_t epoch_base(std::uint64_t incarnation) { return incarnation & ~std::uint64_t{0xffffffff}; }

}  // namespace tensorbucket::ipc
