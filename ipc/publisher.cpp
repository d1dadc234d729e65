// The producer side of a channel. See ipc/control.hpp for the protocol and docs/channel.md
// for the crash cases.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "control.hpp"
#include "futex.hpp"
#include "segment.hpp"
#include "serialize/copy.hpp"
#include "serialize/identity.hpp"
#include "serialize/text.hpp"
#include "tensorbucket/channel.hpp"

namespace tensorbucket {

using text::fail;
using text::Quoted;

namespace {

constexpr std::uint64_t kPageBytes = 4096;
constexpr std::uint64_t kMinFrameCapacity = 64 * 1024;
// Longest single futex sleep, so liveness and deadlines are rechecked that often.
constexpr auto kWaitSlice = std::chrono::milliseconds(10);

std::uint64_t round_up(std::uint64_t bytes, std::uint64_t to) { return (bytes + to - 1) / to * to; }

using Clock = std::chrono::steady_clock;

}  // namespace

struct detail::PublisherState {
  std::string channel;
  PublisherOptions options;
  ipc::Segment control_segment;
  ipc::ControlBlock* control;
  std::vector<std::optional<ipc::Segment>> slot_segments;
  std::vector<std::uint64_t> slot_generation;  // what this producer last stored per slot
  std::vector<std::uint64_t> frame_encoding;   // per slot: the encoding_id_ its frame holds, or 0
  std::uint64_t published = 0;
  bool reservation_open = false;
  bool closed = false;
  ipc::Owner owner;

  PublisherState(std::string name, const PublisherOptions& opts, ipc::Segment segment)
      : channel(std::move(name)),
        options(opts),
        control_segment(std::move(segment)),
        control(reinterpret_cast<ipc::ControlBlock*>(control_segment.data())),
        slot_segments(opts.slots),
        slot_generation(opts.slots, 0),
        frame_encoding(opts.slots, 0) {}

  ipc::SlotControl& slot(std::uint32_t s) { return control->slots[s]; }

  // A child forked from the producer inherits this handle, but the channel stays the
  // parent's: the child may not publish on it, and its exit (which may close the handle) must
  // not take the channel down under the parent.
  bool forked() const { return owner.forked(); }
  void refuse_if_forked() const {
    if (forked()) {
      fail(ErrorCode::InvalidArgument, "channel ", Quoted{channel}, " belongs to process ", owner.pid(),
           "; process ", ::getpid(), " was forked from it and cannot act as its producer");
    }
  }

  void reclaim(ipc::ConsumerRecord& record) {
    ipc::atomic(record.held_slots).store(0, std::memory_order_seq_cst);
    ipc::atomic(record.state).store(ipc::kFree, std::memory_order_release);
  }

  // True when no live consumer still needs `bucket` in slot `s`. Dead consumers met on the
  // way are reclaimed: checking liveness only for consumers that block keeps the fast path
  // free of /proc reads.
  bool slot_releasable(std::uint32_t s, std::uint64_t bucket) {
    if (ipc::atomic(slot(s).release_count).load(std::memory_order_acquire) <
        options.min_consumers) {
      return false;
    }
    for (std::uint32_t r = 0; r < options.max_consumers; ++r) {
      auto& record = control->consumers[r];
      auto state = ipc::atomic(record.state).load(std::memory_order_seq_cst);
      if (state == ipc::kFree) continue;
      bool blocks = state == ipc::kClaimed ||
                    ipc::atomic(record.next_bucket).load(std::memory_order_seq_cst) <= bucket ||
                    (ipc::atomic(record.held_slots).load(std::memory_order_seq_cst) & (1u << s));
      if (!blocks) continue;
      auto process = ipc::load_process(record.process);
      // A claimed record without a pid is a consumer between its two attach steps.
      if (process.pid != 0 && !ipc::is_alive(process)) {
        reclaim(record);
        continue;
      }
      return false;
    }
    return true;
  }

  // Makes slot `bucket % slots` ours (generation odd), waiting until its old bucket is
  // releasable. False at the deadline.
  bool claim(std::uint64_t bucket, Clock::time_point deadline) {
    auto s = static_cast<std::uint32_t>(bucket % options.slots);
    auto current = slot_generation[s];
    auto& generation = slot(s).generation;
    for (;;) {
      auto wake = ipc::wake_count(control->producer_wake);
      if (current == 0 || slot_releasable(s, current / 2 - 1)) {
        // Claim, then look again: a consumer may have taken a lease between the two. It sets
        // its bit then reads the generation; we write the generation then read the bits.
        ipc::atomic(generation).store(current + 1, std::memory_order_seq_cst);
        if (current == 0 || slot_releasable(s, current / 2 - 1)) {
          ipc::atomic(slot(s).release_count).store(0, std::memory_order_relaxed);
          return true;
        }
        ipc::atomic(generation).store(current, std::memory_order_seq_cst);
        ipc::futex_bump_and_wake(control->consumer_wake);
      }
      auto now = Clock::now();
      if (now >= deadline) return false;
      ipc::futex_wait(control->producer_wake, wake,
                      std::min<Clock::duration>(deadline - now, kWaitSlice));
    }
  }

  // The slot's segment, grown (as a new segment under the next epoch) when it cannot hold
  // `payload_bytes` + `frame_bytes`. Only called while the slot is claimed.
  ipc::Segment& segment_for(std::uint32_t s, std::uint64_t payload_bytes, std::uint64_t frame_bytes) {
    auto& control_slot = slot(s);
    auto& segment = slot_segments[s];
    auto payload_capacity = control_slot.payload_capacity;
    auto frame_capacity = control_slot.segment_bytes - payload_capacity;
    if (segment && payload_bytes <= payload_capacity && frame_bytes <= frame_capacity) {
      return *segment;
    }
    payload_capacity = round_up(std::max(payload_bytes, payload_capacity), kPageBytes);
    frame_capacity = round_up(std::max({frame_bytes, frame_capacity, kMinFrameCapacity}), kPageBytes);
    auto old_epoch = control_slot.segment_epoch;
    auto epoch = old_epoch + 1;
    auto grown = ipc::Segment::create(ipc::slot_segment_name(channel, s, epoch),
                                      payload_capacity + frame_capacity, options.mode);
    control_slot.segment_epoch = epoch;
    control_slot.segment_bytes = payload_capacity + frame_capacity;
    control_slot.payload_capacity = payload_capacity;
    if (old_epoch != 0) ipc::Segment::remove(ipc::slot_segment_name(channel, s, old_epoch));
    segment = std::move(grown);
    frame_encoding[s] = 0;
    return *segment;
  }

  // Writes the header, binding the manifest begin() wrote to the payload, and publishes the
  // claimed slot.
  void finish(std::uint64_t bucket, std::uint64_t payload_bytes) {
    auto s = static_cast<std::uint32_t>(bucket % options.slots);
    auto& control_slot = slot(s);
    auto* base = slot_segments[s]->data();
    auto* frame = base + control_slot.payload_capacity;
    std::span<const std::byte> manifest_bytes{frame + sizeof(BucketHeader),
                                              control_slot.frame_bytes - sizeof(BucketHeader)};
    auto header = make_header(manifest_bytes, {base, payload_bytes},
                              {.payload_checksum = options.payload_checksum});
    std::memcpy(frame, &header, sizeof header);

    control_slot.published_ns = ipc::monotonic_ns();
    // Release: the bytes and slot fields above are visible to a consumer that sees this value.
    slot_generation[s] = 2 * (bucket + 1);
    ipc::atomic(control_slot.generation).store(slot_generation[s], std::memory_order_release);
    published = bucket + 1;
    ipc::atomic(control->published).store(published, std::memory_order_release);
    ipc::futex_bump_and_wake(control->consumer_wake);
  }

  // Leaves a claimed slot empty: its old bucket was releasable, its new one never came.
  void abandon(std::uint64_t bucket) noexcept {
    auto s = static_cast<std::uint32_t>(bucket % options.slots);
    slot_generation[s] = 0;
    ipc::atomic(slot(s).generation).store(0, std::memory_order_release);
    ipc::futex_bump_and_wake(control->consumer_wake);
  }

  // A producer resends its layout every step, so the slot's frame usually holds it already but
  // for the identity fields at its front: writing only those leaves the rest (~60 bytes an
  // entry) in the consumers' caches, where they read it to verify the next bucket. Known
  // without a look when this producer wrote the same encoding there; else compared.
  void write_manifest(std::uint32_t s, std::byte* to, std::span<const std::byte> manifest_bytes,
                      std::uint64_t encoding_id) {
    auto front = std::min(manifest_bytes.size(), detail::kIdentityEnd);
    std::memcpy(to, manifest_bytes.data(), front);
    if (frame_encoding[s] == encoding_id) return;
    auto rest = manifest_bytes.subspan(front);
    if (std::memcmp(to + front, rest.data(), rest.size()) != 0) std::memcpy(to + front, rest.data(), rest.size());
    frame_encoding[s] = encoding_id;
  }

  // Claims the next slot, sizes its segment and writes the manifest into its frame; nullopt on
  // timeout, else where the payload goes. `encoding_id`: see write_manifest().
  std::optional<std::byte*> begin(std::uint64_t payload_bytes,
                                  std::span<const std::byte> manifest_bytes,
                                  std::uint64_t encoding_id, std::chrono::milliseconds timeout) {
    if (closed) fail(ErrorCode::InvalidArgument, "channel ", Quoted{channel}, " is closed");
    refuse_if_forked();
    if (reservation_open) {
      fail(ErrorCode::InvalidArgument, "channel ", Quoted{channel},
           " has an open reservation; commit or drop it first");
    }
    auto start_ns = ipc::monotonic_ns();
    if (!claim(published, ipc::deadline_after(timeout))) return std::nullopt;
    auto s = static_cast<std::uint32_t>(published % options.slots);
    // Consumers asleep waiting for this bucket wake now, and spin while it is written: their
    // wake-up overlaps the writing (see kWriteSpin in subscriber.cpp).
    ipc::futex_bump_and_wake(control->consumer_wake);
    try {
      auto& control_slot = slot(s);
      control_slot.publish_start_ns = start_ns;
      auto frame_bytes = sizeof(BucketHeader) + manifest_bytes.size();
      auto* base = segment_for(s, payload_bytes, frame_bytes).data();
      write_manifest(s, base + control_slot.payload_capacity + sizeof(BucketHeader), manifest_bytes,
                     encoding_id);
      control_slot.frame_bytes = frame_bytes;
      return base;
    } catch (...) {
      abandon(published);
      throw;
    }
  }

  void remove_segments() noexcept {
    for (std::uint32_t s = 0; s < options.slots; ++s) {
      if (auto epoch = slot(s).segment_epoch) {
        ipc::Segment::remove(ipc::slot_segment_name(channel, s, epoch));
      }
    }
    ipc::Segment::remove(ipc::control_segment_name(channel));
  }
};

namespace {

// Removes what a dead producer left under `channel`. ChannelExists if its producer lives.
void remove_stale_channel(std::string_view channel) {
  auto name = ipc::control_segment_name(channel);
  auto segment = ipc::Segment::open(name, 0, false);
  if (!segment) return;
  if (segment->size() >= sizeof(ipc::ControlBlock)) {
    auto* control = reinterpret_cast<ipc::ControlBlock*>(segment->data());
    auto producer = ipc::load_process(control->producer);
    if (ipc::is_alive(producer)) {
      fail(ErrorCode::ChannelExists, "channel ", Quoted{channel}, " is owned by live process ",
           producer.pid);
    }
    // The dead producer may have died growing a slot, between creating one epoch and
    // unlinking the previous: remove the neighbours too.
    auto slots = std::min<std::uint32_t>(control->slot_count, ipc::kMaxSlots);
    for (std::uint32_t s = 0; s < slots; ++s) {
      auto epoch = ipc::atomic(control->slots[s].segment_epoch).load(std::memory_order_relaxed);
      for (auto e : {epoch - 1, epoch, epoch + 1}) {
        if (e != 0) ipc::Segment::remove(ipc::slot_segment_name(channel, s, e));
      }
    }
  }
  ipc::Segment::remove(name);
}

void validate(const PublisherOptions& options) {
  if (options.slots < 1 || options.slots > ipc::kMaxSlots) {
    fail(ErrorCode::InvalidArgument, "slots must be 1..", ipc::kMaxSlots, ", not ", options.slots);
  }
  if (options.max_consumers < 1 || options.max_consumers > ipc::kMaxConsumers) {
    fail(ErrorCode::InvalidArgument, "max_consumers must be 1..", ipc::kMaxConsumers, ", not ",
         options.max_consumers);
  }
  if (options.min_consumers > options.max_consumers) {
    fail(ErrorCode::InvalidArgument, "min_consumers ", options.min_consumers,
         " exceeds max_consumers ", options.max_consumers);
  }
  if (options.mode > 0777 || (options.mode & 0600) != 0600) {
    fail(ErrorCode::InvalidArgument, "mode 0", std::oct, options.mode,
         " must be permission bits that let the owner read and write");
  }
}

}  // namespace

Publisher Publisher::create(std::string_view channel, const PublisherOptions& options) {
  ipc::validate_channel_name(channel);
  validate(options);
  auto name = ipc::control_segment_name(channel);
  auto segment = [&] {
    try {
      return ipc::Segment::create(name, sizeof(ipc::ControlBlock), options.mode);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ChannelExists) throw;
      remove_stale_channel(channel);
      return ipc::Segment::create(name, sizeof(ipc::ControlBlock), options.mode);
    }
  }();
  auto* control = reinterpret_cast<ipc::ControlBlock*>(segment.data());
  control->layout_version = ipc::kControlLayoutVersion;
  control->slot_count = static_cast<std::uint16_t>(options.slots);
  control->max_consumers = options.max_consumers;
  control->min_consumers = options.min_consumers;
  control->payload_checksum = options.payload_checksum;
  ipc::store_process(control->producer, ipc::current_process());
  // Release: a consumer that reads the magic sees every field above.
  ipc::atomic(control->magic).store(ipc::kControlMagic, std::memory_order_release);
  return Publisher(std::make_unique<detail::PublisherState>(std::string(channel), options,
                                                             std::move(segment)));
}

Publisher::Publisher(std::unique_ptr<detail::PublisherState> state) : state_(std::move(state)) {}
Publisher::Publisher(Publisher&&) noexcept = default;
Publisher& Publisher::operator=(Publisher&& other) noexcept {
  if (this != &other) {
    close();
    state_ = std::move(other.state_);
  }
  return *this;
}
Publisher::~Publisher() { close(); }

bool Publisher::publish(const BucketBuilder& bucket, std::chrono::milliseconds timeout) {
  auto manifest_bytes = bucket.encoded_manifest();  // refuses incomplete groups before any claim
  auto payload_bytes = bucket.payload_bytes();
  auto base = state_->begin(payload_bytes, manifest_bytes, bucket.encoding_id_, timeout);
  if (!base) return false;
  try {
    bucket.pack_into({*base, payload_bytes});
  } catch (...) {
    state_->abandon(state_->published);
    throw;
  }
  state_->finish(state_->published, payload_bytes);
  return true;
}

std::optional<Reservation> Publisher::reserve(const BucketBuilder& layout,
                                              std::chrono::milliseconds timeout) {
  auto manifest_bytes = layout.encoded_manifest();
  auto payload_bytes = layout.payload_bytes();
  auto base = state_->begin(payload_bytes, manifest_bytes, layout.encoding_id_, timeout);
  if (!base) return std::nullopt;
  std::span<std::byte> payload{*base, payload_bytes};
  // Zero the padding between entries, so no bytes of an older bucket travel in it. Only the
  // padding: zeroing a whole 256 MiB payload here evicted the caches the handoff then needed.
  std::uint64_t written = 0;
  for (const auto& entry : layout.manifest().entries) {
    if (entry.byte_offset > written) std::memset(payload.data() + written, 0, entry.byte_offset - written);
    written = entry.byte_offset + entry.byte_length;
  }
  std::memset(payload.data() + written, 0, payload_bytes - written);
  state_->reservation_open = true;
  return Reservation(state_.get(), payload_bytes, layout.entry_spans(payload),
                     detail::streams(payload));
}

bool Publisher::drain(std::chrono::milliseconds timeout) {
  state_->refuse_if_forked();
  auto deadline = ipc::deadline_after(timeout);
  auto& state = *state_;
  for (;;) {
    auto wake = ipc::wake_count(state.control->producer_wake);
    bool drained = true;
    for (std::uint32_t s = 0; s < state.options.slots && drained; ++s) {
      auto generation = state.slot_generation[s];
      drained = generation == 0 || state.slot_releasable(s, generation / 2 - 1);
    }
    if (drained) return true;
    auto now = Clock::now();
    if (now >= deadline) return false;
    ipc::futex_wait(state.control->producer_wake, wake,
                    std::min<Clock::duration>(deadline - now, kWaitSlice));
  }
}

void Publisher::close() noexcept {
  if (!state_ || state_->closed) return;
  state_->closed = true;
  if (state_->forked()) return;  // the channel is the parent's
  ipc::atomic(state_->control->closed).store(1, std::memory_order_release);
  ipc::futex_bump_and_wake(state_->control->consumer_wake);
  state_->remove_segments();
}

std::uint64_t Publisher::published() const noexcept { return state_->published; }
const std::string& Publisher::channel() const noexcept { return state_->channel; }

Reservation::Reservation(detail::PublisherState* state, std::uint64_t payload_bytes,
                         std::vector<std::span<std::byte>> spans, bool streaming)
    : state_(state),
      payload_bytes_(payload_bytes),
      spans_(std::move(spans)),
      streaming_(streaming) {}

Reservation::Reservation(Reservation&& other) noexcept
    : state_(std::exchange(other.state_, nullptr)),
      payload_bytes_(other.payload_bytes_),
      spans_(std::move(other.spans_)),
      streaming_(other.streaming_) {}

void Reservation::write(std::size_t index, const void* data) {
  if (state_ == nullptr) fail(ErrorCode::InvalidArgument, "reservation was already committed");
  // The slot is the parent's, taken before the fork: writing it would change the bucket the
  // parent is about to publish.
  state_->refuse_if_forked();
  if (index >= spans_.size()) {
    fail(ErrorCode::InvalidArgument, "entry ", index, " is past the last of ", spans_.size());
  }
  detail::copy_bytes(spans_[index].data(), static_cast<const std::byte*>(data),
                     spans_[index].size(), streaming_);
}

Reservation::~Reservation() {
  if (state_ == nullptr || state_->forked()) return;
  state_->reservation_open = false;
  state_->abandon(state_->published);
}

void Reservation::commit() {
  if (state_ == nullptr) fail(ErrorCode::InvalidArgument, "reservation was already committed");
  state_->refuse_if_forked();
  if (streaming_) detail::finish_streaming();
  auto* state = std::exchange(state_, nullptr);
  state->reservation_open = false;
  // For the in-place path the handoff starts here: the writing before it is the caller's.
  state->slot(static_cast<std::uint32_t>(state->published % state->options.slots)).publish_start_ns =
      ipc::monotonic_ns();
  state->finish(state->published, payload_bytes_);
}

}  // namespace tensorbucket
