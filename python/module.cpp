// The `tensorbucket` Python module: thin pybind11 wrappers over the C++ channel and the
// LibTorch bridge. Waiting and copying run without the GIL.
#include <torch/extension.h>

#include <chrono>
#include <memory>
#include <optional>

#include "tensorbucket/tensorbucket.hpp"
#include "tensorbucket/torch.hpp"

namespace py = pybind11;
using namespace tensorbucket;
using torch_bridge::NamedTensors;

namespace {

// Raised by publish() when no slot came free; becomes tensorbucket.Timeout.
struct PublishTimeout {};

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

// A dict {name: tensor} or an iterable of (name, tensor) pairs, in its order.
NamedTensors to_named(const py::handle& tensors) {
  NamedTensors out;
  py::iterable items = py::isinstance<py::dict>(tensors)
                           ? py::iterable(tensors.attr("items")())
                           : py::reinterpret_borrow<py::iterable>(tensors);
  for (auto item : items) {
    auto pair = item.cast<py::tuple>();
    if (pair.size() != 2) throw Error(ErrorCode::InvalidArgument, "expected (name, tensor) pairs");
    out.emplace_back(pair[0].cast<std::string>(), pair[1].cast<at::Tensor>());
  }
  return out;
}

Manifest to_manifest(const py::handle& tensors) {
  Manifest manifest;
  for (const auto& [name, tensor] : to_named(tensors)) {
    auto sizes = tensor.sizes();
    manifest.entries.push_back({name, torch_bridge::dtype_of(tensor.scalar_type(), name),
                                Shape(std::span<const std::int64_t>(sizes.data(), sizes.size())),
                                0, 0, ""});
  }
  return manifest;
}

// {group: [member, ...]} or None.
std::vector<ManifestGroup> to_groups(const py::handle& groups) {
  std::vector<ManifestGroup> out;
  if (groups.is_none()) return out;
  for (auto item : groups.cast<py::dict>()) {
    out.push_back({item.first.cast<std::string>(), item.second.cast<std::vector<std::string>>()});
  }
  return out;
}

class PyPublisher {
 public:
  PyPublisher(const std::string& channel, std::uint32_t slots, std::uint32_t min_consumers,
              std::uint32_t max_consumers, bool checksum, std::uint32_t mode)
      : publisher_(Publisher::create(channel, {.slots = slots,
                                               .max_consumers = max_consumers,
                                               .min_consumers = min_consumers,
                                               .mode = mode,
                                               .payload_checksum = checksum})) {}

  void publish(const py::handle& tensors, std::uint64_t version, std::uint32_t bucket_index,
               std::uint32_t bucket_count, const py::handle& groups, double timeout, bool in_place) {
    auto named = to_named(tensors);
    auto group_list = to_groups(groups);
    bool published;
    if (in_place) {
      py::gil_scoped_release unlocked;
      published = torch_bridge::publish_in_place(publisher_, named, to_ms(timeout), version,
                                                 bucket_index, bucket_count, group_list);
    } else {
      auto bucket = torch_bridge::make_bucket(named, version, bucket_index, bucket_count, group_list);
      py::gil_scoped_release unlocked;
      published = publisher_.publish(bucket.builder, to_ms(timeout));
    }
    if (!published) throw PublishTimeout{};
  }

  bool drain(double timeout) {
    py::gil_scoped_release unlocked;
    return publisher_.drain(to_ms(timeout));
  }
  void close() { publisher_.close(); }
  std::uint64_t published() const { return publisher_.published(); }

 private:
  Publisher publisher_;
};

class PyBucket {
 public:
  explicit PyBucket(ReceivedBucket bucket)
      : version_(bucket.view().version()),
        bucket_index_(bucket.view().bucket_index()),
        bucket_count_(bucket.view().bucket_count()),
        sequence_(bucket.sequence()),
        bucket_(std::make_shared<const ReceivedBucket>(std::move(bucket))) {}

  py::dict tensors() const {
    py::dict out;
    for (auto& [name, tensor] : torch_bridge::tensors(live())) out[py::str(name)] = tensor;
    return out;
  }
  // Kept by value, so they stay readable after release().
  std::uint64_t version() const { return version_; }
  std::uint32_t bucket_index() const { return bucket_index_; }
  std::uint32_t bucket_count() const { return bucket_count_; }
  std::uint64_t sequence() const { return sequence_; }
  // Drops this handle's hold; tensors already taken keep the lease until they die.
  void release() { bucket_.reset(); }

 private:
  const std::shared_ptr<const ReceivedBucket>& live() const {
    if (!bucket_) throw Error(ErrorCode::InvalidArgument, "bucket was released");
    return bucket_;
  }
  std::uint64_t version_;
  std::uint32_t bucket_index_;
  std::uint32_t bucket_count_;
  std::uint64_t sequence_;
  std::shared_ptr<const ReceivedBucket> bucket_;
};

class PySubscriber {
 public:
  PySubscriber(const std::string& channel, double timeout)
      : subscriber_([&] {
          py::gil_scoped_release unlocked;
          return Subscriber::attach(channel, to_ms(timeout));
        }()) {}

  std::optional<PyBucket> next(double timeout, const py::handle& expected) {
    std::optional<Manifest> expected_manifest;
    if (!expected.is_none()) expected_manifest = to_manifest(expected);
    std::optional<ReceivedBucket> bucket;
    {
      py::gil_scoped_release unlocked;
      bucket = subscriber_.next(to_ms(timeout),
                                {.expected = expected_manifest ? &*expected_manifest : nullptr});
    }
    if (!bucket) return std::nullopt;
    return PyBucket(std::move(*bucket));
  }

 private:
  Subscriber subscriber_;
};

// Strict load_state_dict: every problem in one error, nothing copied when any.
void load_into(const py::object& module, const py::handle& tensors) {
  auto state = module.attr("state_dict")();
  auto received = to_manifest(tensors);
  check_expected(received, to_manifest(state));
  auto named = to_named(tensors);
  auto targets = state.cast<py::dict>();
  at::NoGradGuard no_grad;
  for (const auto& [name, tensor] : named) targets[py::str(name)].cast<at::Tensor>().copy_(tensor);
}

}  // namespace

PYBIND11_MODULE(tensorbucket, m) {
  m.doc() = "Move named torch tensors between processes as verified zero-copy buckets.";

  // One Python class per error family, all under tensorbucket.Error.
  static py::exception<Error> error(m, "Error");
  static py::exception<Error> manifest_error(m, "ManifestError", error.ptr());
  static py::exception<Error> checksum_mismatch(m, "ChecksumMismatch", error.ptr());
  static py::exception<Error> timeout(m, "Timeout", error.ptr());
  static py::exception<Error> producer_gone(m, "ProducerGone", error.ptr());
  static py::exception<Error> channel_error(m, "ChannelError", error.ptr());
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const PublishTimeout&) {
      timeout("Timeout: no slot came free in time; nothing was published");
    } catch (const Error& e) {
      auto message = std::string(to_string(e.code())) + ": " + e.what();
      switch (e.code()) {
        case ErrorCode::ChecksumMismatch: checksum_mismatch(message.c_str()); return;
        case ErrorCode::ProducerGone: producer_gone(message.c_str()); return;
        case ErrorCode::ChannelExists:
        case ErrorCode::ChannelMissing:
        case ErrorCode::PermissionDenied:
        case ErrorCode::ChannelFull: channel_error(message.c_str()); return;
        case ErrorCode::InvalidArgument:
        case ErrorCode::SystemError: error(message.c_str()); return;
        default: manifest_error(message.c_str()); return;
      }
    }
  });

  py::class_<PyPublisher>(m, "Publisher")
      .def(py::init<const std::string&, std::uint32_t, std::uint32_t, std::uint32_t, bool, std::uint32_t>(),
           py::arg("channel"), py::arg("slots") = 2, py::arg("min_consumers") = 1,
           py::arg("max_consumers") = 8, py::arg("checksum") = false, py::arg("mode") = 0600)
      .def("publish", &PyPublisher::publish, py::arg("tensors"), py::arg("version") = 0,
           py::arg("bucket_index") = 0, py::arg("bucket_count") = 1, py::arg("groups") = py::none(),
           py::arg("timeout") = 10.0, py::arg("in_place") = false,
           "Publish a dict or list of (name, tensor); raises Timeout when no slot comes free.")
      .def("drain", &PyPublisher::drain, py::arg("timeout") = 10.0,
           "Wait until consumers released everything; False on timeout.")
      .def("close", &PyPublisher::close)
      .def_property_readonly("published", &PyPublisher::published)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyPublisher& self, py::args) { self.close(); });

  py::class_<PyBucket>(m, "Bucket")
      .def("tensors", &PyBucket::tensors, "Zero-copy, read-only views {name: tensor}.")
      .def_property_readonly("version", &PyBucket::version)
      .def_property_readonly("bucket_index", &PyBucket::bucket_index)
      .def_property_readonly("bucket_count", &PyBucket::bucket_count)
      .def_property_readonly("sequence", &PyBucket::sequence)
      .def("release", &PyBucket::release)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyBucket& self, py::args) { self.release(); });

  py::class_<PySubscriber>(m, "Subscriber")
      .def(py::init<const std::string&, double>(), py::arg("channel"), py::arg("timeout") = 10.0)
      .def("next", &PySubscriber::next, py::arg("timeout") = 10.0, py::arg("expected") = py::none(),
           "The next bucket, verified; None when none arrived within timeout.");

  m.def("load_into", &load_into, py::arg("module"), py::arg("tensors"),
        "Copy tensors into module's parameters and buffers, as strictly as load_state_dict.");
}
