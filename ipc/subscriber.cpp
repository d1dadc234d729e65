// The consumer side of a channel. See ipc/control.hpp for the protocol and docs/channel.md
// for the crash cases.
#include <unistd.h>

#include <optional>
#include <thread>

#include "control.hpp"
#include "futex.hpp"
#include "segment.hpp"
#include "serialize/text.hpp"
#include "tensorbucket/channel.hpp"

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

}  // namespace

struct detail::SubscriberState {
  std::string channel;
  ipc::Segment control_segment;
  ipc::ControlBlock* control;
  std::uint32_t slot_count;
  ipc::ConsumerRecord* record;
  std::uint64_t next_bucket = 0;
  struct MappedSlot {
    std::uint64_t epoch = 0;
    std::shared_ptr<ipc::Segment> segment;
  };
  std::vector<MappedSlot> slots;
  Clock::time_point last_liveness_check{};
  ManifestCache manifests;  // a producer resends the same layout every step
  ipc::Owner owner;

  SubscriberState(std::string name, ipc::Segment segment)
      : channel(std::move(name)),
        control_segment(std::move(segment)),
        control(reinterpret_cast<ipc::ControlBlock*>(control_segment.data())),
        slot_count(control->slot_count),
        record(nullptr),
        slots(slot_count) {}

  // A child forked from the consumer inherits this handle and its buckets, but the record and
  // its leases stay the parent's: releasing them from the child (on its exit, say) would let
  // the producer overwrite buckets the parent is still reading.
  bool forked() const { return owner.forked(); }

  ~SubscriberState() {
    if (record == nullptr || forked()) return;
    ipc::atomic(record->held_slots).store(0, std::memory_order_seq_cst);
    ipc::atomic(record->state).store(ipc::kFree, std::memory_order_release);
    ipc::futex_bump_and_wake(control->producer_wake);
  }

  std::uint64_t& generation(std::uint32_t s) { return control->slots[s].generation; }

  // The oldest bucket still in a slot, or the next to be published when none is.
  std::uint64_t oldest_available() {
    auto oldest = ipc::atomic(control->published).load(std::memory_order_acquire);
    for (std::uint32_t s = 0; s < slot_count; ++s) {
      auto g = ipc::atomic(generation(s)).load(std::memory_order_acquire);
      if (g != 0 && g % 2 == 0) oldest = std::min(oldest, g / 2 - 1);
    }
    return oldest;
  }

  void release(std::uint32_t s, std::uint64_t expected_generation) {
    if (ipc::atomic(generation(s)).load(std::memory_order_acquire) == expected_generation) {
      ipc::atomic(control->slots[s].release_count).fetch_add(1, std::memory_order_release);
    }
    ipc::atomic(record->held_slots).fetch_and(~(1u << s), std::memory_order_seq_cst);
    ipc::futex_bump_and_wake(control->producer_wake);
  }

  // The liveness check reads /proc, so it runs at most once per kLivenessPeriod; the closed
  // flag is read every time.
  bool producer_gone(Clock::time_point now) {
    if (ipc::atomic(control->closed).load(std::memory_order_acquire)) return true;
    if (now - last_liveness_check < kLivenessPeriod) return false;
    last_liveness_check = now;
    auto producer = ipc::load_process(control->producer);
    return !ipc::is_alive(producer);
  }

  // The mapping of slot `s`'s current segment. Sizes come from the producer and are checked
  // against each other and against the object's real size (fstat) before use.
  std::shared_ptr<ipc::Segment> map_slot(std::uint32_t s) {
    const auto& control_slot = control->slots[s];
    if (control_slot.payload_capacity > control_slot.segment_bytes ||
        control_slot.frame_bytes > control_slot.segment_bytes - control_slot.payload_capacity) {
      fail(ErrorCode::HeaderCorrupt, "slot ", s, " of channel ", Quoted{channel},
           " declares a ", control_slot.frame_bytes, "-byte frame after ",
           control_slot.payload_capacity, " payload bytes in a ", control_slot.segment_bytes,
           "-byte segment");
    }
    auto& mapped = slots[s];
    if (mapped.segment && mapped.epoch == control_slot.segment_epoch) return mapped.segment;
    auto name = ipc::slot_segment_name(channel, s, control_slot.segment_epoch);
    auto segment = ipc::Segment::open(name, control_slot.segment_bytes, false);
    if (!segment) {
      if (producer_gone(Clock::now())) fail(ErrorCode::ProducerGone, "producer of channel ", Quoted{channel}, " is gone");
      fail(ErrorCode::SystemError, "slot segment ", Quoted{name}, " is missing");
    }
    mapped = {control_slot.segment_epoch, std::make_shared<ipc::Segment>(std::move(*segment))};
    return mapped.segment;
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
      segment = ipc::Segment::open(name, sizeof(ipc::ControlBlock), true);
    } catch (const Error& e) {
      // A producer creates the object, then sizes it: too small may just mean too early.
      if (e.code() != ErrorCode::SystemError || Clock::now() >= deadline) throw;
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
  if (control->layout_version != ipc::kControlLayoutVersion || control->slot_count < 1 ||
      control->slot_count > ipc::kMaxSlots || control->max_consumers < 1 ||
      control->max_consumers > ipc::kMaxConsumers) {
    fail(ErrorCode::HeaderCorrupt, "channel ", Quoted{channel}, " has an unusable control block (layout ",
         control->layout_version, ", ", control->slot_count, " slots, ", control->max_consumers,
         " consumers)");
  }
  auto state = std::make_shared<detail::SubscriberState>(std::string(channel), std::move(*segment));
  for (std::uint32_t r = 0; r < control->max_consumers && state->record == nullptr; ++r) {
    auto expected = static_cast<std::uint32_t>(ipc::kFree);
    if (ipc::atomic(control->consumers[r].state)
            .compare_exchange_strong(expected, ipc::kClaimed, std::memory_order_seq_cst)) {
      state->record = &control->consumers[r];
    }
  }
  if (state->record == nullptr) {
    fail(ErrorCode::ChannelFull, "channel ", Quoted{channel}, " already has ",
         control->max_consumers, " consumers");
  }
  auto& record = *state->record;
  ipc::atomic(record.held_slots).store(0, std::memory_order_relaxed);
  ipc::store_process(record.process, ipc::current_process());
  // Registered (claimed) before choosing where to start, so the producer cannot reuse the
  // oldest slot between our look at it and our cursor landing on it.
  state->next_bucket = state->oldest_available();
  ipc::atomic(record.next_bucket).store(state->next_bucket, std::memory_order_seq_cst);
  ipc::atomic(record.state).store(ipc::kActive, std::memory_order_seq_cst);
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
    auto wake = ipc::wake_count(control->consumer_wake);
    auto bucket = state.next_bucket;
    auto s = static_cast<std::uint32_t>(bucket % state.slot_count);
    auto expected = 2 * (bucket + 1);
    auto& generation = state.generation(s);
    auto g = ipc::atomic(generation).load(std::memory_order_acquire);

    if (g == expected) {
      // Take the lease, then confirm the producer did not start rewriting meanwhile.
      ipc::atomic(state.record->held_slots).fetch_or(1u << s, std::memory_order_seq_cst);
      if (ipc::atomic(generation).load(std::memory_order_seq_cst) != expected) {
        state.release(s, expected);
        continue;
      }
      // Built in place: a Lease releases its slot when destroyed, temporaries included.
      auto lease = std::make_unique<detail::Lease>(state_, s, expected);
      // Whatever happens below, this bucket is done for us: advance before anything throws.
      state.next_bucket = bucket + 1;
      ipc::atomic(state.record->next_bucket).store(bucket + 1, std::memory_order_seq_cst);
      lease->segment = state.map_slot(s);
      const auto& control_slot = control->slots[s];
      auto* base = lease->segment->data();
      auto view = BucketView::open({base + control_slot.payload_capacity, control_slot.frame_bytes},
                                   {base, control_slot.payload_capacity}, options,
                                   &state.manifests);
      if (ipc::atomic(generation).load(std::memory_order_acquire) != expected) {
        fail(ErrorCode::Torn, "slot ", s, " of channel ", Quoted{state.channel},
             " was rewritten while bucket ", bucket, " was read");
      }
      return ReceivedBucket(std::move(view), bucket, control_slot.publish_start_ns,
                            control_slot.published_ns, std::move(lease));
    }
    if (g > expected + 1) {
      // Bucket `bucket` was overwritten before we registered: start from what is still held.
      state.next_bucket = std::max(bucket + 1, state.oldest_available());
      ipc::atomic(state.record->next_bucket).store(state.next_bucket, std::memory_order_seq_cst);
      continue;
    }
    // Not published yet (or the producer is probing the slot and will back off for us).
    auto now = Clock::now();
    if (g % 2 == 1 && !writing_since) writing_since = now;
    bool spin = now - start < kSpin || (writing_since && now - *writing_since < kWriteSpin);
    if (spin && now < deadline) {
      ipc::cpu_relax();
      continue;
    }
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
