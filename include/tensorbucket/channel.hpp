// A channel: one producer process publishes buckets, up to max_consumers processes receive
// them as verified zero-copy views, through POSIX shared memory on one host. The payloads live
// in host shared memory, or on one CUDA device (PublisherOptions::location).
//
// Semantics (docs/channel.md has the protocol and every crash case):
// - Overflow policy, chosen by the producer. `Block` (the default), ordered and lossless:
//   each registered consumer sees every bucket in order; a slot is reused only after every
//   live consumer has released it and at least min_consumers have, and publishing waits
//   (bounded) for that. `Latest`: the producer never waits for a consumer that is slow; it
//   reuses the slot of the oldest bucket that no consumer leases, and consumers skip to the
//   newest complete update (sequence() and version() show what they skipped). A leased slot
//   is never rewritten under either policy.
// - Updates are units: an update is the buckets of one version, bucket_index 0..count-1,
//   published in that order (the producer refuses any other order). next_update() hands out
//   a whole update at once; a consumer that attaches in the middle of one starts at the next
//   update's first bucket (SubscribeOptions::whole_updates).
// - A consumer that attaches late starts from the oldest update still held in the slots, so
//   a producer may start first: with K slots, `Block` blocks after K buckets until a
//   consumer comes.
// - Producer gone (closed or dead): consumers drain what was published, then next() throws
//   ProducerGone. attach() never attaches to a dead producer's leftovers: it removes them and
//   waits for a live producer. Each producer of a name has a new random incarnation; a
//   subscriber with SubscribeOptions::follow_restarts goes on with the next producer of its
//   channel after reporting ProducerGone once, never replaying the dead one's buckets.
// - Consumer gone: the producer frees its leases when they block it, and an attaching
//   consumer takes its record over. Liveness is a lock the kernel holds for each live
//   process, so peers may sit in different pid namespaces.
// - Shared memory is untrusted input: what another process of our uid can and cannot do to a
//   producer or a consumer through it is listed in docs/channel.md ("Hostile peers").
// - Segments are created O_EXCL with `mode` (0600 by default), opened only when owned by our
//   uid, and removed by close(); a dead producer's segments are removed by the next producer
//   of the same channel name, while a live producer's channel gives ChannelExists.
// - A Deadline bounds every wait (deadline.hpp): a timeout converts to one; zero (or less)
//   looks once, milliseconds::max() or Deadline::never() waits without limit, and an
//   interrupted predicate ends a wait early, as its timeout would.
//
// - On a CUDA channel only the frames travel through shared memory: each slot's payload is a
//   device allocation exported once, imported once by each consumer process, and ordered by
//   events on the streams the caller names (CudaStream): a consumer's views are ready on the
//   stream it received them on, and the producer rewrites a slot only after the work each
//   consumer queued on its stream before releasing it. No call synchronizes the host, but
//   for payload checksums. docs/channel.md, "CUDA".
//
// Thread safety: a Publisher or Subscriber is used by one thread at a time; a ReceivedBucket
// may be read from many threads and released from any. Each is a per-process handle: in a
// child forked from its process it refuses to publish or receive (InvalidArgument), and
// closing or destroying it there, its buckets included, leaves the parent's channel and
// leases as they were.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensorbucket/bucket.hpp"
#include "tensorbucket/deadline.hpp"

namespace tensorbucket {
namespace detail {
struct PublisherState;
struct ReservationWriting;
struct SubscriberState;
struct Lease;
}  // namespace detail

// A CUDA stream (a CUstream or cudaStream_t, e.g. torch's current stream); nullptr is the
// legacy default stream. Host channels ignore it.
using CudaStream = void*;

// One copy of `bytes` between two addresses CUDA can reach (device memory, or host memory
// registered with it).
struct CudaCopy {
  void* to;
  const void* from;
  std::uint64_t bytes;
};
// Queues `copies` on `stream`, on CUDA device `device` (this process's ordinal): in one batched
// driver call where the driver takes one, else one call each, as a device channel's
// Reservation::write_all() copies. CudaUnavailable without a driver, CudaFailed naming the call
// that failed.
void copy_on_device(int device, std::span<const CudaCopy> copies, CudaStream stream);

// What the producer does when the slot it needs next is still needed by a consumer.
enum class OverflowPolicy : std::uint8_t {
  Block,   // wait (bounded) for it: lossless, in order
  Latest,  // never wait for a slow consumer: take the oldest slot nobody leases
};

std::string_view to_string(OverflowPolicy policy) noexcept;
// "block" or "latest"; InvalidArgument otherwise.
OverflowPolicy parse_overflow_policy(std::string_view text);

struct PublisherOptions {
  std::uint32_t slots = 2;          // 1..16 buckets in flight (2: double buffering)
  std::uint32_t max_consumers = 8;  // 1..64 consumer records
  std::uint32_t min_consumers = 1;  // `Block`: releases each bucket needs before its slot is reused
  std::uint32_t mode = 0600;        // permission bits of every segment
  bool payload_checksum = false;    // hash every payload (one extra pass on each side)
  PayloadLocation location = PayloadLocation::host();  // the host, or one CUDA device
  OverflowPolicy policy = OverflowPolicy::Block;
  // `Latest`: the most buckets an update has (1..16). Its producer never waits while each
  // consumer holds at most one update, which takes slots >= latest_slots_needed(): create()
  // refuses fewer, and publish() a bucket_count above this.
  std::uint32_t update_buckets = 1;
};

// The slots a `Latest` channel needs: each of max_consumers may lease a whole update (its
// update_buckets slots) while the producer writes the next one into slots nobody leases.
constexpr std::uint32_t latest_slots_needed(std::uint32_t max_consumers, std::uint32_t update_buckets) {
  return (max_consumers + 1) * update_buckets;
}

class Reservation;

class Publisher {
 public:
  // Creates the channel, with a new incarnation. InvalidArgument for a bad name or options
  // (among them a `Latest` channel with fewer slots than latest_slots_needed()), ChannelExists when a live
  // producer owns the name (a dead one's leftovers are removed first); for a CUDA location,
  // CudaUnavailable or DeviceNotVisible when this process cannot use that device. While
  // another process removes a dead producer's leftovers under the name (freeing a large
  // channel's memory takes a while), it waits for that until `wait` passes or is interrupted,
  // then ChannelExists saying so.
  static Publisher create(std::string_view channel, const PublisherOptions& options = {},
                          const Deadline& wait = std::chrono::seconds(10));

  Publisher(Publisher&&) noexcept;
  Publisher& operator=(Publisher&&) noexcept;
  ~Publisher();  // close()

  // Copies `bucket` into the next slot and publishes it. False when no slot came free before
  // `deadline` (or it was interrupted); then nothing was published. InvalidArgument, before
  // anything is claimed, for a bucket out of its update's order: bucket_index 0 begins an
  // update (abandoning one left unfinished), any other must follow the one before it, same
  // version and count. On a CUDA channel the entries' addresses may be device or host memory; they are copied in one batch on `stream`, after the work queued
  // on it before (so the caller's writes to them), and must stay valid until that is done.
  bool publish(const BucketBuilder& bucket, const Deadline& deadline, CudaStream stream = nullptr);

  // Which slot reserve() may take. `Next`: the one publish() would take, whatever bucket it
  // holds, once no consumer needs that bucket. `SparingNewest`, for a writer that may drop its
  // reservation halfway (it checks each source as it copies it), which leaves the slot empty:
  // only a slot that is empty, or that holds a bucket older than the newest complete update
  // and the update under way which every live consumer is done with, as `block` asks (read or
  // passed, and released by min_consumers). A dropped reservation then costs only a bucket no
  // attached consumer will read, one its commit would have replaced. Under `block` with one
  // bucket per update and 2 or more slots, that is every claim while the consumers keep up.
  enum class Claim { Next, SparingNewest };

  // The in-place path: the next slot laid out like `layout` (its declare()d entries), for the
  // caller to write through Reservation::entry_spans() and publish with commit(). nullopt at
  // the deadline; with `SparingNewest`, also at once when the slot to take holds a bucket it
  // spares. Publish nothing else while a reservation is open. On a CUDA channel the spans are
  // device memory, to be written on `stream` (or before it, in stream order).
  std::optional<Reservation> reserve(const BucketBuilder& layout, const Deadline& deadline,
                                     CudaStream stream = nullptr, Claim claim = Claim::Next);

  // Waits until every live consumer released every published bucket (and min_consumers did).
  // False at the deadline.
  bool drain(const Deadline& deadline);

  // What the last publish(), reserve() or drain() that timed out waited for, in words: the
  // consumers that held the slot (record, pid, bucket), or the releases min_consumers asks
  // for. Empty when the last call did not time out.
  const std::string& waiting_for() const noexcept;

  PayloadLocation location() const noexcept;

  // Marks the channel closed, wakes consumers and removes every segment. Idempotent.
  void close() noexcept;

  std::uint64_t published() const noexcept;
  const std::string& channel() const noexcept;
  std::uint64_t incarnation() const noexcept;
  OverflowPolicy policy() const noexcept;

 private:
  explicit Publisher(std::unique_ptr<detail::PublisherState> state);
  std::unique_ptr<detail::PublisherState> state_;
};

// A slot held for in-place writing. Abandoned (the slot left empty, nothing published) when
// destroyed without commit(). Must not outlive the Publisher that made it.
class Reservation {
 public:
  Reservation(Reservation&&) noexcept;
  Reservation& operator=(Reservation&&) = delete;
  ~Reservation();

  // Writable spans into the slot, one per entry of the layout, in its order: host shared
  // memory, or device memory as location() says. They hold whatever the slot held before
  // until written: write every entry.
  std::span<const std::span<std::byte>> entry_spans() const noexcept { return spans_; }
  // The whole payload in one span: every entry's, in layout order from offset 0, and the
  // padding between them (zeroed). For a writer that has a payload's bytes in one piece, laid
  // out as the layout lays them (a relay receiving a bucket). Whatever it writes in the padding
  // travels with this bucket only: the slot's next reservation zeroes the padding again.
  std::span<std::byte> payload() const noexcept;
  PayloadLocation location() const noexcept;

  // Copies entry `index`'s bytes (its byte_length) from `data` into its span, as packing does:
  // with non-temporal stores when the payload is large; on a device, a copy queued on the
  // reservation's stream. InvalidArgument past the last entry or after commit(). Near the end
  // of a long writing, as its pace tells, it wakes the consumers, so that they are awake for
  // the commit (docs/channel.md, "Waiting"); writing through entry_spans() does not.
  void write(std::size_t index, const void* data);

  // write(i, sources[i]) for every entry whose source is not null, in one pass (on the host, the
  // lines of the small entries ahead are asked for writing while earlier ones are copied; on a
  // device, one batched copy). InvalidArgument unless there is one source per entry.
  void write_all(std::span<const void* const> sources);

  // When the handover of a reserved bucket began, as ReceivedBucket::publish_start_ns() tells
  // it: at commit(), when the writing before it was the caller's own work (computing the
  // tensors in place); at reserve(), when reserve-write-commit stands for one publish() (the
  // torch bridge's publish from tensors), which is stamped from its start.
  enum class HandoverFrom { Commit, Reserve };

  // Publishes what was written (on a device: what was queued on the reservation's stream
  // so far). InvalidArgument when called twice.
  void commit(HandoverFrom from = HandoverFrom::Commit);

 private:
  friend class Publisher;
  std::span<std::byte> whole() const noexcept;  // payload(), leaving the padding's word alone
  Reservation(detail::PublisherState* state, std::uint64_t payload_bytes,
              std::vector<std::span<std::byte>> spans, bool streaming);
  detail::PublisherState* state_;  // null once committed or moved from
  std::uint64_t payload_bytes_;
  std::vector<std::span<std::byte>> spans_;
  // The host copies' state from one write() to the next: streaming stores (fenced at commit()),
  // the lines asked for ahead, and the pace that wakes the consumers when it is nearly done.
  std::unique_ptr<detail::ReservationWriting> writing_;
};

// Now on CLOCK_MONOTONIC, in nanoseconds: the clock of the channel's timestamps
// (ReceivedBucket::publish_start_ns()), and of Python's time.monotonic_ns().
std::uint64_t monotonic_ns() noexcept;

// A received, verified bucket. Holds its lease: the slot is not reused while this object (or
// anything moved from it) lives. The views point into shared memory, valid as long as it lives.
class ReceivedBucket {
 public:
  ReceivedBucket(ReceivedBucket&&) noexcept;
  ReceivedBucket& operator=(ReceivedBucket&&) noexcept;
  ~ReceivedBucket();  // release()

  const BucketView& view() const noexcept { return view_; }
  std::uint64_t sequence() const noexcept { return sequence_; }  // 0-based place in the channel
  // The producer's incarnation (Publisher::incarnation()): sequences count within one.
  std::uint64_t incarnation() const noexcept { return incarnation_; }
  // CLOCK_MONOTONIC times (monotonic_ns()): when the producer began handing this bucket over
  // (the start of publish(), or for a reservation of commit() or reserve(), as commit() was
  // told), and when it became visible to consumers.
  std::uint64_t publish_start_ns() const noexcept { return publish_start_ns_; }
  std::uint64_t published_ns() const noexcept { return published_ns_; }

  // The payload's bytes (all of them, as view().payload() spans them) copied into host memory,
  // waiting for the copy: for tools and checks. A device bucket's fast path never leaves the
  // device.
  std::vector<std::byte> copy_to_host() const;

  // Waits on the host until a device bucket's bytes are ready on the stream it was received
  // on (and the work queued there before is done): for tools and measurements. Nothing to wait
  // for on the host.
  void wait_ready() const;

  // Gives the slot back early. The views must not be used afterwards. On a CUDA channel the
  // release is ordered after the work queued on `stream` so far (by default the stream the
  // bucket was received on): the producer's rewrite of the slot waits for it on the device.
  void release() noexcept;
  void release(CudaStream stream) noexcept;

 private:
  friend class Subscriber;
  ReceivedBucket(BucketView view, std::uint64_t sequence, std::uint64_t incarnation, std::uint64_t publish_start_ns,
                 std::uint64_t published_ns, std::unique_ptr<detail::Lease> lease);
  BucketView view_;
  std::uint64_t sequence_;
  std::uint64_t incarnation_;
  std::uint64_t publish_start_ns_;
  std::uint64_t published_ns_;
  std::unique_ptr<detail::Lease> lease_;
};

// A whole update: its buckets, index 0..count-1 in order, each verified and leased.
class ReceivedUpdate {
 public:
  std::uint64_t version() const noexcept { return buckets_.front().view().version(); }
  std::uint64_t incarnation() const noexcept { return buckets_.front().incarnation(); }
  std::uint64_t first_sequence() const noexcept { return buckets_.front().sequence(); }
  std::span<const ReceivedBucket> buckets() const noexcept { return buckets_; }
  // The entries of every bucket, in order, as one manifest (offsets are each bucket's own):
  // what the update holds as a whole. DuplicateName when two buckets name the same entry.
  Manifest manifest() const;
  // Releases every bucket (ReceivedBucket::release).
  void release() noexcept;
  void release(CudaStream stream) noexcept;

 private:
  friend class Subscriber;
  explicit ReceivedUpdate(std::vector<ReceivedBucket> buckets) : buckets_(std::move(buckets)) {}
  std::vector<ReceivedBucket> buckets_;  // never empty
};

struct SubscribeOptions {
  // LocationMismatch unless the channel's payloads live there (host or CUDA).
  std::optional<PayloadLocation::Kind> expected_location = std::nullopt;
  // A consumer that attaches while an update is under way skips the rest of it and starts at
  // the next update's first bucket; false takes every bucket still held (for tools).
  bool whole_updates = true;
  // After ProducerGone, the next call waits (until its deadline) for the channel's next
  // producer and goes on from its first update held.
  bool follow_restarts = false;
};

class Subscriber {
 public:
  // Attaches to the channel's live producer, waiting until `deadline` for one: a dead
  // producer's leftovers are removed (when nobody else does) and never attached to.
  // ChannelMissing when none came (or the wait was interrupted), PermissionDenied when it is not ours, ChannelFull when
  // every consumer record is taken, LocationMismatch (options.expected_location). A CUDA
  // channel needs CUDA in this process: CudaUnavailable otherwise, and DeviceNotVisible when
  // its device is not among ours.
  static Subscriber attach(std::string_view channel, const Deadline& deadline,
                           const SubscribeOptions& options = {});

  Subscriber(Subscriber&&) noexcept;
  Subscriber& operator=(Subscriber&&) noexcept;
  ~Subscriber();  // detaches once every ReceivedBucket from it is gone

  // The next bucket in order, verified (docs/format.md rules 1-6); nullopt when none arrived
  // before `deadline`. Throws ProducerGone once the producer is gone and everything published
  // was received, and the verification errors for a bad bucket (which is then skipped); Torn
  // also when another process truncated the slot's segment under it. SystemError when
  // another process took this consumer's record or truncated the control segment: the
  // subscriber is then unusable and must attach again.
  // On a CUDA channel the views are device memory, ready for work queued on `stream`.
  std::optional<ReceivedBucket> next(const Deadline& deadline, const VerifyOptions& options = {},
                                     CudaStream stream = nullptr);
  std::optional<ReceivedBucket> try_next(const VerifyOptions& options = {});

  // The next complete update, all of its buckets leased; nullopt when none was complete
  // before `deadline` (the buckets taken so far are kept for the next call). Buckets of an
  // update that cannot be completed (one of them was skipped or failed verification, or the
  // producer began another) are dropped. options.expected is the whole model: each bucket
  // must be part of it, and the update all of it. InvalidArgument for an update of more
  // buckets than the channel has slots: it cannot be held at once (take it with next()).
  // Hold one update at a time: a `Latest` producer counts on it.
  std::optional<ReceivedUpdate> next_update(const Deadline& deadline, const VerifyOptions& options = {},
                                            CudaStream stream = nullptr);

  const std::string& channel() const noexcept;
  // The incarnation of the producer attached to now.
  std::uint64_t incarnation() const noexcept;
  OverflowPolicy policy() const noexcept;
  // The channel's payload location, as this process numbers its devices.
  PayloadLocation location() const noexcept;

 private:
  Subscriber(std::shared_ptr<detail::SubscriberState> state, const SubscribeOptions& options);
  // next() within one producer's incarnation.
  static std::optional<ReceivedBucket> receive(const std::shared_ptr<detail::SubscriberState>& state,
                                               const Deadline& deadline, const VerifyOptions& options,
                                               CudaStream stream);
  std::shared_ptr<detail::SubscriberState> state_;
  SubscribeOptions options_;
  bool producer_gone_ = false;           // ProducerGone was reported for state_'s producer
  std::vector<ReceivedBucket> pending_;  // the update next_update() is assembling
};

// A snapshot of a channel for tools (`tbucket inspect`), read without registering as a
// consumer; values may be moments old. ChannelMissing / PermissionDenied as attach().
struct ChannelInfo {
  struct Slot {
    std::uint64_t generation;              // 0 empty, odd being written, else 2(bucket+1)
    std::optional<std::uint64_t> bucket;   // the published bucket it holds
    std::uint32_t release_count;
    std::string segment;                   // its shared-memory object, empty when none
    std::uint64_t segment_bytes;
    std::uint64_t epoch;                   // its storage epoch, the producer's first 1 (a new one when it grew)
    std::uint64_t payload_capacity;
    std::optional<std::uint64_t> version;  // the update of its bucket, as the producer wrote it
    std::uint32_t bucket_index, bucket_count;
    std::uint64_t published_ns;            // CLOCK_MONOTONIC when its bucket was published
  };
  struct Consumer {
    std::uint32_t record;
    std::int32_t pid;
    bool pid_elsewhere;    // the pid is one in another pid namespace than ours
    bool alive;            // it holds its record's lock
    std::uint64_t next_bucket;
    std::uint64_t next_update;  // the update ordinal of next_bucket
    std::uint32_t held_slots;  // bit s: a lease on slot s
  };
  std::string channel;
  std::string control_segment;
  std::uint32_t slots, max_consumers, min_consumers;
  bool payload_checksum;
  std::string location;                    // "host", or "cuda GPU-<uuid>"
  std::string policy;                      // "block", "latest", or what the word held
  std::uint32_t update_buckets;
  std::uint64_t updates;                   // updates begun (buckets with index 0 published)
  std::int32_t producer_pid;
  std::uint64_t producer_incarnation;      // random, new for each producer of the name
  bool producer_pid_elsewhere;
  bool producer_alive;
  bool closed;
  std::uint64_t published;
  std::vector<Slot> slot_states;
  std::vector<Consumer> consumers;           // taken records only
  std::optional<Manifest> newest_manifest;   // of the newest bucket, when read untorn
};

ChannelInfo inspect_channel(std::string_view channel);

// The names of the channels in this host's shared memory (/dev/shm), live or left by a dead
// producer, sorted; for tools (`tbucket list`).
std::vector<std::string> list_channels();

// Removes what a dead producer of `channel` left in shared memory, as the next producer or
// attacher of the name would. ChannelMissing when there is nothing, ChannelExists (removing
// nothing) when its producer lives. With `force`, a live producer's names are removed too, for
// one that is stuck, to be killed: it and its consumers keep what they mapped, nobody can
// attach any more, and the name is free for a new producer; the old one, seeing its names gone
// when it closes, leaves them alone, but a slot it grows before that may take or unlink a
// name of the new producer's slots.
void remove_channel(std::string_view channel, bool force = false);

}  // namespace tensorbucket
