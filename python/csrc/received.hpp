// What a Subscriber hands out: a Bucket, and an Update of several, read as mappings
// {name: tensor} of zero-copy views that keep their slots leased while they live.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string_view>
#include <vector>

#include "convert.hpp"
#include "tensorbucket/tensorbucket.hpp"
#include "tensorbucket/torch.hpp"
#include "waits.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

// The entries' names as Python str, kept per bucket index from one bucket to the next and
// shared by the buckets of one subscriber: a producer resends the same names every step, and
// making 1000 str objects was an eighth of a bucket's tensors(). A kept name is compared
// with the entry's before it is reused. Used with the GIL.
class EntryNames {
 public:
  const std::vector<py::object>& of(const std::vector<ManifestEntry>& entries, std::uint32_t bucket_index) {
    if (bucket_index >= kKeptBuckets) bucket_index = kKeptBuckets;  // the last one: names not kept for long
    if (kept_.size() <= bucket_index) kept_.resize(bucket_index + 1);
    auto& names = kept_[bucket_index];
    names.resize(entries.size());
    for (std::size_t i = 0; i < entries.size(); ++i) {
      if (!names[i] || !same(names[i], entries[i].name)) names[i] = py::str(entries[i].name);
    }
    return names;
  }

 private:
  static constexpr std::uint32_t kKeptBuckets = 64;
  static bool same(const py::object& name, std::string_view text) {
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(name.ptr(), &size);  // a compact ASCII str's own bytes
    if (utf8 == nullptr) {
      PyErr_Clear();
      return false;
    }
    return static_cast<std::size_t>(size) == text.size() && std::memcmp(utf8, text.data(), text.size()) == 0;
  }
  std::vector<std::vector<py::object>> kept_;  // by bucket index
};

// A received bucket, read as a mapping {name: tensor} whose zero-copy views are made on first
// access: most of a small handoff's cost in Python was making 1000 tensor objects nobody had
// asked for yet. Each view keeps the lease, so it outlives release() and the Bucket.
class PyBucket {
 public:
  // `names`: the subscriber's, shared by the buckets it hands out.
  PyBucket(ReceivedBucket bucket, std::shared_ptr<EntryNames> names)
      : PyBucket(std::make_shared<const ReceivedBucket>(std::move(bucket)), std::move(names)) {}
  // One bucket of an update, which this keeps whole while it lives.
  PyBucket(std::shared_ptr<const ReceivedBucket> held, std::shared_ptr<EntryNames> names)
      : PyBucket(*held, held, std::move(names)) {}

 private:
  PyBucket(const ReceivedBucket& bucket, std::shared_ptr<const ReceivedBucket> held, std::shared_ptr<EntryNames> names)
      : version_(bucket.view().version()),
        bucket_index_(bucket.view().bucket_index()),
        bucket_count_(bucket.view().bucket_count()),
        sequence_(bucket.sequence()),
        incarnation_(bucket.incarnation()),
        publish_start_ns_(bucket.publish_start_ns()),
        published_ns_(bucket.published_ns()),
        received_ns_(monotonic_ns()),
        size_(bucket.view().size()),
        bucket_(std::move(held)),
        names_(std::move(names)),
        views_(size_) {}

 public:

  std::size_t size() const {
    live();
    return size_;
  }
  bool released() const { return !bucket_; }
  bool contains(const py::handle& name) const {
    return PyUnicode_Check(name.ptr()) && live()->view().position(name.cast<std::string_view>());
  }
  py::object get_item(std::string_view name) {
    auto position = live()->view().position(name);
    if (!position) throw py::key_error(std::string(name));
    return view(*position);
  }
  py::list keys() const {
    py::list out;
    for (const auto& name : names()) out.append(name);
    return out;
  }
  // Every view at once, as a dict.
  py::dict tensors() {
    // Making a view or the dict may run the garbage collector, and with it Python code that
    // releases this bucket or reaches this subscriber's names: the views are held here, and
    // the names taken last. Nothing after that allocates a tracked object.
    std::vector<py::object> views;
    views.reserve(size_);
    for (std::size_t i = 0; i < size_; ++i) views.push_back(view(i));
    py::dict out;
    const auto& names = this->names();
    for (std::size_t i = 0; i < size_; ++i) {
      if (PyDict_SetItem(out.ptr(), names[i].ptr(), views[i].ptr()) != 0) throw py::error_already_set();
    }
    return out;
  }
  // Kept by value, so they stay readable after release().
  std::uint64_t version() const { return version_; }
  std::uint32_t bucket_index() const { return bucket_index_; }
  std::uint32_t bucket_count() const { return bucket_count_; }
  std::uint64_t sequence() const { return sequence_; }
  std::uint64_t incarnation() const { return incarnation_; }
  std::uint64_t publish_start_ns() const { return publish_start_ns_; }
  std::uint64_t published_ns() const { return published_ns_; }
  std::uint64_t received_ns() const { return received_ns_; }
  // The received bucket, for readers of its bytes; InvalidArgument once released.
  std::shared_ptr<const ReceivedBucket> received() const { return live(); }
  // Drops this handle's hold and its views, leaving the release to the update that holds it.
  void forget() {
    views_.clear();
    made_.reset();
    bucket_.reset();
  }
  // Drops this handle's hold, and its views; tensors already taken keep the lease until they die.
  // A CUDA bucket this handle alone holds is released after the work queued so far on torch's
  // current stream; one whose views live on is released, when the last dies, after the work
  // queued on the stream it was received on.
  void release() {
    live();  // a second release() is an error, as for an Update
    views_.clear();
    made_.reset();  // the views' hold: with none alive, this handle's is the bucket's last
    if (bucket_ && bucket_.use_count() == 1 && !bucket_->view().location().on_host()) {
      auto stream = current_stream(bucket_->view().location());
      const_cast<ReceivedBucket&>(*bucket_).release(stream);  // ours alone: nothing else reads it
    }
    bucket_.reset();
  }

 private:
  const std::shared_ptr<const ReceivedBucket>& live() const {
    if (!bucket_) throw Error(ErrorCode::InvalidArgument, "bucket was released");
    return bucket_;
  }
  const std::vector<py::object>& names() const {
    return names_->of(live()->view().manifest().entries, bucket_index_);
  }
  py::object view(std::size_t i) {
    live();
    if (views_[i]) return views_[i];
    if (!made_) made_ = std::make_unique<torch_bridge::BucketViews>(bucket_);
    // The rvalue overload: the new PyObject takes the tensor's only reference, so none is
    // dropped through the interpreter on the way out (~0.2 of a bucket's tensors()).
    PyObject* made = THPVariable_Wrap((*made_)[i]);
    if (made == nullptr) throw py::error_already_set();
    auto object = py::reinterpret_steal<py::object>(made);
    // Making it may have run the garbage collector, and a finalizer this bucket's release()
    // (views_ emptied) or view(i) itself: the view holds its own lease either way.
    if (i >= views_.size()) return object;
    if (!views_[i]) views_[i] = std::move(object);
    return views_[i];
  }

  std::uint64_t version_;
  std::uint32_t bucket_index_;
  std::uint32_t bucket_count_;
  std::uint64_t sequence_;
  std::uint64_t incarnation_;
  std::uint64_t publish_start_ns_;
  std::uint64_t published_ns_;
  std::uint64_t received_ns_;  // when next() handed it over
  std::size_t size_;
  std::shared_ptr<const ReceivedBucket> bucket_;
  std::shared_ptr<EntryNames> names_;
  std::unique_ptr<torch_bridge::BucketViews> made_;  // once a view is asked for
  std::vector<py::object> views_;  // by entry position; empty until asked for
};

// A whole update: its buckets, in order, and a read-only mapping {name: tensor} over all of
// them. Its slots stay leased while it, one of its Buckets or a view lives.
class PyUpdate {
 public:
  PyUpdate(ReceivedUpdate update, const std::shared_ptr<EntryNames>& names)
      : update_(std::make_shared<const ReceivedUpdate>(std::move(update))),
        version_(update_->version()),
        incarnation_(update_->incarnation()),
        sequence_(update_->first_sequence()),
        publish_start_ns_(update_->buckets().front().publish_start_ns()),
        published_ns_(update_->buckets().back().published_ns()),
        received_ns_(monotonic_ns()) {
    for (const auto& bucket : update_->buckets()) {
      buckets_.push_back(py::cast(PyBucket(std::shared_ptr<const ReceivedBucket>(update_, &bucket), names)));
    }
  }

  std::uint64_t version() const { return version_; }
  std::uint64_t incarnation() const { return incarnation_; }
  std::uint64_t sequence() const { return sequence_; }
  std::uint64_t publish_start_ns() const { return publish_start_ns_; }
  std::uint64_t published_ns() const { return published_ns_; }
  std::uint64_t received_ns() const { return received_ns_; }
  py::tuple buckets() const { return py::tuple(py::cast(buckets_)); }
  std::size_t bucket_count() const { return buckets_.size(); }

  // The received update, for load_into(); InvalidArgument once released.
  const ReceivedUpdate& received() const { return *held(); }
  // The same, held: for a reader that runs without the GIL, while another thread may
  // release() this handle.
  const std::shared_ptr<const ReceivedUpdate>& held() const {
    if (!update_) throw Error(ErrorCode::InvalidArgument, "update was released");
    return update_;
  }

  bool released() const { return !update_; }
  // For each of buckets(), whether it was not released on its own: a bucket that was took its
  // names out of the update.
  std::vector<bool> kept() const {
    received();
    std::vector<bool> kept;
    for (const auto& bucket : buckets_) kept.push_back(!bucket.cast<const PyBucket&>().released());
    return kept;
  }
  // Whether every bucket was kept: only then is every name of the update readable.
  bool whole() const { return held_buckets().size() == buckets_.size(); }

  // The mapping holds the names of the buckets not released on their own.
  std::size_t size() const {
    std::size_t total = 0;
    for (const auto* bucket : held_buckets()) total += bucket->size();
    return total;
  }
  bool contains(const py::handle& name) const { return bucket_with(name) != nullptr; }
  // KeyError for a name no bucket holds; InvalidArgument naming the bucket, for one that a
  // bucket released on its own held.
  py::object get_item(const py::handle& name) const {
    auto* bucket = bucket_with(name);
    if (bucket == nullptr) {
      if (PyUnicode_Check(name.ptr())) {
        auto wanted = name.cast<std::string_view>();
        const auto& update = received();
        for (std::size_t k = 0; k < buckets_.size(); ++k) {
          if (update.buckets()[k].view().position(wanted)) {
            throw Error(ErrorCode::InvalidArgument, text::message("bucket ", k, " of this update, which holds ",
                                                                  text::Quoted{wanted}, ", was released"));
          }
        }
      }
      throw py::key_error(py::str(name));
    }
    return bucket->get_item(name.cast<std::string_view>());
  }
  py::list keys() const {
    py::list out;
    for (auto* bucket : held_buckets()) {
      read_unless_released(*bucket, [&] {
        for (auto key : bucket->keys()) out.append(key);
      });
    }
    return out;
  }
  py::dict tensors() const {
    py::dict out;
    for (auto* bucket : held_buckets()) read_unless_released(*bucket, [&] { out.attr("update")(bucket->tensors()); });
    return out;
  }

  // Drops this handle's hold on every bucket; views already taken keep the slots leased. A
  // CUDA update this handle alone holds is released after the work queued so far on torch's
  // current stream.
  void release() {
    received();  // a second release() is an error, as for a Bucket
    for (const auto& bucket : buckets_) bucket.cast<PyBucket&>().forget();
    if (update_.use_count() == 1 && !update_->buckets().front().view().location().on_host()) {
      auto stream = current_stream(update_->buckets().front().view().location());
      const_cast<ReceivedUpdate&>(*update_).release(stream);  // ours alone: nothing else reads it
    }
    update_.reset();
  }

 private:
  // buckets() not released on their own; InvalidArgument when the update was released.
  std::vector<PyBucket*> held_buckets() const {
    received();
    std::vector<PyBucket*> held;
    for (const auto& object : buckets_) {
      auto& bucket = object.cast<PyBucket&>();
      if (!bucket.released()) held.push_back(&bucket);
    }
    return held;
  }

  // read(), unless `bucket` is released on its own first or meanwhile: a finalizer that the
  // garbage collector runs while views are made may release it, taking its names out.
  template <class Read>
  static void read_unless_released(const PyBucket& bucket, Read&& read) {
    if (bucket.released()) return;
    try {
      read();
    } catch (const Error&) {
      if (!bucket.released()) throw;
    }
  }

  // The bucket not released on its own that holds `name`; none when no such bucket does.
  PyBucket* bucket_with(const py::handle& name) const {
    for (auto* bucket : held_buckets()) {
      if (bucket->contains(name)) return bucket;
    }
    return nullptr;
  }

  std::shared_ptr<const ReceivedUpdate> update_;
  std::uint64_t version_;
  std::uint64_t incarnation_;
  std::uint64_t sequence_;
  std::uint64_t publish_start_ns_;
  std::uint64_t published_ns_;
  std::uint64_t received_ns_;  // when next_update() handed it over
  std::vector<py::object> buckets_;  // PyBucket
};

}  // namespace tensorbucket::python
