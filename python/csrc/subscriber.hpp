// The Python Subscriber: attaches, waits without the GIL, and hands out Buckets and Updates.
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
    auto bucket = receive(timeout, expected, [&](const Deadline& deadline, const auto& options, auto stream) {
      return subscriber_->next(deadline, options, stream);
    });
    if (!bucket) return std::nullopt;
    return PyBucket(std::move(*bucket), names_);
  }

  std::optional<PyUpdate> next_update(std::optional<double> timeout, const py::handle& expected) {
    auto update = receive(timeout, expected, [&](const Deadline& deadline, const auto& options, auto stream) {
      return subscriber_->next_update(deadline, options, stream);
    });
    if (!update) return std::nullopt;
    return PyUpdate(std::move(*update), names_);
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

  // Waits, in turn, for what `take(deadline, options, stream)` returns.
  template <class Take>
  auto receive(std::optional<double> timeout, const py::handle& expected, Take&& take)
      -> decltype(take(std::declval<const Deadline&>(), VerifyOptions{}, CudaStream{})) {
    PyWait wait(timeout);
    std::optional<Manifest> expected_manifest;
    if (!expected.is_none()) expected_manifest = to_manifest(expected);
    VerifyOptions options{.expected = expected_manifest ? &*expected_manifest : nullptr};
    auto turn = take_turn(turn_, wait);
    if (!turn) return std::nullopt;
    auto stream = current_stream(live().location());
    if (turn_.closing) closed();
    auto taken = wait.run([&](const Deadline& deadline) { return take(deadline, options, stream); }, &turn_.closing);
    if (!taken && turn_.closing) closed();
    return taken;
  }

  static std::optional<PayloadLocation::Kind> expected_kind(const py::handle& device) {
    if (device.is_none()) return std::nullopt;
    return location_of(device).kind;
  }

  static Subscriber attach(const std::string& channel, std::optional<double> timeout, const SubscribeOptions& options) {
    PyWait wait(timeout);
    return wait.in_seconds(timeout).run(
        [&](const Deadline& deadline) { return Subscriber::attach(channel, deadline, options); });
  }

  Turns turn_;
  std::string channel_;
  std::optional<Subscriber> subscriber_;  // none once closed
  std::shared_ptr<EntryNames> names_ = std::make_shared<EntryNames>();
};

}  // namespace tensorbucket::python
