// The Python Subscriber: attaches, waits in slices without the GIL, and hands out Buckets and
// Updates.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>

#include "convert.hpp"
#include "received.hpp"
#include "tensorbucket/tensorbucket.hpp"
#include "waits.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

class PySubscriber {
 public:
  PySubscriber(const std::string& channel, std::optional<double> timeout, const py::handle& device, bool follow,
               bool whole_updates)
      : channel_(channel),
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
    if (!subscriber_) closed();
    return *subscriber_;
  }
  [[noreturn]] void closed() const {
    text::fail(ErrorCode::InvalidArgument, "subscriber of channel ", text::Quoted{channel_}, " is closed");
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
      if (turn_.closing) closed();
      return take(slice, options, stream);
    });
  }

  static std::optional<PayloadLocation::Kind> expected_kind(const py::handle& device) {
    if (device.is_none()) return std::nullopt;
    return location_of(device).kind;
  }

  static Subscriber attach(const std::string& channel, std::optional<double> timeout, const SubscribeOptions& options) {
    return when_produced(channel, timeout, [&](auto slice) { return Subscriber::attach(channel, slice, options); });
  }

  Turns turn_;
  std::string channel_;
  std::optional<Subscriber> subscriber_;  // none once closed
};

}  // namespace tensorbucket::python
