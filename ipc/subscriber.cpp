// The consumer side of a channel. See ipc/control.hpp for the protocol and docs/channel.md
// for the crash cases and what a hostile peer can do.
#include <unistd.h>

#include <optional>
#include <thread>

#include "control.hpp"
#include "futex.hpp"
#include "liveness.hpp"
#include "process.hpp"
#include "segment.hpp"
#include "serialize/text.hpp"
#include "tensorbucket/channel.hpp"
#include "test_hooks.hpp"

namespace tensorbucket {

using text::fail;
using text::Quoted;

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWaitSlice = std::chrono::milliseconds(10);
// Spinning this long before sleeping keeps the handoff in microseconds when the producer is
// about to publish, at the price of that much CPU per empty wait.
constexpr auto kSpin = std::chrono::microseconds(50);
// While the producer writes the awaited slot (its generation odd), a consumer spins up to this
// long before it sleeps again: the producer wakes consumers when it claims the slot, so their
// wake-up, tens of µs on a VM, overlaps the writing of a small bucket (1000 x 1 KiB: ~60 µs)
// instead of following it. A larger bucket takes longer to write than this, and its consumers
// sleep until the commit: spinning consumers that outnumber the free cores would slow the
// producer's writing down.
constexpr auto kWriteSpin = std::chrono::microseconds(200);
constexpr auto kLivenessPeriod = std::chrono::milliseconds(5);
// No producer publishes this many buckets (2^62: 146 years at a bucket per nanosecond), so
// a larger count in the control block is damage, and 2(b+1) cannot overflow below it.
constexpr std::uint64_t kMaxBuckets = std::uint64_t{1} << 62;
// A compare-and-swap of our own record fails only while another thread of ours releases a
// lease: a few retries. Endless failures mean another process keeps writing the record.
constexpr int kClaimRetries = 1000;

}  // namespace

struct detail::SubscriberState {
  std::string channel;
  ipc::Segment control_segment;
  ipc::ControlBlock* control;
  std::uint32_t slot_count;  // read once, checked: the control block may change under us
  ipc::ConsumerRecord* record = nullptr;
  std::uint32_t record_index = 0;
  std::uint64_t token = 0;  // ours in record->claim
  std::uint64_t next_bucket = 0;
  struct MappedSlot {
    std::uint64_t epoch = 0;
    std::shared_ptr<ipc::Segment> segment;
  };
  std::vector<MappedSlot> slots;
  Clock::time_point last_liveness_check{};
  ManifestCache manifests;  // a producer resends the same layout every step
  ipc::Owner owner;

  SubscriberState(std::string name, ipc::Segment segment, std::uint32_t slots_in_channel)
      : channel(std::move(name)),
        control_segment(std::move(segment)),
        control(reinterpret_cast<ipc::ControlBlock*>(control_segment.data())),
        slot_count(slots_in_channel),
        slots(slots_in_channel) {}

  // A child forked from the consumer inherits this handle and its buckets, but the record and
  // its leases stay the parent's: releasing them from the child (on its exit, say) would let
  // the producer overwrite buckets the parent is still reading.
  bool forked() const { return owner.forked(); }

  // Frees the record, unless it was taken from us; the lock goes after, with the descriptor.
  ~SubscriberState() {
    if (record == nullptr || forked()) return;
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

  // The oldest bucket still in a slot, or the next to be published when none is. Seq_cst:
  // after our claim, these loads see a slot the producer started rewriting (see attach()).
  std::uint64_t oldest_available() {
    auto oldest = ipc::atomic(control->published).load(std::memory_order_seq_cst);
    if (oldest > kMaxBuckets) {
      fail(ErrorCode::HeaderCorrupt, "channel ", Quoted{channel}, " claims ", oldest,
           " published buckets, past the limit of ", kMaxBuckets);
    }
    for (std::uint32_t s = 0; s < slot_count; ++s) {
      auto g = ipc::atomic(generation(s)).load(std::memory_order_seq_cst);
      if (g != 0 && g % 2 == 0) oldest = std::min(oldest, g / 2 - 1);
    }
    return oldest;
  }

  void release(std::uint32_t s, std::uint64_t expected_generation) {
    if (ipc::atomic(generation(s)).load(std::memory_order_acquire) == expected_generation) {
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
    return !ipc::held_by_other(control_segment.descriptor(), ipc::kProducerLockByte);
  }

  void refuse_if_control_damaged() const {
    if (control_segment.damaged()) {
      fail(ErrorCode::SystemError, "the control segment of channel ", Quoted{channel},
           " was truncated by another process; attach again once it has a new producer");
    }
  }

  // Where a slot's bucket lies: its mapping and the frame's place in it.
  struct SlotLayout {
    std::shared_ptr<ipc::Segment> segment;
    std::uint64_t payload_capacity;
    std::uint64_t frame_bytes;
  };

  // Slot `s`'s segment and layout. The fields come from the control block, which anyone can
  // write: each is read once, and checked against the mapping this consumer actually holds.
  SlotLayout map_slot(std::uint32_t s) {
    auto& shared = control->slots[s];
    auto epoch = ipc::atomic(shared.segment_epoch).load(std::memory_order_relaxed);
    auto payload_capacity = ipc::atomic(shared.payload_capacity).load(std::memory_order_relaxed);
    auto frame_bytes = ipc::atomic(shared.frame_bytes).load(std::memory_order_relaxed);
    auto& mapped = slots[s];
    if (!mapped.segment || mapped.epoch != epoch || mapped.segment->damaged()) {
      mapped = {};
      auto name = ipc::slot_segment_name(channel, s, epoch);
      auto segment = epoch == 0 ? std::nullopt : ipc::Segment::open(name, 0, false);
      if (!segment) {
        if (producer_gone(Clock::now())) {
          fail(ErrorCode::ProducerGone, "producer of channel ", Quoted{channel}, " is gone");
        }
        fail(ErrorCode::SystemError, "slot segment ", Quoted{name}, " is missing");
      }
      mapped = {epoch, std::make_shared<ipc::Segment>(std::move(*segment))};
    }
    auto size = mapped.segment->size();
    if (payload_capacity > size || frame_bytes > size - payload_capacity) {
      fail(ErrorCode::HeaderCorrupt, "slot ", s, " of channel ", Quoted{channel}, " declares a ",
           frame_bytes, "-byte frame after ", payload_capacity, " payload bytes, but its segment has ",
           size, " bytes");
    }
    return {mapped.segment, payload_capacity, frame_bytes};
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
      // Blocks every reuse of a slot from the claim on, until we choose where to start.
      ipc::atomic(candidate.next_bucket).store(0, std::memory_order_seq_cst);
      ipc::store_label(candidate.process, ipc::this_process());
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
  std::shared_ptr<ipc::Segment> segment;  // keeps the views' memory mapped
  std::uint32_t slot;
  std::uint64_t generation;

  ~Lease() {
    if (!subscriber->forked()) subscriber->release(slot, generation);
  }
};

Subscriber Subscriber::attach(std::string_view channel, std::chrono::milliseconds timeout) {
  ipc::validate_channel_name(channel);
  auto name = ipc::control_segment_name(channel);
  auto deadline = ipc::deadline_after(timeout);
  std::optional<ipc::Segment> segment;
  for (;;) {
    try {
      segment = ipc::Segment::open(name, sizeof(ipc::ControlBlock), true, ipc::Locks::kKept);
    } catch (const Error& e) {
      // A producer creates the object, then sizes it: too small may just mean too early.
      if (e.code() != ErrorCode::SystemError) throw;
      if (Clock::now() >= deadline) {
        fail(ErrorCode::ChannelMissing, "channel ", Quoted{channel}, " did not appear within ",
             timeout.count(), " ms: ", e.what());
      }
      segment.reset();
    }
    if (segment) {
      auto* control = reinterpret_cast<ipc::ControlBlock*>(segment->data());
      if (ipc::atomic(control->magic).load(std::memory_order_acquire) == ipc::kControlMagic) break;
    }
    if (Clock::now() >= deadline) {
      fail(ErrorCode::ChannelMissing, "channel ", Quoted{channel}, " did not appear within ",
           timeout.count(), " ms");
    }
    // Nothing to wait on before the control block exists: poll.
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto* control = reinterpret_cast<ipc::ControlBlock*>(segment->data());
  // Read once: what we check is what we use.
  auto layout_version = ipc::atomic(control->layout_version).load(std::memory_order_relaxed);
  std::uint32_t slot_count = ipc::atomic(control->slot_count).load(std::memory_order_relaxed);
  std::uint32_t max_consumers = ipc::atomic(control->max_consumers).load(std::memory_order_relaxed);
  if (layout_version != ipc::kControlLayoutVersion || slot_count < 1 || slot_count > ipc::kMaxSlots ||
      max_consumers < 1 || max_consumers > ipc::kMaxConsumers) {
    fail(ErrorCode::HeaderCorrupt, "channel ", Quoted{channel}, " has an unusable control block (layout ",
         layout_version, ", ", slot_count, " slots, ", max_consumers, " consumers)");
  }
  auto state = std::make_shared<detail::SubscriberState>(std::string(channel), std::move(*segment), slot_count);
  state->claim_record(max_consumers);
  TENSORBUCKET_TEST_HOOK(after_claim);
  // Claimed, with next_bucket 0, before choosing where to start: the producer cannot reuse
  // the oldest slot between our look at it and our cursor landing on it. If it claimed a slot
  // before seeing our claim, our look (after the claim, seq_cst) sees that slot odd.
  state->set_next_bucket(state->oldest_available());
  ipc::futex_bump_and_wake(control->producer_wake);
  return Subscriber(std::move(state));
}

Subscriber::Subscriber(std::shared_ptr<detail::SubscriberState> state) : state_(std::move(state)) {}
Subscriber::Subscriber(Subscriber&&) noexcept = default;
Subscriber& Subscriber::operator=(Subscriber&&) noexcept = default;
Subscriber::~Subscriber() = default;

std::optional<ReceivedBucket> Subscriber::try_next(const VerifyOptions& options) {
  return next(std::chrono::milliseconds(0), options);
}

std::optional<ReceivedBucket> Subscriber::next(std::chrono::milliseconds timeout,
                                               const VerifyOptions& options) {
  auto& state = *state_;
  if (state.forked()) {
    fail(ErrorCode::InvalidArgument, "this consumer of channel ", Quoted{state.channel},
         " belongs to process ", state.owner.pid(), "; process ", ::getpid(),
         " was forked from it and must attach on its own");
  }
  auto* control = state.control;
  auto start = Clock::now();
  auto deadline = ipc::deadline_after(timeout);
  std::optional<Clock::time_point> writing_since;  // when we first saw the slot being written
  for (;;) {
    state.refuse_if_control_damaged();
    auto wake = ipc::wake_count(control->consumer_wake);
    auto bucket = state.next_bucket;
    auto s = static_cast<std::uint32_t>(bucket % state.slot_count);
    auto expected = 2 * (bucket + 1);
    auto& generation = state.generation(s);
    auto g = ipc::atomic(generation).load(std::memory_order_acquire);

    if (g == expected) {
      // Take the lease, then confirm the producer did not start rewriting meanwhile.
      if (!state.set_lease(s, true)) state.fail_record_taken();
      if (ipc::atomic(generation).load(std::memory_order_seq_cst) != expected) {
        state.release(s, expected);
        if (Clock::now() >= deadline) return std::nullopt;
        continue;
      }
      // Built in place: a Lease releases its slot when destroyed, temporaries included.
      auto lease = std::make_unique<detail::Lease>(state_, s, expected);
      // Whatever happens below, this bucket is done for us: advance before anything throws.
      state.set_next_bucket(bucket + 1);
      auto layout = state.map_slot(s);
      lease->segment = layout.segment;
      const auto& shared = control->slots[s];
      auto* base = layout.segment->data();
      auto view = [&] {
        try {
          return BucketView::open({base + layout.payload_capacity, layout.frame_bytes},
                                  {base, layout.payload_capacity}, options, &state.manifests);
        } catch (const Error& e) {
          // A frame changed under the producer, which then compares the next one with what
          // it means to send instead of assuming the slot still holds it.
          if (e.code() != ErrorCode::ManifestMismatch) {
            ipc::atomic(control->slots[s].manifest_doubt).store(1, std::memory_order_relaxed);
          }
          throw;
        }
      }();
      if (ipc::atomic(generation).load(std::memory_order_acquire) != expected) {
        fail(ErrorCode::Torn, "slot ", s, " of channel ", Quoted{state.channel},
             " was rewritten while bucket ", bucket, " was read");
      }
      if (layout.segment->damaged()) {
        fail(ErrorCode::Torn, "the segment of slot ", s, " of channel ", Quoted{state.channel},
             " was truncated by another process while bucket ", bucket, " was read");
      }
      return ReceivedBucket(std::move(view), bucket, shared.publish_start_ns, shared.published_ns,
                            std::move(lease));
    }
    if (g > expected + 1) {
      // Bucket `bucket` was overwritten before we registered: start from what is still held.
      // When nothing later is held, the slot's generation ran ahead of `published` (the
      // producer stores it just before) or was damaged: wait, as for an unpublished bucket.
      auto oldest = state.oldest_available();
      if (oldest > bucket) {
        state.set_next_bucket(oldest);
        if (Clock::now() >= deadline) return std::nullopt;
        continue;
      }
    }
    // Not published yet (or the producer is probing the slot and will back off for us).
    auto now = Clock::now();
    if (g % 2 == 1 && !writing_since) writing_since = now;
    bool spin = now - start < kSpin || (writing_since && now - *writing_since < kWriteSpin);
    if (spin && now < deadline) {
      ipc::cpu_relax();
      continue;
    }
    if (!state.record_is_ours()) state.fail_record_taken();
    if (state.producer_gone(now)) {
      if (ipc::atomic(generation).load(std::memory_order_acquire) == expected) continue;
      fail(ErrorCode::ProducerGone, "producer of channel ", Quoted{state.channel},
           " is gone; every published bucket was received");
    }
    if (now >= deadline) return std::nullopt;
    ipc::futex_wait(control->consumer_wake, wake,
                    std::min<Clock::duration>(deadline - now, kWaitSlice));
  }
}

const std::string& Subscriber::channel() const noexcept { return state_->channel; }

ReceivedBucket::ReceivedBucket(BucketView view, std::uint64_t sequence,
                               std::uint64_t publish_start_ns, std::uint64_t published_ns,
                               std::unique_ptr<detail::Lease> lease)
    : view_(std::move(view)),
      sequence_(sequence),
      publish_start_ns_(publish_start_ns),
      published_ns_(published_ns),
      lease_(std::move(lease)) {}
ReceivedBucket::ReceivedBucket(ReceivedBucket&&) noexcept = default;
ReceivedBucket& ReceivedBucket::operator=(ReceivedBucket&&) noexcept = default;
ReceivedBucket::~ReceivedBucket() = default;

void ReceivedBucket::release() noexcept { lease_.reset(); }

}  // namespace tensorbucket
