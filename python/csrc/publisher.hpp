// The Python Publisher: a C++ Publisher that keeps the layout of the last publish, so that a
// trainer's every step goes straight to the copy.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "convert.hpp"
#include "tensorbucket/tensorbucket.hpp"
#include "tensorbucket/torch.hpp"
#include "waits.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

// Publisher::create(), waiting for a remover of the name without the GIL (kRemovalWait).
inline Publisher created(const std::string& channel, const PublisherOptions& options) {
  PyWait wait(kRemovalWait);
  return wait.in_seconds(kRemovalWait).run(
      [&](const Deadline& deadline) { return Publisher::create(channel, options, deadline); });
}

class PyPublisher {
 public:
  PyPublisher(const std::string& channel, std::uint32_t slots, std::uint32_t min_consumers,
              std::uint32_t max_consumers, bool checksum, std::uint32_t mode, const py::handle& device,
              const std::string& policy, std::uint32_t update_buckets)
      : publisher_(created(channel, {.slots = slots,
                                     .max_consumers = max_consumers,
                                     .min_consumers = min_consumers,
                                     .mode = mode,
                                     .payload_checksum = checksum,
                                     .location = location_of(device),
                                     .policy = parse_overflow_policy(policy),
                                     .update_buckets = update_buckets})),
        short_commit_(!checksum && publisher_.location().on_host()) {
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
  // goes straight to the copy, checking each tensor against the layout on the way; when one
  // changed, nothing is published and the call, like any other, checks everything and keeps
  // its layout instead.
  void publish(const py::handle& given, std::uint64_t version, std::uint32_t bucket_index,
               std::uint32_t bucket_count, const py::handle& groups,
               std::optional<double> timeout) {
    auto tensors = readable_twice(given);
    PyWait wait(timeout);
    auto turn = take_turn(turn_, wait);
    if (!turn) throw turn_taken();
    auto group_list = to_groups(groups);
    if (kept_ && kept_->groups == group_list) {
      if (publish_small_at_once(tensors, version, bucket_index, bucket_count)) return;
      if (stage_kept(tensors, staged_)) return publish_staged(version, bucket_index, bucket_count, wait);
    }
    staged_.clear();
    {  // the copies of the tensors go before the copy runs without the GIL: staged_ holds them
      Kept fresh;
      auto named = to_named(tensors, &fresh.keys);
      fresh.builder =
          torch_bridge::layout_of(named, version, bucket_index, bucket_count, group_list, publisher_.location());
      fresh.groups = std::move(group_list);
      kept_ = std::move(fresh);
      const auto& entries = kept_->builder.manifest().entries;
      try {
        for (std::size_t i = 0; i < named.size(); ++i) {  // each fits: layout_of() just checked it
          if (!staged_.add(named[i].second, entries[i], publisher_.location())) {
            text::fail(ErrorCode::ManifestMismatch, "the tensor for entry ", text::Quoted{entries[i].name},
                       " does not fit its own layout");
          }
        }
      } catch (...) {
        staged_.clear();  // holds nothing past the call
        throw;
      }
    }
    publish_staged(version, bucket_index, bucket_count, wait);
  }

  // Publishes safetensors files as one update (safetensors::publish_files), without the GIL;
  // Ctrl+C stops it while it waits or between the pieces it reads, leaving the update
  // unfinished. The buckets.
  std::uint32_t publish_file(const std::vector<std::string>& paths, std::optional<std::uint64_t> version,
                             std::uint64_t bucket_bytes, std::optional<double> timeout) {
    PyWait wait(timeout);
    auto turn = take_turn(turn_, wait);
    if (!turn) throw turn_taken();
    stop_if_closing("; nothing was published");
    struct Count {  // published(), however this ends (a file that fails to read after some buckets)
      PyPublisher& self;
      ~Count() { self.published_ = self.publisher_.published(); }
    } count{*this};
    auto result = wait.run(
        [&](const Deadline& deadline) {
          // Each bucket waits for what is left of the timeout.
          return safetensors::publish_files(publisher_, paths,
                                            {.version = version, .bucket_bytes = bucket_bytes,
                                             .timeout = deadline.left(), .interrupted = [&] { return deadline.ask(); }});
        },
        &turn_.closing);
    stop_if_closing("; the update stays unfinished");
    if (result.published < result.buckets) {
      throw no_slot(text::message(" for bucket ", result.published, " of ", result.buckets), "; the update stays unfinished");
    }
    return result.buckets;
  }

  bool drain(std::optional<double> timeout) {
    PyWait wait(timeout);
    auto turn = take_turn(turn_, wait);
    if (!turn) return false;
    stop_if_closing("");
    bool drained = wait.run([&](const Deadline& deadline) { return publisher_.drain(deadline); }, &turn_.closing);
    if (!drained) stop_if_closing("");
    return drained;
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

  WaitTimeout turn_taken() const {
    return {text::message("another thread's call on channel ", text::Quoted{publisher_.channel()},
                          " took the whole timeout; nothing was published")};
  }

  // No slot came free in time: "no slot of channel 'c' came free in time`which`, waiting for
  // ...`outcome`".
  WaitTimeout no_slot(std::string_view which, std::string_view outcome) const {
    auto waited_for = publisher_.waiting_for();
    return {text::message("no slot of channel ", text::Quoted{publisher_.channel()}, " came free in time", which,
                          ", waiting for ", waited_for.empty() ? std::string("a consumer") : waited_for, outcome)};
  }

  // After a publish() or drain() that a close() from another thread ended: see Turns::closing.
  void stop_if_closing(const char* outcome) const {
    if (turn_.closing) {
      text::fail(ErrorCode::InvalidArgument, "channel ", text::Quoted{publisher_.channel()}, " is closed", outcome);
    }
  }

  // Fills `staged` when `tensors` hold tensors that fit the kept layout, under its names, in
  // its order.
  bool stage_kept(const py::handle& tensors, torch_bridge::StagedTensors& staged) {
    staged.clear();
    const auto& entries = kept_->builder.manifest().entries;
    auto where = publisher_.location();
    std::size_t i = 0;
    bool fits = true;
    try {
      for_each_item(tensors, [&](py::handle key, py::handle value) {
        fits = fits && i < entries.size() && names(key, kept_->keys[i], entries[i].name) && is_tensor(value) &&
               staged.add(THPVariable_Unpack(value.ptr()), entries[i], where);
        ++i;
      });
    } catch (...) {
      staged.clear();  // holds nothing past the call
      throw;
    }
    return fits && i == entries.size();
  }

  // A small bucket of host tensors that fit the kept layout, when a slot is free at once:
  // checked and copied without giving up the GIL, so that no other thread can drop or rebind a
  // tensor meanwhile and none needs holding (a quarter of the staging of 1000 small tensors),
  // and the GIL is not handed back and forth. A copy of kHeldBytes takes well under a
  // millisecond, against the interpreter's 5 ms switch interval. In one pass where a misfit
  // found halfway may cost the slot's bucket (write_in_one_pass()), else staged first. False,
  // with nothing published, when any of that is not so: the caller stages and waits as usual.
  static constexpr std::uint64_t kHeldBytes = std::uint64_t{4} << 20;
  bool publish_small_at_once(const py::handle& tensors, std::uint64_t version, std::uint32_t bucket_index,
                             std::uint32_t bucket_count) {
    if (!publisher_.location().on_host() || kept_->builder.payload_bytes() > kHeldBytes || turn_.closing) {
      return false;
    }
    kept_->builder.version(version).bucket(bucket_index, bucket_count);
    if (auto written = write_in_one_pass(tensors)) {
      if (*written) published_ = publisher_.published();
      return *written;
    }
    // Staged by their bytes alone, held by nothing but the caller's container: only one whose
    // walk runs no Python code. Another mapping's items() may make each tensor as it goes (a
    // lazy state dict) and drop it before the copy.
    if (!is_plain_container(tensors)) return false;
    struct Unstage {
      torch_bridge::StagedTensors& staged;
      ~Unstage() { staged.clear(); }
    } unstage{borrowed_};
    if (!stage_kept(tensors, borrowed_)) return false;
    auto at_once = Deadline::after(Clock::duration::zero()).unless([] { return PyErr_CheckSignals() != 0; });
    if (!torch_bridge::publish_in_place(publisher_, kept_->builder, borrowed_, at_once)) {
      if (PyErr_Occurred() != nullptr) throw py::error_already_set();  // a signal's handler raised
      return false;
    }
    published_ = publisher_.published();
    return true;
  }

  // Reserves a slot, then checks and copies each tensor as the walk reaches it, so that each
  // copy's stores drain while the next tensors are checked (1000 x 1 KiB: ~0.85x the time of
  // staging all, then copying). A tensor that no longer fits drops the reservation, which
  // leaves the slot empty: so only a slot whose bucket is neither of the newest update nor of
  // the one under way, and that every consumer is done with, is taken
  // (Claim::SparingNewest). Only for a dict, list or tuple, whose walk calls no Python code
  // (another mapping's items() would, with the slot claimed); a subclass's copy_ may, as it
  // may in the staged path. True when published; false, nothing published, when a tensor no
  // longer fits; none when no such slot is free at once or `tensors` is of another type.
  std::optional<bool> write_in_one_pass(const py::handle& tensors) {
    if (!is_plain_container(tensors)) return std::nullopt;
    auto reservation = publisher_.reserve(kept_->builder, Deadline::after(Clock::duration::zero()), nullptr,
                                          Publisher::Claim::SparingNewest);
    if (!reservation) return std::nullopt;
    const auto& entries = kept_->builder.manifest().entries;
    std::size_t i = 0;
    bool fits = true;
    for_each_item(tensors, [&](py::handle key, py::handle value) {
      fits = fits && i < entries.size() && names(key, kept_->keys[i], entries[i].name) && is_tensor(value) &&
             torch_bridge::write_tensor(*reservation, i, THPVariable_Unpack(value.ptr()), entries[i]);
      ++i;
    });
    if (!fits || i != entries.size()) return false;
    // A signal's handler that raised (Ctrl+C) during the copy: nothing published.
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    reservation->commit(Reservation::HandoverFrom::Reserve);
    return true;
  }

  // Publishes staged_ through the kept layout, without the GIL; staged_ is emptied either way.
  void publish_staged(std::uint64_t version, std::uint32_t bucket_index,
                      std::uint32_t bucket_count, PyWait& wait) {
    struct Unstage {
      torch_bridge::StagedTensors& staged;
      ~Unstage() { staged.clear(); }  // with the GIL (see clear())
    } unstage{staged_};
    kept_->builder.version(version).bucket(bucket_index, bucket_count);
    auto stream = current_stream(publisher_.location());
    stop_if_closing("; nothing was published");
    bool published = false;
    if (short_commit_) {
      auto written = wait.run(
          [&](const Deadline& deadline) {
            return torch_bridge::write_in_place(publisher_, kept_->builder, staged_, deadline, stream);
          },
          &turn_.closing);
      if (written) {
        // Asked and committed holding the GIL, which a Python thread of this process needs to
        // send a signal: one that its handler raised (Ctrl+C) came during the copy, and nothing
        // is published, or comes after this call. Without the GIL, one sent during the commit
        // would be raised as the call returns, the bucket published. A signal from outside may
        // still come in the microseconds left, as for any call; `published` tells.
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
        stop_if_closing("; nothing was published");
        written->commit(Reservation::HandoverFrom::Reserve);
        published = true;
      }
    } else {
      // A commit that hashes the payload or waits on a device stream takes its time: not with
      // the GIL. Its last look for a signal is just before it (publish_in_place).
      published = wait.run(
          [&](const Deadline& deadline) {
            return torch_bridge::publish_in_place(publisher_, kept_->builder, staged_, deadline, stream);
          },
          &turn_.closing);
    }
    if (!published) {
      stop_if_closing("; nothing was published");
      throw no_slot("", "; nothing was published");
    }
    published_ = publisher_.published();
  }

  Turns turn_;
  std::atomic<std::uint64_t> published_ = 0;  // publisher_.published(), after each publish
  Publisher publisher_;
  bool short_commit_;  // a commit of a few stores (no payload hash, no device): made with the GIL
  std::optional<Kept> kept_;
  torch_bridge::StagedTensors staged_;  // this call's tensors in layout order; reused for capacity
  torch_bridge::StagedTensors borrowed_{torch_bridge::StagedTensors::Hold::Nothing};  // the same, held by the GIL
};

}  // namespace tensorbucket::python
