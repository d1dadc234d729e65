// The consumer side of a channel. See ipc/control.hpp for the protocol and docs/channel.md
// for the crash cases and what a hostile peer can do.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>
#include <unordered_map>

#include "control.hpp"
#include "ipc/cuda/release_events.hpp"
#include "ipc/os/futex.hpp"
#include "leftovers.hpp"
#include "ipc/os/liveness.hpp"
#include "ipc/os/process.hpp"
#include "ipc/os/segment.hpp"
#include "base/text.hpp"
#include "slot_storage.hpp"
#include "tensorbucket/channel.hpp"
#include "test_hooks.hpp"

namespace tensorbucket {

using text::fail;
using text::message;
using text::Quoted;

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWaitSlice = std::chrono::milliseconds(10);
// attach() polls for a control block, which has no word to wait on before it exists.
constexpr auto kAttachPoll = std::chrono::milliseconds(2);
// Spinning this long before sleeping keeps the handoff in microseconds when the producer is
// about to publish, at the price of that much CPU per empty wait.
constexpr auto kSpin = std::chrono::microseconds(50);
// While the producer writes the awaited slot (its generation odd), a consumer spins up to this
// long after each wake-up before it sleeps again: the producer wakes consumers when it claims
// the slot, so their wake-up, tens of µs on a VM, overlaps the writing of a small bucket
// (1000 x 1 KiB: ~60 µs) instead of following it. A larger bucket takes longer to write than
// this: its consumers sleep, and the producer wakes them again when its copy (publish(), or
// the write() calls) is due to end within kWakeLead (publisher.cpp). Spinning all along would
// take the cores the producer writes with, when consumers outnumber the free ones.
constexpr auto kWriteSpin = std::chrono::microseconds(200);
// How many wakes may restart that spin in one call: a claim and a near-end wake come per
// bucket. A peer that bumps the word without end (every process that maps the control block
// can) must not keep a consumer spinning past its liveness and record checks.
constexpr int kWriteSpinRestarts = 4;
constexpr auto kLivenessPeriod = std::chrono::milliseconds(5);
// Longest wait for a producer's probe of a slot we lease to end (settled_generation()).
constexpr auto kProbeSettle = std::chrono::milliseconds(1);
// No producer publishes this many buckets (2^62: 146 years at a bucket per nanosecond), so
// a larger count in the control block is damage, and 2(b+1) cannot overflow below it.
constexpr std::uint64_t kMaxBuckets = std::uint64_t{1} << 62;
// A compare-and-swap of our own record fails only while another thread of ours releases a
// lease: a few retries. Endless failures mean another process keeps writing the record.
constexpr int kClaimRetries = 1000;

}  // namespace

// A bucket a slot holds, with its place in its update as the producer wrote it (a hint,
// confirmed by the verified manifest before anything is handed out).
struct HeldBucket {
  std::uint32_t slot;
  std::uint64_t bucket;
  ipc::SlotUpdate place;
};

struct detail::SubscriberState {
  // Where this consumer stands between updates. `Unsynced`: it skips buckets until one that
  // begins an update (a late joiner, or one that lost part of an update); `AtBoundary`: the
  // last bucket it took ended an update (or it took none); `InUpdate`: it is within one.
  enum class Position { Unsynced, AtBoundary, InUpdate };

  std::string channel;
  ipc::Segment control_segment;
  ipc::ControlBlock* control;
  std::uint32_t slot_count;  // read once, checked: the control block may change under us
  ipc::PayloadHome home;     // read once too
  ipc::SlotPolicy policy;
  std::uint64_t incarnation;
  bool whole_updates;
  Position position;
  ipc::ConsumerRecord* record = nullptr;
  std::uint32_t record_index = 0;
  std::uint64_t token = 0;  // ours in record->claim
  std::uint64_t next_bucket = 0;
  PayloadLocation location;  // where views point: the host, or our ordinal of the device
  std::vector<ipc::SlotReader> slots;
  Clock::time_point last_liveness_check{};
  ManifestCache manifests;  // a producer resends the same layout every step
  ipc::Owner owner;
  ipc::OwnReleaseEvents release_events;  // none on the host; given back after the record is freed

  // On a CUDA channel, `device` is its device, which this process numbers `where.device`.
  SubscriberState(std::string name, ipc::Segment segment, std::uint32_t slots_in_channel, ipc::PayloadHome payload_home,
                  ipc::SlotPolicy slot_policy, std::uint64_t incarnation_id, bool whole, PayloadLocation where,
                  const ipc::DeviceUuid& device)
      : channel(std::move(name)),
        control_segment(std::move(segment)),
        control(reinterpret_cast<ipc::ControlBlock*>(control_segment.data())),
        slot_count(slots_in_channel),
        home(payload_home),
        policy(slot_policy),
        incarnation(incarnation_id),
        whole_updates(whole),
        position(whole ? Position::Unsynced : Position::AtBoundary),
        location(where),
        release_events(ipc::payload_device(where), slot_count) {
    for (std::uint32_t s = 0; s < slot_count; ++s) slots.emplace_back(channel, s, home, device, where.device);
  }

  // A child forked from the consumer inherits this handle and its buckets, but the record and
  // its leases stay the parent's: releasing them from the child (on its exit, say) would let
  // the producer overwrite buckets the parent is still reading.
  bool forked() const { return owner.forked(); }

  // Frees the record, unless it was taken from us, once the device work our releases were
  // ordered after is done; the lock goes after, with the descriptor, and the release events
  // back to the pool.
  ~SubscriberState() {
    if (record == nullptr || forked()) return;
    release_events.wait_for_releases();
    auto claim = ipc::atomic(record->claim).load(std::memory_order_seq_cst);
    for (int retry = 0; retry < kClaimRetries && ipc::claim_token(claim) == token; ++retry) {
      if (ipc::atomic(record->claim).compare_exchange_weak(claim, 0, std::memory_order_seq_cst)) break;
    }
    ipc::futex_bump_and_wake(control->producer_wake);
  }

  [[noreturn]] void fail_record_taken() const {
    refuse_if_control_damaged();  // then the record only looks taken
    fail(ErrorCode::SystemError, "record ", record_index, " of this consumer of channel ",
         Quoted{channel}, " was taken by another process (had its lock been dropped, by closing "
         "its descriptor?); attach again");
  }

  // Whether our record still carries our lease on slot `s`: then no producer can have claimed
  // it (a generation one past the leased one is its probe, to be undone).
  bool holds_lease(std::uint32_t s) const {
    auto claim = ipc::atomic(record->claim).load(std::memory_order_seq_cst);
    return ipc::claim_token(claim) == token && (ipc::claim_leases(claim) & (1u << s)) != 0;
  }

  bool record_is_ours() const {
    return ipc::claim_token(ipc::atomic(record->claim).load(std::memory_order_seq_cst)) == token;
  }

  // Sets or clears our lease on slot `s`, in the word that names us as the owner: false when
  // the record is no longer ours.
  bool set_lease(std::uint32_t s, bool held) {
    auto claim = ipc::atomic(record->claim).load(std::memory_order_seq_cst);
    for (int retry = 0; retry < kClaimRetries; ++retry) {
      if (ipc::claim_token(claim) != token) return false;
      auto leases = held ? ipc::claim_leases(claim) | (1u << s) : ipc::claim_leases(claim) & ~(1u << s);
      if (ipc::atomic(record->claim)
              .compare_exchange_weak(claim, ipc::make_claim(token, leases), std::memory_order_seq_cst)) {
        return true;
      }
    }
    return false;
  }

  void set_next_bucket(std::uint64_t bucket) {
    if (!record_is_ours()) fail_record_taken();
    next_bucket = bucket;
    ipc::atomic(record->next_bucket).store(bucket, std::memory_order_seq_cst);
  }

  std::uint64_t& generation(std::uint32_t s) { return control->slots[s].generation; }

  // Records slot `s`'s release event on `stream` (CUDA channels), before the release itself.
  // Where the event cannot be recorded (a stream of another context, say), the stream's work
  // is waited for on the host instead: the slot is given back only after it either way.
  void record_release(std::uint32_t s, CudaStream stream) noexcept {
    release_events.record(s, stream);
  }

  // How many buckets the producer published, checked. Seq_cst: after our claim, the loads
  // that follow it see a slot the producer started rewriting (see attach()).
  std::uint64_t published() {
    auto published = ipc::atomic(control->published).load(std::memory_order_seq_cst);
    if (published > kMaxBuckets) {
      fail(ErrorCode::HeaderCorrupt, "channel ", Quoted{channel}, " claims ", published,
           " published buckets, past the limit of ", kMaxBuckets);
    }
    return published;
  }

  // The oldest bucket still in a slot, or the next to be published when none is.
  std::uint64_t oldest_available() {
    auto oldest = published();
    for (std::uint32_t s = 0; s < slot_count; ++s) {
      auto g = ipc::atomic(generation(s)).load(std::memory_order_seq_cst);
      if (ipc::holds_bucket(g)) oldest = std::min(oldest, ipc::bucket_in(g));
    }
    return oldest;
  }

  // Unsynced: skips the held buckets from next_bucket on that are not an update's first (as
  // their places say), each released as if read (the producer counts it, and may reuse its
  // slot once we are past it); stops at one that begins an update or is not held. Leased for
  // the count: a claim between our look and the count would reset it.
  void skip_update_tails() {
    for (std::uint32_t turn = 0; turn <= slot_count; ++turn) {
      auto bucket = next_bucket;
      auto expected = ipc::generation_of(bucket);
      auto s = slot_holding(bucket);
      if (!s) return;
      auto place = place_in(*s);
      if (ipc::atomic(generation(*s)).load(std::memory_order_relaxed) != expected || place.bucket_index == 0) return;
      if (!set_lease(*s, true)) fail_record_taken();
      if (ipc::atomic(generation(*s)).load(std::memory_order_seq_cst) != expected) {
        set_lease(*s, false);
        return;
      }
      release(*s, expected);
      set_next_bucket(bucket + 1);
    }
  }

  // The slot holding `bucket`: slot bucket % slots first, where `block` puts it.
  std::optional<std::uint32_t> slot_holding(std::uint64_t bucket) {
    auto expected = ipc::generation_of(bucket);
    auto first = static_cast<std::uint32_t>(bucket % slot_count);
    if (ipc::atomic(generation(first)).load(std::memory_order_acquire) == expected) return first;
    for (std::uint32_t s = 0; s < slot_count; ++s) {
      if (s != first && ipc::atomic(generation(s)).load(std::memory_order_acquire) == expected) return s;
    }
    return std::nullopt;
  }

  // Slot `s`'s place in its update, read as the producer wrote it. Acquire: a look at the
  // generation after it is not made before it (a seqlock's second look; ThreadSanitizer
  // refuses a fence).
  ipc::SlotUpdate place_in(std::uint32_t s) {
    auto& place = control->slot_updates[s];
    return {ipc::atomic(place.version).load(std::memory_order_acquire),
            ipc::atomic(place.bucket_index).load(std::memory_order_acquire),
            ipc::atomic(place.bucket_count).load(std::memory_order_acquire),
            ipc::atomic(place.ordinal).load(std::memory_order_acquire)};
  }

  // The buckets the slots hold now, each with its place read under its generation (a
  // seqlock: the generation, the place, the generation again).
  std::vector<HeldBucket> held() {
    std::vector<HeldBucket> out;
    for (std::uint32_t s = 0; s < slot_count; ++s) {
      // Seq_cst, as in oldest_available().
      auto g = ipc::atomic(generation(s)).load(std::memory_order_seq_cst);
      if (!ipc::holds_bucket(g)) continue;
      auto place = place_in(s);
      if (ipc::atomic(generation(s)).load(std::memory_order_relaxed) == g) out.push_back({s, ipc::bucket_in(g), place});
    }
    return out;
  }

  // The first bucket of the newest update whose every bucket the slots hold, if any.
  static std::optional<std::uint64_t> newest_complete_update(const std::vector<HeldBucket>& held) {
    std::optional<std::uint64_t> newest;
    for (const auto& first : held) {
      if (first.place.bucket_index != 0 || (newest && *newest >= first.bucket)) continue;
      bool complete = true;
      for (std::uint32_t k = 1; k < first.place.bucket_count && complete; ++k) {
        complete = std::ranges::any_of(held, [&](const HeldBucket& other) {
          return other.bucket == first.bucket + k && other.place.bucket_index == k &&
                 other.place.bucket_count == first.place.bucket_count && other.place.version == first.place.version &&
                 other.place.ordinal == first.place.ordinal;
        });
      }
      if (complete) newest = first.bucket;
    }
    return newest;
  }

  // Under `latest`, between updates: on to the newest complete update, when one is newer than
  // where we stand.
  void skip_to_newest_update() {
    auto newest = newest_complete_update(held());
    // Below `published`: a generation a peer wrote past it leads nowhere.
    if (newest && *newest > next_bucket && *newest < published()) {
      set_next_bucket(*newest);
      position = Position::AtBoundary;
    }
  }

  // `bucket` was published and no slot holds it any more: on to the oldest bucket held after
  // it (or the next to be published), in the middle of an update that is lost to us.
  void skip_lost(std::uint64_t bucket, std::uint64_t published_now) {
    auto next = published_now;
    for (const auto& other : held()) {
      if (other.bucket > bucket) next = std::min(next, other.bucket);
    }
    set_next_bucket(std::max(next, bucket + 1));
    if (whole_updates) position = Position::Unsynced;
  }

  // Slot `s`'s generation, as it settles for a consumer that holds a confirmed lease on it: a
  // `latest` producer may probe a leased slot (make it odd, find our lease, make it even
  // again) when our lease came between its two looks at the records; the lease is what it
  // finds, so the odd value is gone within microseconds. A peer that leaves it odd is given
  // kProbeSettle.
  std::uint64_t settled_generation(std::uint32_t s, std::uint64_t leased_generation) {
    auto g = ipc::atomic(generation(s)).load(std::memory_order_acquire);
    auto give_up = Clock::now() + kProbeSettle;
    while (g == leased_generation + 1 && Clock::now() < give_up) {
      ipc::cpu_relax();
      g = ipc::atomic(generation(s)).load(std::memory_order_acquire);
    }
    return g;
  }

  // Gives back slot `s`, leased (confirmed) for the bucket of `expected_generation`, counting
  // a release of it: our lease bit, still set, keeps the slot from being rewritten, so an odd
  // value now is a producer's probe that will be undone (settled_generation()), not a rewrite.
  void release(std::uint32_t s, std::uint64_t expected_generation) {
    auto g = ipc::atomic(generation(s)).load(std::memory_order_acquire);
    if (g == expected_generation || g == expected_generation + 1) {
      ipc::atomic(control->slots[s].release_count).fetch_add(1, std::memory_order_release);
    }
    set_lease(s, false);  // a record taken from us holds no lease of ours
    ipc::futex_bump_and_wake(control->producer_wake);
  }

  // The liveness check is a system call, so it runs at most once per kLivenessPeriod; the
  // closed flag is read every time.
  bool producer_gone(Clock::time_point now) {
    if (ipc::atomic(control->closed).load(std::memory_order_acquire)) return true;
    if (now - last_liveness_check < kLivenessPeriod) return false;
    last_liveness_check = now;
    return producer_gone_now();
  }
  // Its lock free, or held by someone removing its leftovers, who marked the channel closed
  // first (leftovers.hpp).
  bool producer_gone_now() const {
    return ipc::atomic(control->closed).load(std::memory_order_acquire) != 0 ||
           !ipc::held_by_other(control_segment.descriptor(), ipc::kProducerLockByte);
  }

  void refuse_if_control_damaged() const {
    if (control_segment.damaged()) {
      fail(ErrorCode::SystemError, "the control segment of channel ", Quoted{channel},
           " was truncated by another process; attach again once it has a new producer");
    }
  }

  // Slot `s`'s bucket as mapped here (slot_storage.hpp).
  ipc::SlotMapping map_slot(std::uint32_t s) {
    auto mapping = slots[s].map(control->slots[s], control->device_slots[s]);
    if (mapping) return std::move(*mapping);
    if (ipc::atomic(control->closed).load(std::memory_order_acquire) || producer_gone_now()) {
      fail(ErrorCode::ProducerGone, "producer of channel ", Quoted{channel}, " is gone");
    }
    fail(ErrorCode::SystemError, "the segment of slot ", s, " of channel ", Quoted{channel}, " is missing");
  }

  // Claims a consumer record: one whose lock byte we can take, so whose owner, if any, is
  // dead. The compare-and-swap replaces exactly the word read (free, or the dead owner's);
  // it fails when the producer freed that record meanwhile, and then succeeds on the free one.
  void claim_record(std::uint32_t max_consumers) {
    for (std::uint32_t r = 0; r < max_consumers; ++r) {
      auto byte = ipc::consumer_lock_byte(r);
      if (!ipc::try_lock(control_segment.descriptor(), byte)) continue;  // a live owner's
      auto& candidate = control->consumers[r];
      TENSORBUCKET_TEST_HOOK(before_claim);
      // Ours to write while we hold the lock byte; the producer reads them after our claim.
      for (std::uint32_t s = 0; s < release_events.events.size(); ++s) {
        control->release_events[r].slots[s] = release_events.events[s].handle;
      }
      // Blocks every reuse of a slot from the claim on, until we choose where to start.
      ipc::atomic(candidate.next_bucket).store(0, std::memory_order_seq_cst);
      ipc::store_label(candidate.process, ipc::this_process());
      ipc::atomic(candidate.next_update).store(0, std::memory_order_relaxed);
      auto claims = ipc::atomic(control->claims).fetch_add(1, std::memory_order_relaxed) + 1;
      auto mine = ipc::make_claim(claims % ipc::kTokenLimit == 0 ? 1 : claims % ipc::kTokenLimit, 0);
      auto claim = ipc::atomic(candidate.claim).load(std::memory_order_seq_cst);
      for (int retry = 0; retry < kClaimRetries; ++retry) {
        if (ipc::atomic(candidate.claim).compare_exchange_weak(claim, mine, std::memory_order_seq_cst)) {
          record = &candidate;
          record_index = r;
          token = ipc::claim_token(mine);
          return;
        }
      }
      ipc::unlock(control_segment.descriptor(), byte);  // someone keeps rewriting it: next
    }
    fail(ErrorCode::ChannelFull, "channel ", Quoted{channel}, " already has ", max_consumers,
         " live consumers");
  }
};

struct detail::Lease {
  Lease(std::shared_ptr<SubscriberState> owner, std::uint32_t leased_slot, std::uint64_t leased_generation)
      : subscriber(std::move(owner)), slot(leased_slot), generation(leased_generation) {}
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  std::shared_ptr<SubscriberState> subscriber;
  ipc::SlotMapping mapping;  // keeps the views' memory mapped
  std::uint32_t slot;
  std::uint64_t generation;
  CudaStream stream = nullptr;  // what the release is ordered after, on a device

  ~Lease() {
    if (subscriber->forked()) return;
    subscriber->record_release(slot, stream);
    subscriber->release(slot, generation);
  }
};

namespace {

// The channel's control segment, once a live producer made it: a dead producer's leftovers are
// removed (unless someone else is at it) and waited past, as is a channel being closed.
// ChannelMissing at the deadline, or once it is interrupted.
ipc::Segment open_live_channel(std::string_view channel, const Deadline& deadline) {
  auto name = ipc::control_segment_name(channel);
  std::string last_seen;  // why the last look found no channel, for the error
  for (;;) {
    std::optional<ipc::Segment> segment;
    try {
      segment = ipc::Segment::open(name, sizeof(ipc::ControlBlock), true, ipc::Locks::kKept);
    } catch (const Error& e) {
      // A producer creates the object, then sizes it: too small may just mean too early.
      if (e.code() != ErrorCode::SystemError) throw;
      last_seen = message(": ", e.what());
    }
    if (segment) {
      auto* control = reinterpret_cast<ipc::ControlBlock*>(segment->data());
      // Acquire: the magic is written last, after the producer took its lock.
      if (ipc::atomic(control->magic).load(std::memory_order_acquire) == ipc::kControlMagic) {
        auto holder = ipc::holder_of(name, *segment);
        bool closed = ipc::atomic(control->closed).load(std::memory_order_acquire) != 0;
        if (holder == ipc::Holder::kProducer && !closed) return std::move(*segment);
        if (holder != ipc::Holder::kProducer) {
          if (holder == ipc::Holder::kNobody) holder = ipc::remove_if_dead(channel, name, *segment);
          last_seen = message("; the leftovers of its dead producer (pid ", ipc::load_label(control->producer).pid,
                              holder == ipc::Holder::kRemover ? ") are being removed by another process" : ") were removed");
        } else {
          last_seen = "; its producer was closing it";
        }
      }
    }
    auto now = Clock::now();
    if (deadline.passed(now)) {
      fail(ErrorCode::ChannelMissing, "channel ", Quoted{channel}, " had no live producer within ", deadline.limit(),
           last_seen);
    }
    if (deadline.interrupted(now)) {
      fail(ErrorCode::ChannelMissing, "channel ", Quoted{channel}, " had no live producer when its wait was interrupted",
           last_seen);
    }
    std::this_thread::sleep_for(deadline.next_sleep(kAttachPoll, now));
  }
}

std::shared_ptr<detail::SubscriberState> attach_state(std::string_view channel, const Deadline& deadline,
                                                      const SubscribeOptions& options) {
  auto segment = open_live_channel(channel, deadline);
  auto* control = reinterpret_cast<ipc::ControlBlock*>(segment.data());
  // Read once: what we check is what we use.
  auto layout_version = ipc::atomic(control->layout_version).load(std::memory_order_relaxed);
  std::uint32_t slot_count = ipc::atomic(control->slot_count).load(std::memory_order_relaxed);
  std::uint32_t max_consumers = ipc::atomic(control->max_consumers).load(std::memory_order_relaxed);
  auto home = ipc::atomic(control->payload_home).load(std::memory_order_relaxed);
  auto policy = ipc::atomic(control->policy).load(std::memory_order_relaxed);
  if (layout_version != ipc::kControlLayoutVersion || slot_count < 1 || slot_count > ipc::kMaxSlots ||
      max_consumers < 1 || max_consumers > ipc::kMaxConsumers ||
      home > static_cast<std::uint16_t>(ipc::PayloadHome::kCuda) ||
      policy > static_cast<std::uint16_t>(ipc::SlotPolicy::kLatest)) {
    fail(ErrorCode::HeaderCorrupt, "channel ", Quoted{channel}, " has an unusable control block (layout ",
         layout_version, ", ", slot_count, " slots, ", max_consumers, " consumers, payload home ", home, ", policy ",
         policy, ")");
  }
  auto payload_home = static_cast<ipc::PayloadHome>(home);
  auto kind = ipc::kind_of(payload_home);
  const auto& expected = options.expected_location;
  if (expected && *expected != kind) {
    fail(ErrorCode::LocationMismatch, "channel ", Quoted{channel}, " carries its payloads ",
         ipc::where_payloads_live(kind), ", not ", ipc::where_payloads_live(*expected), " as asked");
  }
  ipc::Home where_home{payload_home, control->device};  // one copy
  auto where = ipc::location_of(where_home);
  auto incarnation = ipc::atomic(control->incarnation).load(std::memory_order_relaxed);
  auto state = std::make_shared<detail::SubscriberState>(std::string(channel), std::move(segment), slot_count,
                                                         payload_home, static_cast<ipc::SlotPolicy>(policy),
                                                         incarnation, options.whole_updates, where, where_home.device);
  state->claim_record(max_consumers);
  TENSORBUCKET_TEST_HOOK(after_claim);
  // Claimed, with next_bucket 0, before choosing where to start: the producer cannot reuse
  // the oldest slot between our look at it and our cursor landing on it. If it claimed a slot
  // before seeing our claim, our look (after the claim, seq_cst) sees that slot odd.
  state->set_next_bucket(state->oldest_available());
  // A joiner of whole updates passes over the tail of one under way now, so that it does not
  // hold the producer back for buckets it will not take.
  if (options.whole_updates) state->skip_update_tails();
  ipc::futex_bump_and_wake(control->producer_wake);
  return state;
}

}  // namespace

Subscriber Subscriber::attach(std::string_view channel, const Deadline& deadline, const SubscribeOptions& options) {
  ipc::validate_channel_name(channel);
  return Subscriber(attach_state(channel, deadline, options), options);
}

Subscriber::Subscriber(std::shared_ptr<detail::SubscriberState> state, const SubscribeOptions& options)
    : state_(std::move(state)), options_(options) {}
Subscriber::Subscriber(Subscriber&&) noexcept = default;
Subscriber& Subscriber::operator=(Subscriber&&) noexcept = default;
Subscriber::~Subscriber() = default;

std::optional<ReceivedBucket> Subscriber::try_next(const VerifyOptions& options) {
  return next(std::chrono::milliseconds(0), options);
}

std::optional<ReceivedBucket> Subscriber::receive(const std::shared_ptr<detail::SubscriberState>& owner,
                                                  const Deadline& deadline, const VerifyOptions& options,
                                                  CudaStream stream) {
  using Position = detail::SubscriberState::Position;
  auto& state = *owner;
  auto* control = state.control;
  auto start = Clock::now();
  constexpr auto kNotWriting = Clock::time_point::max();
  auto writing_since = kNotWriting;  // since we saw a slot being written, after the last wake
  auto last_wake = ipc::wake_count(control->consumer_wake);
  int spin_restarts = 0;
  for (;;) {
    state.refuse_if_control_damaged();
    auto wake = ipc::wake_count(control->consumer_wake);
    // A wake (a claim, or a long copy near its end): spin again while a slot is written. Not
    // after a sleep that merely ran out: a producer that died writing would keep us spinning.
    if (wake != last_wake && writing_since != kNotWriting && spin_restarts < kWriteSpinRestarts) {
      writing_since = kNotWriting;
      ++spin_restarts;
    }
    last_wake = wake;
    if (state.policy == ipc::SlotPolicy::kLatest && state.position != Position::InUpdate) {
      state.skip_to_newest_update();
    }
    if (state.position == Position::Unsynced) state.skip_update_tails();
    // Published first, then the slots: a bucket counted as published is found in one, or
    // was overwritten since.
    auto published = state.published();
    auto bucket = state.next_bucket;
    auto expected = ipc::generation_of(bucket);
    auto held_in = state.slot_holding(bucket);

    if (held_in) {
      auto s = *held_in;
      auto& generation = state.generation(s);
      // Take the lease, then confirm the producer did not start rewriting meanwhile.
      if (!state.set_lease(s, true)) state.fail_record_taken();
      if (auto now_generation = ipc::atomic(generation).load(std::memory_order_seq_cst); now_generation != expected) {
        // Not ours after all: nothing read, nothing to count.
        state.set_lease(s, false);
        ipc::futex_bump_and_wake(control->producer_wake);
        // A producer probing the slot (odd) backs off for our lease within microseconds: wait
        // for that, or the bucket would look overwritten below. One that claimed it is writing
        // the slot: not worth spinning for.
        auto probe_end = std::min(deadline.at(), Clock::now() + kSpin);
        while (ipc::atomic(generation).load(std::memory_order_acquire) == now_generation &&
               ipc::being_written(now_generation) && Clock::now() < probe_end) {
          ipc::cpu_relax();
        }
        if (deadline.passed()) return std::nullopt;
        continue;
      }
      // Built in place: a Lease releases its slot when destroyed, temporaries included.
      auto lease = std::make_unique<detail::Lease>(owner, s, expected);
      // Whatever happens below, this bucket is done for us: advance before anything throws.
      state.set_next_bucket(bucket + 1);
      // And its update is lost to a consumer of whole updates, until it is handed out below.
      auto position = std::exchange(state.position, state.whole_updates ? Position::Unsynced : state.position);
      auto place = state.place_in(s);  // stable while leased
      lease->mapping = state.map_slot(s);
      lease->stream = stream;
      const auto& mapping = lease->mapping;
      const auto& shared = control->slots[s];
      auto view = [&] {
        try {
          return BucketView::open(mapping.frame, mapping.payload, options, &state.manifests, state.location);
        } catch (const Error& e) {
          // A frame changed under the producer, which then compares the next one with what
          // it means to send instead of assuming the slot still holds it.
          if (e.code() != ErrorCode::ManifestMismatch) {
            ipc::atomic(control->slots[s].manifest_doubt).store(1, std::memory_order_relaxed);
          }
          throw;
        }
      }();
      if (auto now_generation = state.settled_generation(s, expected);
          now_generation != expected && !(now_generation == expected + 1 && state.holds_lease(s))) {
        fail(ErrorCode::Torn, "slot ", s, " of channel ", Quoted{state.channel},
             " was rewritten while bucket ", bucket, " was read");
      }
      if (mapping.segment->damaged()) {
        fail(ErrorCode::Torn, "the segment of slot ", s, " of channel ", Quoted{state.channel},
             " was truncated by another process while bucket ", bucket, " was read");
      }
      if (position == Position::Unsynced && view.bucket_index() != 0) {  // released on the way
        if (deadline.passed()) return std::nullopt;
        continue;
      }
      mapping.make_ready(view, options.check_payload_checksum, stream, bucket);
      bool ends_update = view.bucket_index() + 1 == view.bucket_count();
      state.position = ends_update ? Position::AtBoundary : Position::InUpdate;
      ipc::atomic(state.record->next_update).store(place.ordinal + (ends_update ? 1 : 0), std::memory_order_relaxed);
      return ReceivedBucket(std::move(view), bucket, state.incarnation, shared.publish_start_ns, shared.published_ns,
                            std::move(lease));
    }
    if (bucket < published) {
      // Published, and no slot holds it any more: overwritten before we came (a joiner, or
      // any consumer under `latest`). On to what is still held.
      state.skip_lost(bucket, published);
      if (deadline.passed()) return std::nullopt;
      continue;
    }
    // Not published yet (or the producer is probing the slot and will back off for us).
    auto now = Clock::now();
    bool writing = false;
    for (std::uint32_t s = 0; s < state.slot_count && !writing; ++s) {
      writing = ipc::being_written(ipc::atomic(state.generation(s)).load(std::memory_order_relaxed));
    }
    if (writing && writing_since == kNotWriting) writing_since = now;
    bool spin = now - start < kSpin || (writing_since != kNotWriting && now - writing_since < kWriteSpin);
    if (spin && !deadline.passed(now)) {
      ipc::cpu_relax();
      continue;
    }
    if (!state.record_is_ours()) state.fail_record_taken();
    if (state.producer_gone(now)) {
      if (state.slot_holding(bucket) && !deadline.passed(now)) continue;
      fail(ErrorCode::ProducerGone, "producer of channel ", Quoted{state.channel},
           " is gone; every published bucket was received");
    }
    if (deadline.passed(now) || deadline.interrupted(now)) return std::nullopt;
    ipc::futex_wait(control->consumer_wake, wake, deadline.next_sleep(kWaitSlice, now));
  }
}

std::optional<ReceivedBucket> Subscriber::next(const Deadline& deadline, const VerifyOptions& options,
                                               CudaStream stream) {
  auto& state = *state_;
  if (state.forked()) {
    fail(ErrorCode::InvalidArgument, "this consumer of channel ", Quoted{state.channel},
         " belongs to process ", state.owner.pid(), "; process ", ::getpid(),
         " was forked from it and must attach on its own");
  }
  if (producer_gone_ && options_.follow_restarts) {
    // The next producer of the channel, before this call's deadline; nothing arrived when none came.
    try {
      state_ = attach_state(state.channel, deadline, options_);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ChannelMissing) throw;
      return std::nullopt;
    }
    producer_gone_ = false;
    pending_.clear();
    return next(deadline, options, stream);
  }
  try {
    return receive(state_, deadline, options, stream);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::ProducerGone) producer_gone_ = true;
    throw;
  }
}

std::optional<ReceivedUpdate> Subscriber::next_update(const Deadline& deadline, const VerifyOptions& options,
                                                      CudaStream stream) {
  VerifyOptions each = options;
  each.expected = nullptr;  // a bucket is part of the model: checked against it as a whole below
  for (;;) {
    std::optional<ReceivedBucket> bucket;
    try {
      bucket = next(deadline, each, stream);
    } catch (const Error&) {
      pending_.clear();  // a bucket of it failed, or the producer is gone: it cannot be completed
      throw;
    }
    if (!bucket) return std::nullopt;
    const auto& view = bucket->view();
    if (view.bucket_count() > state_->slot_count) {
      pending_.clear();
      fail(ErrorCode::InvalidArgument, "version ", view.version(), " on channel ", Quoted{state_->channel}, " has ",
           view.bucket_count(), " buckets but the channel ", state_->slot_count,
           " slots: next_update() holds a whole update at once, so the channel needs slots >= ", view.bucket_count(),
           " (take its buckets one by one with next())");
    }
    if (view.bucket_index() == 0) {
      pending_.clear();  // an update left unfinished is dropped
    } else {
      const auto* last = pending_.empty() ? nullptr : &pending_.back();
      bool follows = last != nullptr && last->incarnation() == bucket->incarnation() &&
                     last->sequence() + 1 == bucket->sequence() && last->view().version() == view.version() &&
                     last->view().bucket_count() == view.bucket_count() &&
                     last->view().bucket_index() + 1 == view.bucket_index();
      if (!follows) {  // the rest of an update we cannot have whole
        pending_.clear();
        if (deadline.passed()) return std::nullopt;
        continue;
      }
    }
    pending_.push_back(std::move(*bucket));
    if (pending_.size() < pending_.front().view().bucket_count()) {
      if (deadline.passed()) return std::nullopt;
      continue;
    }
    ReceivedUpdate update(std::exchange(pending_, {}));
    if (options.expected != nullptr) check_expected(update.manifest(), *options.expected);
    return update;
  }
}

const std::string& Subscriber::channel() const noexcept { return state_->channel; }
std::uint64_t Subscriber::incarnation() const noexcept { return state_->incarnation; }
OverflowPolicy Subscriber::policy() const noexcept {
  return state_->policy == ipc::SlotPolicy::kLatest ? OverflowPolicy::Latest : OverflowPolicy::Block;
}

Manifest ReceivedUpdate::manifest() const {
  Manifest together;
  together.version = version();
  std::unordered_map<std::string_view, std::uint32_t> bucket_of;
  for (const auto& bucket : buckets_) {
    const auto& view = bucket.view();
    for (const auto& entry : view.manifest().entries) {
      auto [where, added] = bucket_of.emplace(entry.name, view.bucket_index());
      if (!added) {
        fail(ErrorCode::DuplicateName, "entry ", Quoted{entry.name}, " is in buckets ", where->second, " and ",
             view.bucket_index(), " of version ", version());
      }
      together.entries.push_back(entry);
    }
  }
  return together;
}

void ReceivedUpdate::release() noexcept {
  for (auto& bucket : buckets_) bucket.release();
}
void ReceivedUpdate::release(CudaStream stream) noexcept {
  for (auto& bucket : buckets_) bucket.release(stream);
}

ReceivedBucket::ReceivedBucket(BucketView view, std::uint64_t sequence, std::uint64_t incarnation,
                               std::uint64_t publish_start_ns, std::uint64_t published_ns,
                               std::unique_ptr<detail::Lease> lease)
    : view_(std::move(view)),
      sequence_(sequence),
      incarnation_(incarnation),
      publish_start_ns_(publish_start_ns),
      published_ns_(published_ns),
      lease_(std::move(lease)) {}
ReceivedBucket::ReceivedBucket(ReceivedBucket&&) noexcept = default;
ReceivedBucket& ReceivedBucket::operator=(ReceivedBucket&&) noexcept = default;
ReceivedBucket::~ReceivedBucket() = default;

void ReceivedBucket::release() noexcept { lease_.reset(); }

void ReceivedBucket::release(CudaStream stream) noexcept {
  if (lease_) lease_->stream = stream;
  lease_.reset();
}

PayloadLocation Subscriber::location() const noexcept { return state_->location; }

void ReceivedBucket::wait_ready() const {
  if (!lease_) fail(ErrorCode::InvalidArgument, "bucket ", sequence_, " was released");
  lease_->mapping.wait_ready(lease_->stream);
}

std::vector<std::byte> ReceivedBucket::copy_to_host() const {
  if (!lease_) fail(ErrorCode::InvalidArgument, "bucket ", sequence_, " was released");
  // All of the payload, the padding after each entry included: what its checksum covers, and
  // the bytes serve sends of a device bucket.
  return lease_->mapping.copy_to_host(view_.payload().size(), lease_->stream);
}

}  // namespace tensorbucket
