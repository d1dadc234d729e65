// The `tensorbucket` Python module: thin pybind11 wrappers over the C++ channel and the
// LibTorch bridge. Waiting and copying run without the GIL.
#include <torch/extension.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tensorbucket/tensorbucket.hpp"
#include "tensorbucket/torch.hpp"

namespace py = pybind11;
using namespace tensorbucket;
using torch_bridge::NamedTensors;

namespace {

// Raised by a wait that ended at its timeout (a publish() that found no free slot, an
// iteration over updates that found none); becomes tensorbucket.Timeout with `message`.
struct WaitTimeout {
  std::string message;
};

using Clock = std::chrono::steady_clock;
using Deadline = std::optional<Clock::time_point>;  // none: no limit

// The longest a wait runs without the GIL: between slices Python runs its signal handlers.
constexpr auto kSignalCheck = std::chrono::milliseconds(50);

// CLOCK_MONOTONIC in nanoseconds, as time.monotonic_ns() and the channel's timestamps count.
std::uint64_t monotonic_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

// How Python writes a float: 0.5, -1.0, nan.
std::string as_text(double seconds) { return py::str(py::float_(seconds)); }

// When a wait of `seconds` from now ends: never for None, inf, or more than a clock can hold.
// A negative or NaN timeout would end every wait at once: an error instead.
Deadline deadline_in(std::optional<double> seconds) {
  if (!seconds || *seconds > 1e9) return std::nullopt;  // inf included; 1e9 s is ~32 years
  if (!(*seconds >= 0)) {
    throw Error(ErrorCode::InvalidArgument,
                "timeout must be seconds >= 0, or None for no limit, not " + as_text(*seconds));
  }
  auto wait = std::chrono::duration<double>(*seconds);
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(wait);
}

// Threads outside the GIL in this module, and the interpreter's exit. From the moment Python
// starts shutting down, a thread that takes the GIL back ends with pthread_exit, which from
// inside pybind11's noexcept gil_scoped_release destructor aborts the whole process: a
// server's daemon thread waiting in next() did that at every exit (exit 134). So an atexit
// hook, which runs while the interpreter is still whole, has every such thread park once its
// current slice of work ends (<= kSignalCheck of waiting, or a copy): it sleeps without the
// GIL until the process is gone. The hook waits until all of them are parked or back.
class OutsideGil {
 public:
  // Runs work() without the GIL; at exit, parks instead of returning. Called with the GIL.
  template <class Work>
  static auto run(Work&& work) {
    Counted counted;  // left only once the GIL is back (destroyed last)
    py::gil_scoped_release unlocked;
    struct ParkAtExit {
      ~ParkAtExit() {  // runs before `unlocked` takes the GIL back
        if (!exiting) return;
        ++parked;
        for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
      }
    } park;
    return work();
  }

  // The atexit hook's part, with the GIL: from now on threads park, and this returns once
  // every thread outside the GIL parked or came back. Later calls raise at once.
  static void park_all() {
    exiting = true;  // with the GIL: no call starts meanwhile
    py::gil_scoped_release unlocked;  // those waiting to take the GIL back take it meanwhile
    while (outside != parked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  // In a forked child, whose only thread is the one that forked (holding the GIL): the
  // parent's other threads were counted but are not there to park.
  static void forget_other_threads() {
    outside = 0;
    parked = 0;
  }

 private:
  static inline std::atomic<bool> exiting = false;
  static inline std::atomic<int> outside = 0;
  static inline std::atomic<int> parked = 0;

  struct Counted {
    Counted() {
      if (exiting) throw Error(ErrorCode::InvalidArgument, "the interpreter is exiting");
      ++outside;
    }
    ~Counted() { --outside; }
  };
};

// Calls attempt(slice) without the GIL, in slices of at most kSignalCheck, until it returns
// something true or `deadline` passes; returns its last result. Each attempt either finishes
// or leaves nothing done, so Ctrl+C between two of them interrupts a long wait cleanly.
template <class Attempt>
auto wait_until(Deadline deadline, Attempt&& attempt) {
  for (;;) {
    auto slice = kSignalCheck;
    if (deadline) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now());
      slice = std::clamp(left, std::chrono::milliseconds(0), kSignalCheck);
    }
    auto result = OutsideGil::run([&] { return attempt(slice); });
    if (result || (deadline && Clock::now() >= *deadline)) return result;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// Forks of this process so far, as its child counts them: bumped in every child
// (pthread_atfork, registered at import).
std::atomic<std::uint64_t> forks_seen = 0;

void after_fork_in_child() {
  ++forks_seen;
  OutsideGil::forget_other_threads();
}

// A C++ Publisher or Subscriber serves one thread at a time (channel.hpp), and its wrapper gives
// up the GIL while it waits and copies, which lets another thread in: each call takes a turn
// first. A child forked while a thread of the parent had the turn inherits it taken, by a
// thread the child does not have: there calls go straight on, to the C++ handle, which refuses
// them (and, closing, touches nothing shared). A flag under a mutex, waited for on a condition
// variable, rather than a std::timed_mutex: that one waits in pthread_mutex_clocklock, which
// ThreadSanitizer (gcc 12's) does not intercept, so a TSan run saw neither the turns nor what
// they order, and reported an unlock of a mutex it had never seen locked.
struct Turns {
  std::mutex mutex;
  std::condition_variable given_back;
  bool taken = false;  // guarded by mutex
  std::uint64_t forks = forks_seen;  // when the handle was made
  // Set by close() before it takes its turn: a call waiting in another thread sees it between
  // two wait slices and ends, where close() would otherwise wait behind it (for ever with None).
  std::atomic<bool> closing = false;
};

// A turn held, given back when destroyed; empty in a forked child (see Turns).
class Turn {
 public:
  Turn() = default;
  explicit Turn(Turns& turns) : turns_(&turns) {}
  Turn(Turn&& other) noexcept : turns_(std::exchange(other.turns_, nullptr)) {}
  Turn& operator=(Turn&&) = delete;
  ~Turn() {
    if (turns_ == nullptr) return;
    {
      std::lock_guard lock(turns_->mutex);
      turns_->taken = false;
    }
    turns_->given_back.notify_one();
  }

 private:
  Turns* turns_ = nullptr;
};

// Waits as wait_until does; none, with nothing done, when `deadline` passed first.
std::optional<Turn> take_turn(Turns& turns, Deadline deadline = std::nullopt) {
  if (turns.forks != forks_seen) return Turn();  // in a forked child: see Turns
  auto take = [&](std::chrono::milliseconds slice) {
    std::unique_lock lock(turns.mutex);
    if (!turns.given_back.wait_for(lock, slice, [&] { return !turns.taken; })) return false;
    turns.taken = true;
    return true;
  };
  if (take(std::chrono::milliseconds(0)) || wait_until(deadline, take)) return std::optional<Turn>(std::in_place, turns);
  return std::nullopt;
}

// close()'s turn: announced first (see Turns::closing), then taken.
Turn take_last_turn(Turns& turns) {
  turns.closing = true;
  return std::move(*take_turn(turns));
}

// The name of a Python object's type, for error messages: "int", "list".
std::string type_name(PyObject* value) { return Py_TYPE(value)->tp_name; }
std::string type_name(const py::handle& value) { return type_name(value.ptr()); }

// Whether a Python object is a torch.Tensor. THPVariable_Check alone is an isinstance() that,
// for any type but Tensor itself, goes through the metaclass's __instancecheck__: ~30 ns, which
// made a publish of 1000 nn.Parameters ~50% slower than one of their state_dict() copies.
bool is_tensor(const py::handle& value) {
  return THPVariable_CheckExact(value.ptr()) || THPVariable_Check(value.ptr());
}

// Calls visit(name, tensor) for a (name, tensor) pair: a tuple or a list of two.
template <class Visit>
void visit_pair(PyObject* pair, Visit& visit) {
  if (!(PyTuple_Check(pair) || PyList_Check(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) {
    throw Error(ErrorCode::InvalidArgument,
                "expected (name, tensor) pairs, not an item of type " + type_name(pair));
  }
  visit(py::handle(PySequence_Fast_GET_ITEM(pair, 0)), py::handle(PySequence_Fast_GET_ITEM(pair, 1)));
}

// Calls visit(name, tensor) for each item of a mapping {name: tensor} (a dict, a Bucket) or of
// an iterable of (name, tensor) pairs, in its order. Borrowed handles, valid during the call.
// Dicts, lists and tuples are read in place: through Python's iterator protocol a list of 1000
// pairs took ~30 us longer to publish than the same dict.
template <class Visit>
void for_each_item(const py::handle& tensors, Visit&& visit) {
  PyObject* all = tensors.ptr();
  if (PyDict_Check(all)) {
    PyObject *key, *value;
    Py_ssize_t at = 0;
    while (PyDict_Next(all, &at, &key, &value)) visit(py::handle(key), py::handle(value));
    return;
  }
  if (PyList_Check(all) || PyTuple_Check(all)) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(all); ++i) {
      visit_pair(PySequence_Fast_GET_ITEM(all, i), visit);
    }
    return;
  }
  if (py::hasattr(tensors, "items")) {
    for (auto item : py::iterable(tensors.attr("items")())) visit_pair(item.ptr(), visit);
    return;
  }
  // A tensor or a str would iterate, into rows or letters: refused as a whole instead.
  if (is_tensor(tensors) || PyUnicode_Check(all) || !py::isinstance<py::iterable>(tensors)) {
    std::string hint = py::hasattr(tensors, "state_dict")
                           ? "; for a module, pass module.state_dict(keep_vars=True), built once"
                           : "";
    throw Error(ErrorCode::InvalidArgument,
                "tensors must be a dict {name: tensor} or a list of (name, tensor) pairs, not " +
                    type_name(tensors) + hint);
  }
  for (auto item : py::reinterpret_borrow<py::iterable>(tensors)) visit_pair(item.ptr(), visit);
}

// The tensor a Python object holds; InvalidArgument naming the entry otherwise.
const at::Tensor& tensor_of(const py::handle& value, const std::string& name) {
  if (!is_tensor(value)) {
    throw Error(ErrorCode::InvalidArgument,
                "entry '" + name + "' is of type " + type_name(value) + ", not torch.Tensor");
  }
  return THPVariable_Unpack(value.ptr());
}

// A str's UTF-8 form, kept by the str; none for anything else, or a str without one (a lone
// surrogate).
std::optional<std::string_view> utf8_of(const py::handle& text) {
  if (!PyUnicode_Check(text.ptr())) return std::nullopt;
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(text.ptr(), &size);
  if (utf8 == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  return std::string_view(utf8, static_cast<std::size_t>(size));
}

// A tensor or group name; InvalidArgument when it is not a str or has no UTF-8 form.
std::string name_of(const py::handle& name, const char* what = "tensor names") {
  if (!PyUnicode_Check(name.ptr())) {
    throw Error(ErrorCode::InvalidArgument, std::string(what) + " must be str, not " + type_name(name));
  }
  auto utf8 = utf8_of(name);
  if (!utf8) {
    throw Error(ErrorCode::InvalidArgument, "name " + std::string(py::repr(name)) + " has no UTF-8 form");
  }
  return std::string(*utf8);
}

NamedTensors to_named(const py::handle& tensors, std::vector<py::object>* keys = nullptr) {
  NamedTensors out;
  for_each_item(tensors, [&](py::handle key, py::handle value) {
    auto name = name_of(key);
    const auto& tensor = tensor_of(value, name);
    out.emplace_back(std::move(name), tensor);
    if (keys != nullptr) keys->push_back(py::reinterpret_borrow<py::object>(key));
  });
  return out;
}

Manifest to_manifest(const py::handle& tensors) { return torch_bridge::manifest_of(to_named(tensors)); }

// {group: [member, ...]} or None.
std::vector<ManifestGroup> to_groups(const py::handle& groups) {
  std::vector<ManifestGroup> out;
  if (groups.is_none()) return out;
  if (!PyDict_Check(groups.ptr())) {
    throw Error(ErrorCode::InvalidArgument,
                "groups must be a dict {group: [member, ...]}, not " + type_name(groups));
  }
  for (auto [group, members] : groups.cast<py::dict>()) {
    auto& added = out.emplace_back(ManifestGroup{name_of(group, "group names"), {}});
    if (!PyList_Check(members.ptr()) && !PyTuple_Check(members.ptr())) {  // a str would iterate
      throw Error(ErrorCode::InvalidArgument, "group '" + added.name +
                                                  "': members must be a list or tuple of names, not " +
                                                  type_name(members));
    }
    for (auto member : members) added.members.push_back(name_of(member, "group members"));
  }
  return out;
}

// Whether `key` names `name`: the same str object (a state_dict's keys usually are), or an
// equal one.
bool names(const py::handle& key, const py::object& kept_key, const std::string& name) {
  if (key.ptr() == kept_key.ptr()) return true;
  auto utf8 = utf8_of(key);  // none: not equal either, and the slow path will say why
  return utf8 && *utf8 == name;
}

// Where a channel's payloads live, from a Python device: None, "cpu", "cuda", "cuda:N" or a
// torch.device ("cuda" alone is device 0).
PayloadLocation location_of(const py::handle& device) {
  if (device.is_none()) return PayloadLocation::host();
  return PayloadLocation::parse(py::str(device).cast<std::string>());
}

// torch's current stream on `where`'s device (null on the host): what device work is ordered
// with, as torch's own operations are. Asked with the GIL.
CudaStream current_stream(PayloadLocation where) {
  if (where.on_host()) return nullptr;
  auto stream = py::module_::import("torch").attr("cuda").attr("current_stream")(where.device);
  return reinterpret_cast<CudaStream>(stream.attr("cuda_stream").cast<std::uintptr_t>());
}

class PyPublisher {
 public:
  PyPublisher(const std::string& channel, std::uint32_t slots, std::uint32_t min_consumers,
              std::uint32_t max_consumers, bool checksum, std::uint32_t mode, const py::handle& device,
              const std::string& policy, std::uint32_t update_buckets)
      : publisher_(Publisher::create(channel, {.slots = slots,
                                               .max_consumers = max_consumers,
                                               .min_consumers = min_consumers,
                                               .mode = mode,
                                               .payload_checksum = checksum,
                                               .location = location_of(device),
                                               .policy = parse_overflow_policy(policy),
                                               .update_buckets = update_buckets})) {
    open().insert(this);
  }
  ~PyPublisher() { open().erase(this); }

  // Every Publisher not yet destroyed, with the GIL. Python does not destroy at exit what a
  // daemon thread still reaches, which left such a channel's segments in /dev/shm (memory)
  // until the next producer of its name: an atexit hook closes them all.
  static std::unordered_set<PyPublisher*>& open() {
    static std::unordered_set<PyPublisher*> all;
    return all;
  }

  // Every call writes the tensors straight into the slot. A trainer sends the same names,
  // dtypes and shapes every step: a call with the names of the layout kept from the last one
  // goes straight to the copy, whose check of every tensor against the layout refuses (with
  // ManifestMismatch, before anything is reserved) when one changed; any other call checks
  // everything and keeps its layout instead.
  void publish(const py::handle& tensors, std::uint64_t version, std::uint32_t bucket_index,
               std::uint32_t bucket_count, const py::handle& groups,
               std::optional<double> timeout) {
    auto deadline = deadline_in(timeout);
    auto turn = take_turn(turn_, deadline);
    if (!turn) throw WaitTimeout{"another thread's call on channel '" + publisher_.channel() + "' took the whole timeout; nothing was published"};
    auto group_list = to_groups(groups);
    if (kept_ && kept_->groups == group_list && stage_kept(tensors)) {
      try {
        return publish_staged(version, bucket_index, bucket_count, deadline);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::ManifestMismatch) throw;  // a dtype or shape changed
      }
    }
    staged_.clear();
    Kept fresh;
    auto named = to_named(tensors, &fresh.keys);
    fresh.builder =
        torch_bridge::layout_of(named, version, bucket_index, bucket_count, group_list, publisher_.location());
    fresh.groups = std::move(group_list);
    for (auto& [name, tensor] : named) staged_.push_back(std::move(tensor));
    kept_ = std::move(fresh);
    publish_staged(version, bucket_index, bucket_count, deadline);
  }

  bool drain(std::optional<double> timeout) {
    auto deadline = deadline_in(timeout);
    auto turn = take_turn(turn_, deadline);
    return turn && wait_until(deadline, [&](auto slice) {
             stop_if_closing("");
             return publisher_.drain(slice);
           });
  }
  void close() {
    auto turn = take_last_turn(turn_);
    publisher_.close();
  }
  // Without a turn: a parked thread may hold it, but it is done with the C++ handle.
  void close_at_exit() { publisher_.close(); }
  // Read without a turn, so that a thread that reports progress does not wait for a publish.
  std::uint64_t published() const { return published_; }
  std::uint64_t incarnation() const { return publisher_.incarnation(); }
  std::string policy() const { return std::string(to_string(publisher_.policy())); }

 private:
  struct Kept {
    std::vector<py::object> keys;  // the caller's name objects, for an identity compare
    std::vector<ManifestGroup> groups;
    BucketBuilder builder;  // every entry declared
  };

  // Between the wait slices of publish() and drain(): see Turns::closing.
  void stop_if_closing(const char* outcome) const {
    if (turn_.closing) {
      throw Error(ErrorCode::InvalidArgument, "channel '" + publisher_.channel() + "' is closed" + outcome);
    }
  }

  // Fills staged_ when `tensors` hold tensors under the kept layout's names, in its order.
  bool stage_kept(const py::handle& tensors) {
    staged_.clear();
    const auto& entries = kept_->builder.manifest().entries;
    std::size_t i = 0;
    bool named_alike = true;
    for_each_item(tensors, [&](py::handle key, py::handle value) {
      named_alike = named_alike && i < entries.size() &&
                    names(key, kept_->keys[i], entries[i].name) && is_tensor(value);
      if (named_alike) staged_.push_back(THPVariable_Unpack(value.ptr()));
      ++i;
    });
    return named_alike && i == entries.size();
  }

  // Publishes staged_ through the kept layout, without the GIL; staged_ is emptied either way.
  void publish_staged(std::uint64_t version, std::uint32_t bucket_index,
                      std::uint32_t bucket_count, Deadline deadline) {
    struct Unstage {
      std::vector<at::Tensor>& staged;
      ~Unstage() { staged.clear(); }  // with the GIL: a tensor may be the last owner of its object
    } unstage{staged_};
    kept_->builder.version(version).bucket(bucket_index, bucket_count);
    auto stream = current_stream(publisher_.location());
    bool published = wait_until(deadline, [&](auto slice) {
      stop_if_closing("; nothing was published");
      return torch_bridge::publish_in_place(publisher_, kept_->builder, staged_, slice, stream);
    });
    if (!published) {
      auto waited_for = publisher_.waiting_for();
      throw WaitTimeout{"no slot of channel '" + publisher_.channel() + "' came free in time, waiting for " +
                        (waited_for.empty() ? std::string("a consumer") : waited_for) + "; nothing was published"};
    }
    published_ = publisher_.published();
  }

  Turns turn_;
  std::atomic<std::uint64_t> published_ = 0;  // publisher_.published(), after each publish
  Publisher publisher_;
  std::optional<Kept> kept_;
  std::vector<at::Tensor> staged_;  // this call's tensors in layout order; reused for capacity
};

// A received bucket, read as a mapping {name: tensor} whose zero-copy views are made on first
// access: most of a small handoff's cost in Python was making 1000 tensor objects nobody had
// asked for yet. Each view keeps the lease, so it outlives release() and the Bucket.
class PyBucket {
 public:
  explicit PyBucket(ReceivedBucket bucket) : PyBucket(std::make_shared<const ReceivedBucket>(std::move(bucket))) {}
  // One bucket of an update, which this keeps whole while it lives.
  explicit PyBucket(std::shared_ptr<const ReceivedBucket> held)
      : PyBucket(*held, held) {}

 private:
  PyBucket(const ReceivedBucket& bucket, std::shared_ptr<const ReceivedBucket> held)
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
        views_(size_) {}

 public:

  std::size_t size() const { return size_; }
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
    for (const auto& entry : live()->view().manifest().entries) out.append(py::str(entry.name));
    return out;
  }
  py::list values() {
    py::list out;
    for (std::size_t i = 0; i < size_; ++i) out.append(view(i));
    return out;
  }
  py::list items() {
    py::list out;
    const auto& entries = live()->view().manifest().entries;
    for (std::size_t i = 0; i < size_; ++i) out.append(py::make_tuple(py::str(entries[i].name), view(i)));
    return out;
  }
  // Every view at once, as a dict.
  py::dict tensors() {
    py::dict out;
    const auto& entries = live()->view().manifest().entries;
    for (std::size_t i = 0; i < size_; ++i) out[py::str(entries[i].name)] = view(i);
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
    bucket_.reset();
  }
  // Drops this handle's hold, and its views; tensors already taken keep the lease until they die.
  // A CUDA bucket this handle alone holds is released after the work queued so far on torch's
  // current stream; one whose views live on is released, when the last dies, after the work
  // queued on the stream it was received on.
  void release() {
    views_.clear();
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
  py::object view(std::size_t i) {
    live();
    if (!views_[i]) views_[i] = py::cast(torch_bridge::tensor(bucket_, i));
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
  std::vector<py::object> views_;  // by entry position; empty until asked for
};

// A whole update: its buckets, in order, and a read-only mapping {name: tensor} over all of
// them. Its slots stay leased while it, one of its Buckets or a view lives.
class PyUpdate {
 public:
  explicit PyUpdate(ReceivedUpdate update)
      : update_(std::make_shared<const ReceivedUpdate>(std::move(update))),
        version_(update_->version()),
        incarnation_(update_->incarnation()),
        sequence_(update_->first_sequence()),
        publish_start_ns_(update_->buckets().front().publish_start_ns()),
        published_ns_(update_->buckets().back().published_ns()) {
    for (const auto& bucket : update_->buckets()) {
      buckets_.push_back(py::cast(PyBucket(std::shared_ptr<const ReceivedBucket>(update_, &bucket))));
    }
  }

  std::uint64_t version() const { return version_; }
  std::uint64_t incarnation() const { return incarnation_; }
  std::uint64_t sequence() const { return sequence_; }
  std::uint64_t publish_start_ns() const { return publish_start_ns_; }
  std::uint64_t published_ns() const { return published_ns_; }
  py::tuple buckets() const { return py::tuple(py::cast(buckets_)); }
  std::size_t bucket_count() const { return buckets_.size(); }

  // The received update, for load_into(); InvalidArgument once released.
  const ReceivedUpdate& received() const {
    if (!update_) throw Error(ErrorCode::InvalidArgument, "update was released");
    return *update_;
  }

  std::size_t size() const {
    std::size_t total = 0;
    for (const auto& bucket : buckets_) total += bucket.cast<const PyBucket&>().size();
    return total;
  }
  bool contains(const py::handle& name) const { return bucket_with(name) != nullptr; }
  py::object get_item(const py::handle& name) const {
    auto* bucket = bucket_with(name);
    if (bucket == nullptr) throw py::key_error(py::str(name));
    return bucket->get_item(name.cast<std::string_view>());
  }
  py::list keys() const {
    return gather([](PyBucket& bucket) { return bucket.keys(); });
  }
  py::list values() const {
    return gather([](PyBucket& bucket) { return bucket.values(); });
  }
  py::list items() const {
    return gather([](PyBucket& bucket) { return bucket.items(); });
  }
  py::dict tensors() const {
    py::dict out;
    for (const auto& bucket : buckets_) out.attr("update")(bucket.cast<PyBucket&>().tensors());
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
  PyBucket* bucket_with(const py::handle& name) const {
    for (const auto& bucket : buckets_) {
      auto& held = bucket.cast<PyBucket&>();
      if (held.contains(name)) return &held;
    }
    return nullptr;
  }
  template <class Part>
  py::list gather(Part part) const {
    py::list out;
    for (const auto& bucket : buckets_) {
      for (auto item : part(bucket.cast<PyBucket&>())) out.append(item);
    }
    return out;
  }

  std::shared_ptr<const ReceivedUpdate> update_;
  std::uint64_t version_;
  std::uint64_t incarnation_;
  std::uint64_t sequence_;
  std::uint64_t publish_start_ns_;
  std::uint64_t published_ns_;
  std::vector<py::object> buckets_;  // PyBucket
};

class PySubscriber {
 public:
  PySubscriber(const std::string& channel, std::optional<double> timeout, const py::handle& device, bool follow,
               bool whole_updates)
      : channel_(channel),
        follows_(follow),
        subscriber_(attach(channel, timeout,
                           {.expected_location = expected_kind(device),
                            .whole_updates = whole_updates,
                            .follow_restarts = follow})) {}

  std::optional<PyBucket> next(std::optional<double> timeout, const py::handle& expected) {
    auto bucket = receive(timeout, expected, [&](auto slice, const auto& options, auto stream) {
      return subscriber_->next(slice, options, stream);
    });
    if (!bucket) return std::nullopt;
    return PyBucket(std::move(*bucket));
  }

  std::optional<PyUpdate> next_update(std::optional<double> timeout, const py::handle& expected) {
    auto update = receive(timeout, expected, [&](auto slice, const auto& options, auto stream) {
      return subscriber_->next_update(slice, options, stream);
    });
    if (!update) return std::nullopt;
    return PyUpdate(std::move(*update));
  }

  std::uint64_t incarnation() {
    auto turn = take_turn(turn_);
    return live().incarnation();
  }
  std::string policy() {
    auto turn = take_turn(turn_);
    return std::string(to_string(live().policy()));
  }

  // Stops receiving: a next() waiting in another thread raises (see Turns::closing). The
  // consumer leaves the channel once every bucket and view it handed out is gone; their leases
  // hold until then.
  void close() {
    auto turn = take_last_turn(turn_);
    subscriber_.reset();
  }

 private:
  Subscriber& live() {
    if (!subscriber_) throw Error(ErrorCode::InvalidArgument, "subscriber of channel '" + channel_ + "' is closed");
    return *subscriber_;
  }

  // Waits, in turn and in slices, for what `take(slice, options, stream)` returns.
  template <class Take>
  auto receive(std::optional<double> timeout, const py::handle& expected, Take&& take)
      -> decltype(take(std::chrono::milliseconds(0), VerifyOptions{}, CudaStream{})) {
    auto deadline = deadline_in(timeout);
    std::optional<Manifest> expected_manifest;
    if (!expected.is_none()) expected_manifest = to_manifest(expected);
    VerifyOptions options{.expected = expected_manifest ? &*expected_manifest : nullptr};
    auto turn = take_turn(turn_, deadline);
    if (!turn) return std::nullopt;
    auto stream = current_stream(live().location());
    return wait_until(deadline, [&](auto slice) {
      if (turn_.closing) throw Error(ErrorCode::InvalidArgument, "subscriber of channel '" + channel_ + "' is closed");
      return take(slice, options, stream);
    });
  }

  static std::optional<PayloadLocation::Kind> expected_kind(const py::handle& device) {
    if (device.is_none()) return std::nullopt;
    return location_of(device).kind;
  }

  static Subscriber attach(const std::string& channel, std::optional<double> timeout, const SubscribeOptions& options) {
    auto attached = wait_until(deadline_in(timeout), [&](auto slice) -> std::optional<Subscriber> {
      try {
        return Subscriber::attach(channel, slice, options);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::ChannelMissing) throw;
        return std::nullopt;  // not there yet
      }
    });
    if (!attached) {
      throw Error(ErrorCode::ChannelMissing,
                  "channel '" + channel + "' had no live producer within " + as_text(*timeout) + " s");
    }
    return std::move(*attached);
  }

  Turns turn_;
  std::string channel_;
  bool follows_;
  std::optional<Subscriber> subscriber_;  // none once closed

 public:
  bool follows() const { return follows_; }
};

// `for update in subscriber.updates()`: each whole update in turn, the one before released
// when the next is asked for; the loop ends when the producer is gone (with follow, it waits
// for the next producer instead). Timeout when none came within `timeout`.
class PyUpdates {
 public:
  PyUpdates(py::object subscriber, std::optional<double> timeout, py::object expected)
      : subscriber_(std::move(subscriber)),
        timeout_(timeout),
        expected_(std::move(expected)),
        follow_(subscriber_.cast<const PySubscriber&>().follows()) {}

  py::object next() {
    if (!previous_.is_none()) {
      auto& update = previous_.cast<PyUpdate&>();
      try {
        update.release();
      } catch (const Error&) {
        // The loop's body released it already.
      }
      previous_ = py::none();
    }
    auto& subscriber = subscriber_.cast<PySubscriber&>();
    for (;;) {
      std::optional<PyUpdate> update;
      try {
        update = subscriber.next_update(timeout_, expected_);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::ProducerGone) throw;
        if (follow_) continue;  // the next call waits for the next producer
        throw py::stop_iteration();
      }
      if (!update) {
        throw WaitTimeout{"no whole update arrived within " + as_text(*timeout_) + " s"};
      }
      previous_ = py::cast(std::move(*update));
      return previous_;
    }
  }

 private:
  py::object subscriber_;
  std::optional<double> timeout_;
  py::object expected_;
  bool follow_;
  py::object previous_ = py::none();
};

// Strict load_state_dict: every problem in one error, nothing copied when any.
// Into a module, or into its tensors as a mapping: state_dict() of 1000 tensors costs more
// than loading them, and a server that built it once saves that on every step.
void load_into(const py::object& module, const py::handle& tensors) {
  // keep_vars: the parameters themselves, without the detach() per entry that is about half
  // of what a state_dict() costs
  bool is_module = py::hasattr(module, "state_dict");
  if (!is_module && !py::hasattr(module, "items")) {
    throw Error(ErrorCode::InvalidArgument,
                "module must be a torch.nn.Module or its state_dict(keep_vars=True), not " + type_name(module));
  }
  auto targets = to_named(is_module ? module.attr("state_dict")(py::arg("keep_vars") = true) : module);
  if (py::isinstance<PyUpdate>(tensors)) {  // each bucket straight from its bytes
    const auto& update = tensors.cast<const PyUpdate&>().received();
    auto stream = current_stream(update.buckets().front().view().location());
    OutsideGil::run([&] { torch_bridge::load_into(targets, update, stream); });
    return;
  }
  if (py::isinstance<PyBucket>(tensors)) {  // straight from its bytes: no view of each entry
    auto bucket = tensors.cast<const PyBucket&>().received();
    auto stream = current_stream(bucket->view().location());
    OutsideGil::run([&] { torch_bridge::load_into(targets, bucket->view(), stream); });
    return;
  }
  auto sources = to_named(tensors);
  OutsideGil::run([&] { torch_bridge::load_into(targets, sources); });
}

// Sets an instance of `type` as the pending Python error, its `code` attribute the ErrorCode's
// name. The message names the code first only where the class does not already say it
// (ManifestError: "Overlap: ...", not "ProducerGone: ProducerGone: ...").
void raise_as(const py::exception<Error>& type, std::string_view code, const std::string& message) {
  auto name = type.attr("__name__").cast<std::string>();
  auto text = name == code ? message : std::string(code) + ": " + message;
  auto instance = py::reinterpret_borrow<py::object>(type)(text);
  instance.attr("code") = py::str(code.data(), code.size());
  PyErr_SetObject(type.ptr(), instance.ptr());
}

}  // namespace

PYBIND11_MODULE(tensorbucket, m) {
  // torch's Python types (torch.Tensor) are set up by importing torch: without it, a server
  // that imported only tensorbucket crashed on its first view.
  py::module_::import("torch");

  m.attr("__version__") = TENSORBUCKET_VERSION;
  m.doc() = "Move named torch tensors between processes as verified zero-copy buckets.\n\n"
            "Every timeout is in seconds; None waits without limit. Ctrl+C interrupts any wait, "
            "and an interrupted publish() has published nothing. Threads sharing a Publisher or a "
            "Subscriber take turns.";

  // One Python class per error family, all under tensorbucket.Error; those a Python user would
  // catch as a builtin are that builtin too.
  static py::exception<Error> error(m, "Error");
  static py::exception<Error> manifest_error(m, "ManifestError", error.ptr());
  static py::exception<Error> checksum_mismatch(m, "ChecksumMismatch", error.ptr());
  static py::exception<Error> timeout(m, "Timeout", py::make_tuple(error, py::handle(PyExc_TimeoutError)));
  static py::exception<Error> producer_gone(m, "ProducerGone", error.ptr());
  static py::exception<Error> channel_error(m, "ChannelError", error.ptr());
  static py::exception<Error> device_error(m, "DeviceError", error.ptr());
  static py::exception<Error> invalid_argument(m, "InvalidArgument", py::make_tuple(error, py::handle(PyExc_ValueError)));
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const WaitTimeout& e) {
      raise_as(timeout, "Timeout", e.message);
    } catch (const Error& e) {
      auto code = to_string(e.code());
      switch (e.code()) {
        case ErrorCode::ChecksumMismatch: raise_as(checksum_mismatch, code, e.what()); return;
        case ErrorCode::ProducerGone: raise_as(producer_gone, code, e.what()); return;
        case ErrorCode::ChannelExists:
        case ErrorCode::ChannelMissing:
        case ErrorCode::PermissionDenied:
        case ErrorCode::ChannelFull:
        case ErrorCode::LocationMismatch: raise_as(channel_error, code, e.what()); return;
        case ErrorCode::CudaUnavailable:
        case ErrorCode::DeviceNotVisible:
        case ErrorCode::CudaFailed: raise_as(device_error, code, e.what()); return;
        case ErrorCode::InvalidArgument: raise_as(invalid_argument, code, e.what()); return;
        case ErrorCode::SystemError: raise_as(error, code, e.what()); return;
        // Every way a bucket fails verification. Listed, not a default: a new code must be
        // placed here on purpose (the compiler names a missing one).
        case ErrorCode::MissingManifest:
        case ErrorCode::MissingPayload:
        case ErrorCode::HeaderCorrupt:
        case ErrorCode::ManifestCorrupt:
        case ErrorCode::UnsupportedDtype:
        case ErrorCode::BadName:
        case ErrorCode::BadShape:
        case ErrorCode::OutOfBounds:
        case ErrorCode::Overlap:
        case ErrorCode::Misaligned:
        case ErrorCode::DuplicateName:
        case ErrorCode::IncompleteGroup:
        case ErrorCode::Unmaterialized:
        case ErrorCode::ManifestMismatch:
        case ErrorCode::Torn: raise_as(manifest_error, code, e.what()); return;
      }
    }
  });

  // At exit: park the threads waiting in this module (OutsideGil), then close every open
  // Publisher, which Python would not destroy while a daemon thread still reaches it.
  ::pthread_atfork(nullptr, nullptr, &after_fork_in_child);
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    OutsideGil::park_all();
    for (auto* publisher : std::vector<PyPublisher*>(PyPublisher::open().begin(), PyPublisher::open().end())) {
      publisher->close_at_exit();
    }
  }));

  py::class_<PyPublisher>(m, "Publisher",
                          "The producer of a channel: publishes dicts (or lists of (name, tensor) pairs) "
                          "as verified buckets into shared memory, or into one GPU's memory. A context "
                          "manager: leaving it closes the channel and removes its segments.")
      .def(py::init<const std::string&, std::uint32_t, std::uint32_t, std::uint32_t, bool, std::uint32_t,
                    const py::handle&, const std::string&, std::uint32_t>(),
           py::arg("channel"), py::arg("slots") = 2, py::arg("min_consumers") = 1,
           py::arg("max_consumers") = 8, py::arg("checksum") = false, py::arg("mode") = 0600,
           py::arg("device") = py::none(), py::arg("policy") = "block", py::arg("update_buckets") = 1,
           "Create a channel. device: where its payloads live, None or 'cpu' (host shared memory) "
           "or 'cuda:N' / a torch.device (that GPU; then publish() takes tensors on it). policy: "
           "'block' (lossless: publish waits for slow consumers) or 'latest' (publish never waits "
           "for them; they skip to the newest whole update), which needs slots >= "
           "(max_consumers + 1) * update_buckets, the most buckets an update has.")
      .def("publish", &PyPublisher::publish, py::arg("tensors"), py::arg("version") = 0,
           py::arg("bucket_index") = 0, py::arg("bucket_count") = 1, py::arg("groups") = py::none(),
           py::arg("timeout") = 10.0,
           "Publish a dict or list of (name, tensor), copied straight into shared memory (on a "
           "CUDA channel: into device memory, after the work queued on torch's current stream); "
           "raises Timeout when no slot comes free.")
      .def("drain", &PyPublisher::drain, py::arg("timeout") = 10.0,
           "Wait until consumers released everything; False on timeout.")
      .def("close", &PyPublisher::close,
           "Close the channel; a publish() or drain() waiting in another thread raises Error.")
      .def_property_readonly("published", &PyPublisher::published)
      .def_property_readonly("incarnation", &PyPublisher::incarnation,
                             "Random, new for each Publisher of a channel name.")
      .def_property_readonly("policy", &PyPublisher::policy)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyPublisher& self, py::args) { self.close(); });

  py::class_<PyBucket>(m, "Bucket",
                      "A verified bucket: a read-only mapping {name: tensor} of zero-copy views, "
                      "each made on first access. The views are mapped read-only: writing "
                      "through one faults (SIGSEGV); clone() to modify.")
      .def("__len__", &PyBucket::size)
      .def("__contains__", &PyBucket::contains)
      .def("__getitem__", &PyBucket::get_item)
      .def("__iter__", [](const PyBucket& self) { return py::iter(self.keys()); })
      .def("keys", &PyBucket::keys)
      .def("values", &PyBucket::values)
      .def("items", &PyBucket::items)
      .def("get", [](PyBucket& self, const py::handle& name, const py::object& fallback) {
             return self.contains(name) ? self.get_item(name.cast<std::string_view>()) : fallback;
           }, py::arg("name"), py::arg("default") = py::none())
      .def("tensors", &PyBucket::tensors, "Every view at once, as a dict {name: tensor}.")
      .def_property_readonly("version", &PyBucket::version)
      .def_property_readonly("bucket_index", &PyBucket::bucket_index)
      .def_property_readonly("bucket_count", &PyBucket::bucket_count)
      .def_property_readonly("sequence", &PyBucket::sequence)
      .def_property_readonly("incarnation", &PyBucket::incarnation,
                             "The publisher's incarnation: sequences count within one.")
      .def_property_readonly("publish_start_ns", &PyBucket::publish_start_ns,
                             "When the producer began publishing it, as time.monotonic_ns() counts.")
      .def_property_readonly("published_ns", &PyBucket::published_ns,
                             "When it became visible to consumers, as time.monotonic_ns() counts.")
      .def_property_readonly("received_ns", &PyBucket::received_ns,
                             "When next() handed it over, as time.monotonic_ns() counts: received_ns - "
                             "publish_start_ns is the handoff's latency.")
      .def("release", &PyBucket::release,
           "Give the slot back (once no view taken from it lives); a second release() raises.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyBucket& self, py::args) { self.release(); })
      .def("__repr__", [](const PyBucket& self) {
        return "<tensorbucket.Bucket version=" + std::to_string(self.version()) + " bucket " +
               std::to_string(self.bucket_index()) + "/" + std::to_string(self.bucket_count()) +
               ", " + std::to_string(self.size()) + " tensors>";
      });
  // load_state_dict() and other Mapping users accept a Bucket as it is.
  py::module_::import("collections.abc").attr("Mapping").attr("register")(m.attr("Bucket"));

  py::class_<PyUpdate>(m, "Update",
                      "A whole update: its buckets (bucket_index 0..count-1 of one version) and a "
                      "read-only mapping {name: tensor} over all of them. Holds their slots until "
                      "released.")
      .def("__len__", &PyUpdate::size)
      .def("__contains__", &PyUpdate::contains)
      .def("__getitem__", &PyUpdate::get_item)
      .def("__iter__", [](const PyUpdate& self) { return py::iter(self.keys()); })
      .def("keys", &PyUpdate::keys)
      .def("values", &PyUpdate::values)
      .def("items", &PyUpdate::items)
      .def("tensors", &PyUpdate::tensors, "Every view at once, as a dict {name: tensor}.")
      .def_property_readonly("buckets", &PyUpdate::buckets, "Its Buckets, in order.")
      .def_property_readonly("bucket_count", &PyUpdate::bucket_count)
      .def_property_readonly("version", &PyUpdate::version)
      .def_property_readonly("incarnation", &PyUpdate::incarnation)
      .def_property_readonly("sequence", &PyUpdate::sequence, "The sequence of its first bucket.")
      .def_property_readonly("publish_start_ns", &PyUpdate::publish_start_ns,
                             "When the producer began publishing its first bucket, as time.monotonic_ns() counts.")
      .def_property_readonly("published_ns", &PyUpdate::published_ns,
                             "When its last bucket became visible to consumers, as time.monotonic_ns() counts.")
      .def("release", &PyUpdate::release,
           "Give every slot of the update back (once no view taken from it lives); a second release() raises.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyUpdate& self, py::args) { self.release(); })
      .def("__repr__", [](const PyUpdate& self) {
        return "<tensorbucket.Update version=" + std::to_string(self.version()) + ", " +
               std::to_string(self.bucket_count()) + " buckets>";
      });
  py::module_::import("collections.abc").attr("Mapping").attr("register")(m.attr("Update"));

  py::class_<PyUpdates>(m, "Updates", "Iterator over whole updates: see Subscriber.updates().")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", &PyUpdates::next);

  py::class_<PySubscriber>(m, "Subscriber",
                           "A consumer of a channel: receives its buckets, or whole updates, verified, as "
                           "zero-copy tensor views. A context manager: leaving it stops receiving.")
      .def(py::init<const std::string&, std::optional<double>, const py::handle&, bool, bool>(), py::arg("channel"),
           py::arg("timeout") = 10.0, py::arg("device") = py::none(), py::arg("follow") = false,
           py::arg("whole_updates") = true,
           "Attach to the channel's live producer, waiting up to timeout for one (a dead producer's "
           "leftovers are removed, never attached to). device: 'cpu' or 'cuda' to refuse a channel "
           "whose payloads live elsewhere (ChannelError); None takes either. follow: after "
           "ProducerGone, go on with the channel's next producer. whole_updates: a subscriber that "
           "attaches in the middle of an update starts at the next one (False: every bucket held).")
      .def("next", &PySubscriber::next, py::arg("timeout") = 10.0, py::arg("expected") = py::none(),
           "The next bucket, verified; None when none arrived within timeout. A CUDA channel's "
           "views are CUDA tensors, ready on torch's current stream. expected: the model's "
           "state_dict; one bucket of a split update must be a part of it.")
      .def("next_update", &PySubscriber::next_update, py::arg("timeout") = 10.0, py::arg("expected") = py::none(),
           "The next whole update (every bucket of one version, leased), verified; None when none "
           "was complete within timeout (the buckets taken so far wait for the next call). Needs "
           "a channel with at least as many slots as an update has buckets.")
      .def("updates", [](py::object self, std::optional<double> timeout, py::object expected) {
             return PyUpdates(std::move(self), timeout, std::move(expected));
           }, py::arg("timeout") = py::none(), py::arg("expected") = py::none(),
           "Iterate over whole updates until the producer is gone (with follow: without end). "
           "Each update is released when the loop asks for the next; Timeout when none came "
           "within timeout (None: no limit).")
      .def_property_readonly("incarnation", &PySubscriber::incarnation,
                             "The incarnation of the producer attached to now.")
      .def_property_readonly("policy", &PySubscriber::policy)
      .def("close", &PySubscriber::close,
           "Stop receiving; a next() waiting in another thread raises Error. The channel is left "
           "once every bucket and view from this subscriber is gone.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PySubscriber& self, py::args) { self.close(); });

  m.def("load_into", &load_into, py::arg("module"), py::arg("tensors"),
        "Copy tensors into module's parameters and buffers, as strictly as load_state_dict. "
        "module may also be its state_dict(keep_vars=True), built once. tensors: a mapping, a "
        "Bucket (one bucket of a split update loads into the part of module it names) or a whole "
        "Update.");
}
