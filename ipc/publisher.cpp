// The producer side of a channel. See ipc/control.hpp for the protocol and docs/channel.md
// for the crash cases and what a hostile peer can do.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "base/text.hpp"
#include "ipc/control.hpp"
#include "ipc/leftovers.hpp"
#include "ipc/os/futex.hpp"
#include "ipc/os/liveness.hpp"
#include "ipc/os/process.hpp"
#include "ipc/os/segment.hpp"
#include "ipc/payload_writer.hpp"
#include "ipc/slot_storage.hpp"
#include "serialize/copy.hpp"
#include "serialize/identity.hpp"
#include "tensorbucket/channel.hpp"

namespace tensorbucket {

using text::fail;
using text::message;
using text::Quoted;

namespace {

// Longest single futex sleep, so liveness and deadlines are rechecked that often.
constexpr auto kWaitSlice = std::chrono::milliseconds(10);
// Producers racing for one name each win or lose in one or two rounds; more rounds mean
// someone keeps creating and removing it.
constexpr int kNameRounds = 16;
// How many times a `latest` producer looks over its slots for one nobody leases before it waits.
constexpr int kLatestLooks = 4;
// Consumers asleep while a long copy is written are woken again when it is due to end within
// this: time for their wake-up (tens of µs on a VM), and within the 200 µs they then spin
// (kWriteSpin, subscriber.cpp). Waking them only at the commit put their whole wake-up after
// it (bench/RESULTS.md, issue 21).
constexpr auto kWakeLead = std::chrono::microseconds(120);

using ipc::bucket_in;
using Clock = std::chrono::steady_clock;

// "pid 123", or "pid 123 (in another pid namespace)" when it is not one of ours.
std::string describe(const ipc::ProcessLabel& process) {
  auto ours = ipc::pid_namespace();
  bool foreign = process.pid_namespace != 0 && ours != 0 && process.pid_namespace != ours;
  return text::joined("pid ", process.pid, foreign ? " (in another pid namespace)" : "");
}

}  // namespace

struct detail::PublisherState {
  // What this producer wrote into a slot's SlotControl, kept here and never read back from
  // shared memory, which any consumer can write.
  struct Slot {
    ipc::SlotStorage storage;
    std::uint64_t generation = 0;  // 0 or 2(b+1), as last published
    std::uint64_t frame_encoding = 0;  // the encoding_id() whose manifest the frame holds, or 0
    std::uint64_t payload_layout = 0;  // the encoding_id() whose padding the payload has zeroed
  };

  std::string channel;
  PublisherOptions options;
  std::uint64_t incarnation;
  ipc::Segment control_segment;
  ipc::ControlBlock* control;
  std::vector<Slot> slots;
  std::uint32_t open_slot = 0;  // the slot claimed for the bucket being written
  ipc::PayloadWriter writer;
  std::uint64_t published = 0;
  std::uint64_t updates = 0;  // updates begun: buckets with index 0 published
  // Where the last published bucket stood in its update (none before the first), and where
  // the open one stands: the order publish() enforces, and each slot's SlotUpdate.
  std::optional<ipc::SlotUpdate> last_place;
  ipc::SlotUpdate open_place{};
  std::optional<std::uint64_t> complete_from;  // the first bucket of the newest complete update
  // The open bucket's header, begun when its manifest was written: it hashes the manifest
  // this producer meant, not the bytes in the slot, which a peer may have changed since.
  BucketHeader header{};
  // What the last slot_releasable() that said no waited for: a record, or releases.
  struct Blocker {
    std::optional<std::uint32_t> record;  // none: too few releases for min_consumers
    bool leased = false;
    std::uint32_t slot = 0;
    std::uint64_t bucket = 0;
    std::uint32_t releases = 0;
  } blocker;
  std::string waiting_for;  // see Publisher::waiting_for(); worded only when a wait times out
  bool reservation_open = false;
  bool closed = false;
  ipc::Owner owner;

  PublisherState(std::string name, const PublisherOptions& opts, std::uint64_t incarnation_id, ipc::Segment segment)
      : channel(std::move(name)),
        options(opts),
        incarnation(incarnation_id),
        control_segment(std::move(segment)),
        control(reinterpret_cast<ipc::ControlBlock*>(control_segment.data())),
        writer(ipc::payload_device(options.location)) {
    slots.reserve(options.slots);
    for (std::uint32_t s = 0; s < options.slots; ++s) {
      slots.push_back({ipc::SlotStorage(channel, s, options.mode, ipc::payload_device(options.location), incarnation)});
    }
  }

  bool latest() const { return options.policy == OverflowPolicy::Latest; }
  ipc::SlotControl& shared_slot(std::uint32_t s) { return control->slots[s]; }

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

  void refuse_if_control_damaged() const {
    if (control_segment.damaged()) {
      fail(ErrorCode::SystemError, "the control segment of channel ", Quoted{channel},
           " was truncated by another process; the channel cannot go on");
    }
  }

  // Who still needs a slot's bucket: `Lossless`, every live consumer that has not read it or
  // holds it, and min_consumers releases (`block`); `Leased`, only a live consumer's lease.
  enum class Need { Lossless, Leased };

  // True when no live consumer still needs `bucket` in slot `s`. The records that block it
  // are checked for liveness (a lock test, ~0.5 us: only for those, so the fast path makes no
  // system call); a dead one's record is freed, by compare-and-swap of the exact word judged
  // dead, so a record an attacher took over meanwhile is left alone. When false, `blocker`
  // says who blocks.
  bool slot_releasable(std::uint32_t s, std::uint64_t bucket, Need need = Need::Lossless) {
    // The count first: it costs no system call, and while a consumer still reads the bucket it
    // says no by itself. Testing that consumer's lock meanwhile, at every wake-up, slowed the
    // handoff to a sleeping consumer ~2x here (the two processes share two cores).
    auto releases = ipc::atomic(shared_slot(s).release_count).load(std::memory_order_acquire);
    if (need == Need::Lossless && releases < options.min_consumers) {
      blocker = {std::nullopt, false, s, bucket, releases};
      return false;
    }
    // Every record, not only max_consumers of them: attach reads that bound from shared
    // memory, where a peer may have raised it.
    for (std::uint32_t r = 0; r < ipc::kMaxConsumers; ++r) {
      auto& record = control->consumers[r];
      auto claim = ipc::atomic(record.claim).load(std::memory_order_seq_cst);
      if (ipc::claim_token(claim) == 0) continue;
      bool leased = (ipc::claim_leases(claim) & (1u << s)) != 0;
      if (!leased && (need == Need::Leased || ipc::atomic(record.next_bucket).load(std::memory_order_seq_cst) > bucket)) {
        continue;
      }
      if (!ipc::held_by_other(control_segment.descriptor(), ipc::consumer_lock_byte(r)) &&
          ipc::atomic(record.claim).compare_exchange_strong(claim, 0, std::memory_order_seq_cst)) {
        continue;
      }
      blocker = {r, leased, s, bucket, 0};
      return false;
    }
    return true;
  }

  // Words `blocker` into `waiting_for`, for a wait that timed out. Too few releases: a live
  // consumer that still holds or has not read the bucket is named if there is one. Joined, not
  // streamed: a producer out of descriptors words it too (text::joined says why).
  void word_blocker() {
    bool attached = false;  // any live consumer
    for (std::uint32_t r = 0; r < ipc::kMaxConsumers && !blocker.record; ++r) {
      auto claim = ipc::atomic(control->consumers[r].claim).load(std::memory_order_acquire);
      bool leased = (ipc::claim_leases(claim) & (1u << blocker.slot)) != 0;
      if (ipc::claim_token(claim) == 0 || !ipc::held_by_other(control_segment.descriptor(), ipc::consumer_lock_byte(r))) {
        continue;
      }
      attached = true;
      if (leased || ipc::atomic(control->consumers[r].next_bucket).load(std::memory_order_acquire) <= blocker.bucket) {
        blocker.record = r;
        blocker.leased = leased;
      }
    }
    if (!blocker.record) {
      waiting_for = text::joined(attached ? "consumers" : "a consumer (none is attached)", " to release bucket ",
                                 blocker.bucket, " (min_consumers is ", options.min_consumers, "; ",
                                 blocker.releases, " did)");
      return;
    }
    auto& record = control->consumers[*blocker.record];
    waiting_for = text::joined("consumer ", describe(ipc::load_label(record.process)), " (record ", *blocker.record,
                               "), which ", blocker.leased ? "still holds bucket " : "has not read bucket ",
                               blocker.bucket, published_ago(blocker.slot));
  }

  // ", published 2.5 s ago": how long a consumer may have held the bucket in slot `s` at most.
  // Read from memory a consumer can write: nothing when the time is not a past one.
  std::string published_ago(std::uint32_t s) {
    auto published = ipc::atomic(shared_slot(s).published_ns).load(std::memory_order_relaxed);
    auto now = monotonic_ns();
    if (published == 0 || published > now) return "";
    char text[48];
    std::snprintf(text, sizeof text, ", published %.1f s ago", static_cast<double>(now - published) / 1e9);
    return text;
  }

  // Whether slot `s` is empty or holds a bucket older than the newest complete update and the
  // update under way (Publisher::Claim::SparingNewest). The update under way began at most
  // bucket_index + 1 buckets ago, as place_of() keeps its buckets in order.
  bool spares_newest(std::uint32_t s) const {
    auto generation = slots[s].generation;
    if (generation == 0) return true;
    auto kept_from = published;
    if (last_place && last_place->bucket_index + 1 < last_place->bucket_count) kept_from -= last_place->bucket_index + 1;
    if (complete_from) kept_from = std::min(kept_from, *complete_from);
    return bucket_in(generation) < kept_from;
  }

  // Makes the slot for the next bucket ours (its generation odd), waiting until one is free:
  // under `block` slot published % slots once its bucket is releasable, under `latest` the
  // slot of the oldest bucket that no live consumer leases. False at the deadline; with
  // `SparingNewest`, at once when that slot holds a bucket it spares.
  bool claim(const Deadline& deadline, Publisher::Claim which) {
    bool sparing = which == Publisher::Claim::SparingNewest;
    for (;;) {
      refuse_if_control_damaged();
      auto wake = ipc::wake_count(control->producer_wake);
      bool spared = false;
      bool claimed = false;
      if (latest()) {
        claimed = claim_unleased(sparing, spared);
      } else {
        auto next = static_cast<std::uint32_t>(published % options.slots);
        spared = sparing && !spares_newest(next);
        claimed = !spared && try_claim(next, Need::Lossless);
      }
      if (claimed) {
        waiting_for.clear();
        return true;
      }
      if (spared) {
        waiting_for = "a slot that holds no bucket of the newest update (Claim::SparingNewest)";
        return false;
      }
      auto now = Clock::now();
      if (deadline.passed(now) || deadline.interrupted(now)) {
        word_blocker();
        return false;
      }
      ipc::futex_wait(control->producer_wake, wake, deadline.next_sleep(kWaitSlice, now));
    }
  }

  // Under `latest`: the slots from empty, then oldest bucket, to newest, the first nobody leases.
  // A consumer's leases move while we look (it releases one update, leases the next), so one
  // look can find every slot leased at the moment it was looked at while fewer ever were at
  // once: a few looks before the caller waits. `sparing`: only a slot whose bucket every live
  // consumer is done with, as `block` asks; one that holds a bucket of the newest update ends
  // the look (each after it is newer) and sets `spared`.
  bool claim_unleased(bool sparing, bool& spared) {
    std::uint32_t order[ipc::kMaxSlots];
    for (std::uint32_t s = 0; s < options.slots; ++s) order[s] = s;
    std::sort(order, order + options.slots,
              [&](std::uint32_t a, std::uint32_t b) { return slots[a].generation < slots[b].generation; });
    for (int look = 0; look < kLatestLooks; ++look) {
      for (std::uint32_t i = 0; i < options.slots; ++i) {
        if (sparing && !spares_newest(order[i])) {
          spared = true;
          break;
        }
        if (try_claim(order[i], sparing ? Need::Lossless : Need::Leased)) return true;
      }
    }
    return false;
  }

  // Claims slot `s` if nobody needs its bucket, then looks again: a consumer may have taken a
  // lease between the two. It sets its bit then reads the generation; we write the generation
  // then read the bits.
  bool try_claim(std::uint32_t s, Need need) {
    auto current = slots[s].generation;
    auto& generation = shared_slot(s).generation;
    if (current != 0 && !slot_releasable(s, bucket_in(current), need)) return false;
    ipc::atomic(generation).store(current + 1, std::memory_order_seq_cst);
    if (current == 0 || slot_releasable(s, bucket_in(current), need)) {
      ipc::atomic(shared_slot(s).release_count).store(0, std::memory_order_relaxed);
      open_slot = s;
      return true;
    }
    ipc::atomic(generation).store(current, std::memory_order_seq_cst);
    ipc::futex_bump_and_wake(control->consumer_wake);
    return false;
  }

  // Where a bucket stands in its update, checked against the last published: bucket 0 begins
  // an update, any other follows the one before it. InvalidArgument otherwise, before anything
  // is claimed.
  ipc::SlotUpdate place_of(const Manifest& manifest) const {
    if (latest() && manifest.bucket_count > options.update_buckets) {
      fail(ErrorCode::InvalidArgument, "bucket_count ", manifest.bucket_count, " exceeds the update_buckets ",
           options.update_buckets, " channel ", Quoted{channel},
           " was created with: a `latest` channel sizes its slots by it");
    }
    if (manifest.bucket_index == 0) return {manifest.version, 0, manifest.bucket_count, updates};
    auto follows = last_place && last_place->version == manifest.version &&
                   last_place->bucket_count == manifest.bucket_count &&
                   last_place->bucket_index + 1 == manifest.bucket_index;
    if (!follows) {
      auto last = last_place ? message("bucket ", last_place->bucket_index, " of ", last_place->bucket_count,
                                       " of version ", last_place->version)
                             : std::string("nothing");
      fail(ErrorCode::InvalidArgument, "bucket ", manifest.bucket_index, " of ", manifest.bucket_count,
           " of version ", manifest.version, " does not follow what channel ", Quoted{channel},
           " published last (", last, "): publish an update's buckets in order, from bucket 0");
    }
    return {manifest.version, manifest.bucket_index, manifest.bucket_count, last_place->ordinal};
  }

  // A producer resends its layout every step, so the slot's frame usually holds it already but
  // for the identity fields at its front: writing only the bytes that differ leaves the rest
  // (~60 bytes an entry) in the consumers' caches, where they read it to verify the next
  // bucket. Which bytes differ is known without a look when this producer wrote the same
  // encoding there, else found by a compare (~1.5 us for 1000 entries). Another process may
  // have changed them since: the header hashes the manifest meant, so the consumer refuses
  // that bucket and sets the slot's manifest_doubt, and the next bucket compares again.
  void write_manifest(std::uint32_t s, std::byte* to, std::span<const std::byte> manifest_bytes,
                      std::uint64_t encoding_id) {
    auto front = std::min(manifest_bytes.size(), detail::kIdentityEnd);
    std::memcpy(to, manifest_bytes.data(), front);
    auto& doubt = shared_slot(s).manifest_doubt;
    if (slots[s].frame_encoding == encoding_id && ipc::atomic(doubt).load(std::memory_order_relaxed) == 0) return;
    ipc::atomic(doubt).store(0, std::memory_order_relaxed);
    auto rest = manifest_bytes.subspan(front);
    if (std::memcmp(to + front, rest.data(), rest.size()) != 0) std::memcpy(to + front, rest.data(), rest.size());
    slots[s].frame_encoding = encoding_id;
  }

  // Writes the header and publishes the claimed slot: the bucket's bytes are in place (on a
  // device: queued on `stream`, which the ready event recorded here covers).
  // Whatever throws before the generation is published leaves the slot empty: a slot left odd
  // would block every later claim of it.
  void finish(std::uint64_t bucket, std::uint64_t payload_bytes) {
    auto s = open_slot;
    auto& slot = slots[s];
    try {
      auto scope = writer.scope();
      if (options.payload_checksum) {
        auto hash = writer.hash({slot.storage.payload(), payload_bytes});
        header.flags |= kPayloadChecksum | (hash.block_hash ? kPayloadBlockHash : 0);
        header.payload_xxh3 = hash.value;
      }
      std::memcpy(slot.storage.frame().data(), &header, sizeof header);
      slot.storage.record_ready(writer.stream());
      refuse_if_control_damaged();
      if (slot.storage.damaged()) {
        fail(ErrorCode::SystemError, "the segment of slot ", s, " of channel ", Quoted{channel},
             " was truncated by another process while bucket ", bucket, " was written; it was not published");
      }
    } catch (...) {
      abandon();
      throw;
    }
    auto& shared = shared_slot(s);
    shared.published_ns = monotonic_ns();
    auto& place = control->slot_updates[s];
    ipc::atomic(place.version).store(open_place.version, std::memory_order_relaxed);
    ipc::atomic(place.bucket_index).store(open_place.bucket_index, std::memory_order_relaxed);
    ipc::atomic(place.bucket_count).store(open_place.bucket_count, std::memory_order_relaxed);
    ipc::atomic(place.ordinal).store(open_place.ordinal, std::memory_order_relaxed);
    if (open_place.bucket_index == 0) {
      updates = open_place.ordinal + 1;
      ipc::atomic(control->updates).store(updates, std::memory_order_relaxed);
    }
    if (open_place.bucket_index + 1 == open_place.bucket_count) complete_from = bucket - open_place.bucket_index;
    last_place = open_place;
    // Release: the bytes and slot fields above are visible to a consumer that sees this value.
    slot.generation = ipc::generation_of(bucket);
    ipc::atomic(shared.generation).store(slot.generation, std::memory_order_release);
    published = bucket + 1;
    ipc::atomic(control->published).store(published, std::memory_order_release);
    ipc::futex_bump_and_wake(control->consumer_wake);
  }

  // Wakes the consumers when a copy of `bytes` into the claimed slot is due to end soon; not
  // when the payload is hashed after the copy (finish()), which takes longer than they spin.
  detail::NearEnd wake_near_end(std::uint64_t bytes) {
    if (options.payload_checksum) return {bytes, kWakeLead, nullptr};
    return {bytes, kWakeLead, [this] { ipc::futex_bump_and_wake(control->consumer_wake); }};
  }

  // Leaves the claimed slot empty: its old bucket was releasable, its new one never came.
  void abandon() noexcept {
    auto s = open_slot;
    slots[s].generation = 0;
    slots[s].payload_layout = 0;  // begin() set it before the host padding was zeroed (a pack that threw)
    ipc::atomic(shared_slot(s).generation).store(0, std::memory_order_release);
    ipc::futex_bump_and_wake(control->consumer_wake);
  }

  // Claims the next slot, sizes its storage, writes the manifest into its frame and readies the
  // payload for writing (PayloadWriter::begin()); nullopt at the deadline, else where the payload
  // goes (a device address on a device channel, where `on` is the stream that writes it).
  std::optional<std::byte*> begin(std::uint64_t payload_bytes, const Manifest& manifest,
                                  std::span<const std::byte> manifest_bytes,
                                  std::uint64_t encoding_id, const Deadline& deadline,
                                  ipc::DeviceStream on, Publisher::Claim which = Publisher::Claim::Next) {
    if (closed) fail(ErrorCode::InvalidArgument, "channel ", Quoted{channel}, " is closed");
    refuse_if_forked();
    if (reservation_open) {
      fail(ErrorCode::InvalidArgument, "channel ", Quoted{channel},
           " has an open reservation; commit or drop it first");
    }
    auto start_ns = monotonic_ns();
    open_place = place_of(manifest);
    if (!claim(deadline, which)) return std::nullopt;
    auto s = open_slot;
    // Consumers asleep waiting for this bucket wake now, and spin while it is written: their
    // wake-up overlaps the writing (see kWriteSpin in subscriber.cpp).
    ipc::futex_bump_and_wake(control->consumer_wake);
    try {
      auto& shared = shared_slot(s);
      shared.publish_start_ns = start_ns;
      auto frame_bytes = sizeof(BucketHeader) + manifest_bytes.size();
      auto& slot = slots[s];
      if (slot.storage.fit(payload_bytes, frame_bytes)) {
        slot.frame_encoding = 0;
        slot.payload_layout = 0;
      }
      write_manifest(s, slot.storage.frame().data() + sizeof(BucketHeader), manifest_bytes, encoding_id);
      // Every field, every bucket, from our copy: what a peer wrote there does not last.
      slot.storage.describe(shared, control->device_slots[s], frame_bytes);
      auto* payload = slot.storage.payload();
      header = make_header(manifest_bytes, {payload, payload_bytes});  // the payload hash: finish()
      // The padding of one layout, once zeroed, stays zero.
      writer.begin(*control, control_segment.descriptor(), s, options.slots, manifest.entries, {payload, payload_bytes},
                   slot.payload_layout == encoding_id, on);
      slot.payload_layout = encoding_id;
      return payload;
    } catch (...) {
      abandon();
      throw;
    }
  }

  void remove_segments() noexcept {
    // Each only while its name is still ours: after a `tbucket rm --force` the control
    // segment's may be another producer's by now, and a slot grown since is ours alone.
    for (auto& slot : slots) slot.storage.remove();
    if (control_segment.named(ipc::control_segment_name(channel))) ipc::Segment::remove(ipc::control_segment_name(channel));
  }
};

namespace {

// Removes what a dead producer left under `name` (leftovers.hpp). ChannelExists when a live
// producer holds it.
// False while someone else is removing it (a consumer or another producer).
bool remove_stale_channel(std::string_view channel, const std::string& name) {
  auto stale = ipc::Segment::open(name, 0, true, ipc::Locks::kKept);
  if (!stale) return true;  // gone meanwhile
  auto holder = ipc::remove_if_dead(channel, name, *stale);
  if (holder == ipc::Holder::kNobody) return true;
  if (holder == ipc::Holder::kRemover) return false;
  std::string owner = "a live process";
  if (stale->size() >= sizeof(ipc::ControlBlock)) {
    auto* control = reinterpret_cast<ipc::ControlBlock*>(stale->data());
    owner = message("live process ", describe(ipc::load_label(control->producer)));
  }
  fail(ErrorCode::ChannelExists, "channel ", Quoted{channel}, " is owned by ", owner);
}

// The control segment, created under `name` and locked as its producer's. Of producers racing
// for one name exactly one wins: a new object is unlocked for the moment between its creation
// and its creator's lock, and may be taken for a dead producer's and removed meanwhile; its
// creator then fails to lock it, or finds it no longer named, and loses, removing nothing.
ipc::Segment take_name(std::string_view channel, const std::string& name, mode_t mode, const Deadline& wait) {
  for (int round = 0; round < kNameRounds; ++round) {
    std::optional<ipc::Segment> created;
    try {
      created.emplace(ipc::Segment::create(name, sizeof(ipc::ControlBlock), mode, ipc::Locks::kKept));
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ChannelExists) throw;
    }
    if (!created) {
      if (!remove_stale_channel(channel, name)) {
        // Unlinking a large dead channel's slots frees their memory, which takes a while:
        // another remover's work is waited for, not counted as a round. One that stopped
        // (Ctrl+Z, a debugger) holds the name until it goes on or ends.
        auto now = Clock::now();
        if (wait.passed(now) || wait.interrupted(now)) {
          fail(ErrorCode::ChannelExists, "channel ", Quoted{channel}, " is being removed by another process (a dead ",
               "producer's leftovers), which did not finish ", wait.interrupted(now) ? "before the wait was interrupted"
                                                                                    : "within " + wait.limit(),
               ": a stopped `tbucket rm`, consumer or producer holds the name until it goes on or ends");
        }
        std::this_thread::sleep_for(wait.next_sleep(std::chrono::milliseconds(1), now));
        --round;
      }
      continue;
    }
    if (created->named(name)) return std::move(*created);  // created locked: see Segment::create
  }
  fail(ErrorCode::ChannelExists, "channel ", Quoted{channel}, " was taken ", kNameRounds,
       " times by other producers while this one tried to create it");
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
  if (options.policy != OverflowPolicy::Block && options.policy != OverflowPolicy::Latest) {
    fail(ErrorCode::InvalidArgument, "overflow policy ", static_cast<int>(options.policy), " is not block or latest");
  }
  if (options.update_buckets < 1 || options.update_buckets > ipc::kMaxSlots) {
    fail(ErrorCode::InvalidArgument, "update_buckets must be 1..", ipc::kMaxSlots, ", not ", options.update_buckets);
  }
  auto needed = latest_slots_needed(options.max_consumers, options.update_buckets);
  if (options.policy == OverflowPolicy::Latest && options.slots < needed) {
    fail(ErrorCode::InvalidArgument, "a `latest` channel with max_consumers ", options.max_consumers,
         " and update_buckets ", options.update_buckets, " needs slots >= (max_consumers + 1) x update_buckets = ",
         needed, ", not ", options.slots, ", so that its producer never waits (at most ", ipc::kMaxSlots,
         " slots: lower max_consumers)");
  }
}

std::uint64_t new_incarnation() {
  std::random_device entropy;
  std::uint64_t value = 0;
  while (value == 0) value = (std::uint64_t{entropy()} << 32) ^ entropy();
  return value;
}

}  // namespace

Publisher Publisher::create(std::string_view channel, const PublisherOptions& options, const Deadline& wait) {
  ipc::validate_channel_name(channel);
  validate(options);
  // Before the name is taken: CudaUnavailable or DeviceNotVisible leave nothing behind.
  auto home = ipc::home_of(options.location);
  auto segment = take_name(channel, ipc::control_segment_name(channel), options.mode, wait);
  auto* control = reinterpret_cast<ipc::ControlBlock*>(segment.data());
  control->layout_version = ipc::kControlLayoutVersion;
  control->slot_count = static_cast<std::uint16_t>(options.slots);
  control->max_consumers = static_cast<std::uint16_t>(options.max_consumers);
  control->min_consumers = static_cast<std::uint16_t>(options.min_consumers);
  control->payload_checksum = options.payload_checksum;
  control->payload_home = static_cast<std::uint16_t>(home.home);
  control->policy = static_cast<std::uint16_t>(options.policy == OverflowPolicy::Latest ? ipc::SlotPolicy::kLatest
                                                                                        : ipc::SlotPolicy::kBlock);
  control->update_buckets = static_cast<std::uint16_t>(options.update_buckets);
  auto incarnation = new_incarnation();
  control->incarnation = incarnation;
  control->device = home.device;
  ipc::store_label(control->producer, ipc::this_process());
  // Release: a consumer that reads the magic sees every field above.
  ipc::atomic(control->magic).store(ipc::kControlMagic, std::memory_order_release);
  return Publisher(std::make_unique<detail::PublisherState>(std::string(channel), options, incarnation,
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

bool Publisher::publish(const BucketBuilder& bucket, const Deadline& deadline, CudaStream stream) {
  auto manifest_bytes = bucket.encoded_manifest();  // refuses incomplete groups before any claim
  auto payload_bytes = bucket.payload_bytes();
  auto base = state_->begin(payload_bytes, bucket.manifest(), manifest_bytes, bucket.encoding_id(), deadline, stream);
  if (!base) return false;
  try {
    std::uint64_t entry_bytes = 0;
    for (const auto& entry : bucket.manifest().entries) entry_bytes += entry.byte_length;
    auto near_end = state_->wake_near_end(entry_bytes);
    state_->writer.write_bucket(bucket, {*base, payload_bytes}, near_end);
  } catch (...) {
    state_->abandon();
    throw;
  }
  state_->finish(state_->published, payload_bytes);
  return true;
}

std::optional<Reservation> Publisher::reserve(const BucketBuilder& layout, const Deadline& deadline,
                                              CudaStream stream, Claim claim) {
  auto manifest_bytes = layout.encoded_manifest();
  auto payload_bytes = layout.payload_bytes();
  auto base =
      state_->begin(payload_bytes, layout.manifest(), manifest_bytes, layout.encoding_id(), deadline, stream, claim);
  if (!base) return std::nullopt;
  std::span<std::byte> payload{*base, payload_bytes};
  // Until the Reservation exists, whatever throws (an allocation) must leave the slot empty.
  try {
    bool streaming = state_->writer.streams(payload);  // commit() fences the padding's stores too
    state_->writer.zero_padding(layout.manifest().entries, payload, streaming);
    state_->reservation_open = true;
    return Reservation(state_.get(), payload_bytes, layout.entry_spans(payload), streaming);
  } catch (...) {
    state_->reservation_open = false;
    state_->abandon();
    throw;
  }
}

bool Publisher::drain(const Deadline& deadline) {
  state_->refuse_if_forked();
  auto& state = *state_;
  for (;;) {
    state.refuse_if_control_damaged();
    auto wake = ipc::wake_count(state.control->producer_wake);
    // Under `latest`, consumers skip older buckets by design: the newest must be taken, the
    // others only let go of.
    bool drained = true;
    for (std::uint32_t s = 0; s < state.options.slots && drained; ++s) {
      auto generation = state.slots[s].generation;
      if (generation == 0) continue;
      auto bucket = bucket_in(generation);
      bool newest = bucket + 1 == state.published;
      drained = state.slot_releasable(s, bucket, !state.latest() || newest ? detail::PublisherState::Need::Lossless
                                                                            : detail::PublisherState::Need::Leased);
    }
    if (drained) {
      state.waiting_for.clear();
      return true;
    }
    auto now = Clock::now();
    if (deadline.passed(now) || deadline.interrupted(now)) {
      state.word_blocker();
      return false;
    }
    ipc::futex_wait(state.control->producer_wake, wake, deadline.next_sleep(kWaitSlice, now));
  }
}

void Publisher::close() noexcept {
  if (!state_ || state_->closed) return;
  state_->closed = true;
  if (state_->forked()) return;  // the channel is the parent's
  ipc::atomic(state_->control->closed).store(static_cast<std::uint16_t>(ipc::Closed::kByProducer), std::memory_order_release);
  ipc::futex_bump_and_wake(state_->control->consumer_wake);
  // Unlinked while we still hold the producer lock, which goes with the control segment's
  // descriptor: until then the name is ours (see remove_stale_channel()).
  state_->remove_segments();
}

std::uint64_t Publisher::published() const noexcept { return state_->published; }
PayloadLocation Publisher::location() const noexcept { return state_->options.location; }
const std::string& Publisher::channel() const noexcept { return state_->channel; }
const std::string& Publisher::waiting_for() const noexcept { return state_->waiting_for; }
std::uint64_t Publisher::incarnation() const noexcept { return state_->incarnation; }
OverflowPolicy Publisher::policy() const noexcept { return state_->options.policy; }

std::string_view to_string(OverflowPolicy policy) noexcept {
  switch (policy) {
    case OverflowPolicy::Block: return "block";
    case OverflowPolicy::Latest: return "latest";
  }
  return "unknown";
}

OverflowPolicy parse_overflow_policy(std::string_view text) {
  if (text == "block") return OverflowPolicy::Block;
  if (text == "latest") return OverflowPolicy::Latest;
  fail(ErrorCode::InvalidArgument, "overflow policy ", Quoted{text}, " is not block or latest");
}

namespace detail {

struct ReservationWriting {
  ReservationWriting(std::span<std::byte> payload, bool streaming, NearEnd near_end)
      : near_end(std::move(near_end)), copier(payload, streaming, &this->near_end) {}
  NearEnd near_end;
  EntryCopier copier;  // points at near_end
};

}  // namespace detail

Reservation::Reservation(detail::PublisherState* state, std::uint64_t payload_bytes,
                         std::vector<std::span<std::byte>> spans, bool streaming)
    : state_(state), payload_bytes_(payload_bytes), spans_(std::move(spans)) {
  std::uint64_t entry_bytes = 0;
  for (const auto& span : spans_) entry_bytes += span.size();
  writing_ = std::make_unique<detail::ReservationWriting>(whole(), streaming, state->wake_near_end(entry_bytes));
}

Reservation::Reservation(Reservation&& other) noexcept
    : state_(std::exchange(other.state_, nullptr)),
      payload_bytes_(other.payload_bytes_),
      spans_(std::move(other.spans_)),
      writing_(std::move(other.writing_)) {}

void Reservation::write(std::size_t index, const void* data) {
  if (state_ == nullptr) fail(ErrorCode::InvalidArgument, "reservation was already committed");
  // The slot is the parent's, taken before the fork: writing it would change the bucket the
  // parent is about to publish.
  state_->refuse_if_forked();
  if (index >= spans_.size()) {
    fail(ErrorCode::InvalidArgument, "entry ", index, " is past the last of ", spans_.size());
  }
  state_->writer.write_entry(spans_[index], data, writing_->copier);
}

void Reservation::write_all(std::span<const void* const> sources) {
  if (state_ == nullptr) fail(ErrorCode::InvalidArgument, "reservation was already committed");
  state_->refuse_if_forked();
  if (sources.size() != spans_.size()) {
    fail(ErrorCode::InvalidArgument, sources.size(), " sources were given for ", spans_.size(), " entries");
  }
  state_->writer.write_entries(spans_, sources, writing_->copier);
}

std::span<std::byte> Reservation::payload() const noexcept {
  // Its padding may now be written: the slot's next reservation must not take it as zeroed.
  if (state_ != nullptr) state_->slots[state_->open_slot].payload_layout = 0;
  return whole();
}

std::span<std::byte> Reservation::whole() const noexcept {
  return spans_.empty() ? std::span<std::byte>() : std::span<std::byte>(spans_.front().data(), payload_bytes_);
}

PayloadLocation Reservation::location() const noexcept {
  return state_ != nullptr ? state_->options.location : PayloadLocation{};
}

Reservation::~Reservation() {
  if (state_ == nullptr || state_->forked()) return;
  state_->reservation_open = false;
  state_->abandon();
}

void Reservation::commit(HandoverFrom from) {
  if (state_ == nullptr) fail(ErrorCode::InvalidArgument, "reservation was already committed");
  state_->refuse_if_forked();
  if (writing_->copier.streaming()) detail::finish_streaming();
  auto* state = std::exchange(state_, nullptr);
  state->reservation_open = false;
  // reserve() stamped the start; writing the slot in place is the caller's own work unless
  // it said otherwise, and then the handover starts here.
  if (from == HandoverFrom::Commit) state->shared_slot(state->open_slot).publish_start_ns = monotonic_ns();
  state->finish(state->published, payload_bytes_);
}

}  // namespace tensorbucket
