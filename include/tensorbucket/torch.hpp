// The LibTorch bridge: torch tensors in, zero-copy torch tensors out. Built when LibTorch is
// found (meson option `torch`); link `tensorbucket-torch`.
//
// Sending: make_bucket() refuses, naming the entry, what cannot travel: undefined and meta
// tensors (Unmaterialized), tensors not where the channel's payloads live (CPU tensors for a
// host channel, tensors on its device for a CUDA channel), sparse and other non-strided
// layouts (InvalidArgument), and dtypes without a manifest dtype, quantized and complex among
// them (UnsupportedDtype). Nothing is built or published when any entry is refused.
// Non-contiguous tensors are packed by value in row-major order; requires_grad tensors are
// packed by value (detached).
//
// Receiving: tensors() gives views over the bucket's payload whose storages keep the
// bucket (and its lease) alive: the slot cannot be reused while any view lives, and nothing is
// copied. The memory is the producer's: treat the views as read-only (received payloads are
// mapped read-only; clone() to modify). A CUDA channel's views are CUDA tensors on the
// consumer's ordinal of the channel's device, ready on the stream the bucket was received on.
//
// Thread safety: as for the types they wrap; the functions keep no state.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tensorbucket/tensorbucket.hpp"

namespace tensorbucket::torch_bridge {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The manifest dtype of a torch scalar type; UnsupportedDtype when there is none.
DType dtype_of(at::ScalarType type, const std::string& entry = "?");
// The torch scalar type of a manifest dtype; UnsupportedDtype when torch lacks it.
at::ScalarType scalar_type_of(DType dtype, const std::string& entry = "?");

// A module's parameters and buffers, by their dotted names (as state_dict() orders them).
NamedTensors named_tensors(const torch::nn::Module& module);

// A bucket ready to publish, and the contiguous tensors its builder points at: keep it alive
// until published or packed.
struct TorchBucket {
  std::vector<at::Tensor> storage;
  BucketBuilder builder;
};
// `groups`: entries that must arrive together (ManifestGroup::members name entries).
// `where`: the location of the channel it is for (Publisher::location()).
TorchBucket make_bucket(const NamedTensors& tensors, std::uint64_t version = 0,
                        std::uint32_t bucket_index = 0, std::uint32_t bucket_count = 1,
                        const std::vector<ManifestGroup>& groups = {}, PayloadLocation where = {});

// The in-place path: reserves a slot laid out for `tensors`, copies each straight into shared
// memory, and commits. False when no slot came free before `deadline` (nothing published).
// Stamped as publish() is: the bucket's publish_start_ns is when the slot was reserved, so
// its latency includes the copy.
bool publish_in_place(Publisher& publisher, const NamedTensors& tensors,
                      const Deadline& deadline, std::uint64_t version = 0,
                      std::uint32_t bucket_index = 0, std::uint32_t bucket_count = 1,
                      const std::vector<ManifestGroup>& groups = {}, CudaStream stream = nullptr);

// For a producer that publishes the same tensors every step, the two halves of the call above:
// layout_of() checks the tensors (refusing as make_bucket does) and declares them once;
// publish_in_place() then only copies, restamping the layout's kept encoding with the
// builder's version. `tensors` follow the layout's entries in order; ManifestMismatch, before
// anything is reserved, when their count differs or one no longer fits its entry.
BucketBuilder layout_of(const NamedTensors& tensors, std::uint64_t version = 0,
                        std::uint32_t bucket_index = 0, std::uint32_t bucket_count = 1,
                        const std::vector<ManifestGroup>& groups = {}, PayloadLocation where = {});
bool publish_in_place(Publisher& publisher, const BucketBuilder& layout,
                      std::span<const at::Tensor> tensors, const Deadline& deadline,
                      CudaStream stream = nullptr);
// A kept layout's tensors, checked and held for the copy: the two halves of the call above for
// a caller that holds its tensors by borrowed references under a lock it gives up while
// publishing (the Python module, under the GIL). Each tensor is held by its storage rather
// than by a copy of the tensor: under torch 2.x a tensor's count going 1 -> 2 -> 1 moves its
// Python object's count through the interpreter, both ways, which was a quarter of a Python
// publish of 1000 small tensors. A held storage outlives its tensor (swapped out or dropped by
// another thread), and is not resizable until clear(): resize_() of it meanwhile (FSDP's
// resize_(0) from another thread) fails there, instead of freeing the bytes under the copy.
// A tensor whose operations run Python code (a __torch_dispatch__ subclass) is copied out as
// it is staged, so that nothing after the slot's reservation can run user code or throw.
class StagedTensors {
 public:
  // Whether add() holds each tensor's storage. Nothing, for a caller that keeps its lock
  // from add() through the publish (the Python module, for a small bucket whose slot is free
  // at once): nothing can drop or rebind its tensors meanwhile, and the counts stay put.
  enum class Hold { Storages, Nothing };
  explicit StagedTensors(Hold hold = Hold::Storages) noexcept : hold_(hold) {}
  StagedTensors(const StagedTensors&) = delete;
  StagedTensors& operator=(const StagedTensors&) = delete;
  ~StagedTensors() { clear(); }

  // Checks `tensor` as the next entry of a layout (`entry`, of a channel at `where`) and holds
  // it: false, staging nothing, when it no longer fits (see fits()).
  [[nodiscard]] bool add(const at::Tensor& tensor, const ManifestEntry& entry, PayloadLocation where = {});
  // Drops every staged tensor, keeping the capacity: a tensor may hold the last reference to
  // its storage's Python object, so call this where such an object may be released.
  void clear() noexcept;
  std::size_t size() const noexcept { return bytes_.size(); }

 private:
  friend std::optional<Reservation> write_in_place(Publisher&, const BucketBuilder&, const StagedTensors&,
                                                   const Deadline&, CudaStream);
  Hold hold_;
  std::vector<const void*> bytes_;     // each tensor's row-major bytes; null: copied by value
  std::vector<std::uint64_t> lengths_;  // each entry's byte_length, checked against the layout
  std::vector<c10::Storage> holds_;    // what keeps those bytes alive
  std::vector<c10::Storage> fixed_;    // those of holds_ made unresizable here, until clear()
  std::vector<at::Tensor> made_;       // copies of tensors that run Python code, always held
  std::vector<std::pair<std::size_t, at::Tensor>> by_value_;  // the others, copy_'d by position
};
// Publishes `staged`, staged against `layout`'s entries in order, as the call above does:
// ManifestMismatch, before anything is reserved, when their count or an entry's byte length
// differs (staged against another layout). Moves no tensor's reference count. Also false,
// publishing nothing, when `deadline` was interrupted by the end of the copy (its predicate,
// asked once more before the commit: a Ctrl+C in Python); the slot written is then left
// empty, so the bucket it held before is gone too.
bool publish_in_place(Publisher& publisher, const BucketBuilder& layout, const StagedTensors& staged,
                      const Deadline& deadline, CudaStream stream = nullptr);
// The call above short of its commit: the slot reserved and written, nullopt when none came
// free before `deadline`. For a caller that commits under its own lock: the Python module asks
// for signals and commits holding the GIL, which a thread of its own must take to send one.
std::optional<Reservation> write_in_place(Publisher& publisher, const BucketBuilder& layout,
                                          const StagedTensors& staged, const Deadline& deadline,
                                          CudaStream stream = nullptr);
// Checks `tensor` as entry `index` of `reservation`, whose layout's entry that is, and copies
// it there: false, writing nothing, when it no longer fits (see fits()); ManifestMismatch when
// `entry` is not the reservation's entry `index` (no such index, or another byte length). For
// a caller that keeps its tensors alive from the first write to the commit (the Python module,
// under the GIL): each copy overlaps the checks of the tensors after it, and nothing is staged
// or held. Such a writer may find a misfit halfway: it reserves with
// Publisher::Claim::SparingNewest, so that dropping the reservation costs no bucket still
// worth keeping.
[[nodiscard]] bool write_tensor(Reservation& reservation, std::size_t index, const at::Tensor& tensor,
                                const ManifestEntry& entry);
// Whether `tensor` can travel as `entry` of a kept layout: same dtype and shape, on `where`,
// and nothing layout_of() would refuse. Cheap enough to ask of every tensor on every step.
bool fits(const at::Tensor& tensor, const ManifestEntry& entry, PayloadLocation where = {}) noexcept;

// Zero-copy views of every entry, in manifest order, that keep `bucket` leased while they live.
NamedTensors tensors(std::shared_ptr<const ReceivedBucket> bucket);
// Views of one received bucket made as a reader asks for them, all holding the bucket by one
// hold: a view adds to its count instead of allocating a hold of its own (a tenth of making
// 1000 views from Python). The bucket stays leased while this or any view it made lives.
struct SharedHold;
class BucketViews {
 public:
  explicit BucketViews(std::shared_ptr<const ReceivedBucket> bucket);
  BucketViews(const BucketViews&) = delete;
  BucketViews& operator=(const BucketViews&) = delete;
  ~BucketViews();
  // The view of entry `index`; std::out_of_range past the last.
  at::Tensor operator[](std::size_t index) const;
  // Every view, in manifest order, as tensors() makes them.
  NamedTensors all() const;

 private:
  const ReceivedBucket* bucket_;
  at::Device device_;
  SharedHold* hold_;  // holds the bucket
};
// The view of entry `index` alone (std::out_of_range past the last), for readers that take
// tensors one by one.
at::Tensor tensor(std::shared_ptr<const ReceivedBucket> bucket, std::size_t index);
// Views over an in-process bucket; `view`'s payload must outlive them.
NamedTensors tensors(const BucketView& view);

// The names, dtypes and shapes of `tensors`, in order: what VerifyOptions::expected and
// check_expected() compare.
Manifest manifest_of(const NamedTensors& tensors);
// What `module` expects to receive: its parameters' and buffers' names, dtypes and shapes.
Manifest expected_manifest(const torch::nn::Module& module);

// Copies `tensors` into `module`'s parameters and buffers, as strictly as a strict
// load_state_dict: one ManifestMismatch lists every missing, unexpected, dtype- and
// shape-mismatched name, and nothing is copied when anything is wrong. Unmaterialized, naming
// them, when some of the module's tensors are meta or undefined (copying into those would
// silently do nothing); InvalidArgument, naming them, for inference tensors outside
// InferenceMode. Each target's version is bumped, as copy_ does.
void load_into(torch::nn::Module& module, const NamedTensors& tensors);
// The same into `targets`, matched by name: a module's tensors gathered some other way (the
// Python module passes a state_dict()).
void load_into(const NamedTensors& targets, const NamedTensors& tensors);
// The same from a bucket's bytes, without a view of each entry (the cost of loading a bucket
// of many small tensors): `load_into(module, received.view())`. The bucket must stay open
// during the call. From a CUDA bucket, the targets on its device are written by one batched
// copy queued on `stream` (the one the bucket was received on: release it on the same stream),
// the others by copy_ on torch's current stream: pass torch's current stream as `stream` (as
// the Python module does) for both to be ordered with the bucket. The same for a non-contiguous
// tensor in publish_in_place().
// One bucket of an update split into several (bucket_count > 1) loads into the targets its
// entries name, and must name no other: the rest of `targets` belong to the other buckets.
void load_into(torch::nn::Module& module, const BucketView& bucket, CudaStream stream = nullptr);
void load_into(const NamedTensors& targets, const BucketView& bucket, CudaStream stream = nullptr);
// A whole update (Subscriber::next_update()), as strictly: its buckets together hold exactly
// the targets (DuplicateName for a name in two of them), all checked before anything is copied.
void load_into(torch::nn::Module& module, const ReceivedUpdate& update, CudaStream stream = nullptr);
void load_into(const NamedTensors& targets, const ReceivedUpdate& update, CudaStream stream = nullptr);

}  // namespace tensorbucket::torch_bridge
