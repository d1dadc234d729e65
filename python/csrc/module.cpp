// tensorbucket._C: the pybind11 bindings under the `tensorbucket` package, which documents,
// types and checks the arguments of everything here (tensorbucket/__init__.py). Waiting and
// copying run without the GIL.
//
// One translation unit, its parts in headers by job: parsing torch's headers takes most of a
// minute, once per .cpp file.
#include <torch/extension.h>

#include <pthread.h>

#include <vector>

#include "errors.hpp"
#include "files.hpp"
#include "load.hpp"
#include "publisher.hpp"
#include "received.hpp"
#ifdef TENSORBUCKET_NET
#include "relay.hpp"
#include "server.hpp"
#endif
#include "subscriber.hpp"
#include "waits.hpp"

namespace py = pybind11;
using namespace tensorbucket::python;

PYBIND11_MODULE(_C, m) {
  // torch's Python types (torch.Tensor) are set up by importing torch: without it, a server
  // that imported only tensorbucket crashed on its first view.
  py::module_::import("torch");

  m.attr("__version__") = TENSORBUCKET_VERSION;
  m.doc() = "The bindings under tensorbucket; use the package, which documents and checks them.";
  register_errors(m);

  // At exit: park the threads waiting in this module (OutsideGil), then close every open
  // Publisher, which Python would not destroy while a daemon thread still reaches it.
  ::pthread_atfork(nullptr, nullptr, &after_fork_in_child);
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    OutsideGil::park_all();
    for (auto* publisher : std::vector<PyPublisher*>(PyPublisher::open().begin(), PyPublisher::open().end())) {
      publisher->close_at_exit();
    }
  }));

  py::class_<PyPublisher>(m, "Publisher")
      .def(py::init<const std::string&, std::uint32_t, std::uint32_t, std::uint32_t, bool, std::uint32_t,
                    const py::handle&, const std::string&, std::uint32_t>(),
           py::arg("channel"), py::arg("slots"), py::arg("min_consumers"), py::arg("max_consumers"),
           py::arg("checksum"), py::arg("mode"), py::arg("device"), py::arg("policy"), py::arg("update_buckets"))
      .def("publish", &PyPublisher::publish, py::arg("tensors"), py::arg("version"), py::arg("bucket_index"),
           py::arg("bucket_count"), py::arg("groups"), py::arg("timeout"))
      .def("publish_file", &PyPublisher::publish_file, py::arg("paths"), py::arg("version"), py::arg("bucket_bytes"),
           py::arg("timeout"))
      .def("drain", &PyPublisher::drain, py::arg("timeout"))
      .def("close", &PyPublisher::close)
      .def_property_readonly("published", &PyPublisher::published)
      .def_property_readonly("incarnation", &PyPublisher::incarnation)
      .def_property_readonly("policy", &PyPublisher::policy);

  py::class_<PyBucket>(m, "Bucket")
      .def("__len__", &PyBucket::size)
      .def("__contains__", &PyBucket::contains)
      .def("__getitem__", &PyBucket::get_item)
      .def("keys", &PyBucket::keys)
      .def("tensors", &PyBucket::tensors)
      .def_property_readonly("version", &PyBucket::version)
      .def_property_readonly("bucket_index", &PyBucket::bucket_index)
      .def_property_readonly("bucket_count", &PyBucket::bucket_count)
      .def_property_readonly("sequence", &PyBucket::sequence)
      .def_property_readonly("incarnation", &PyBucket::incarnation)
      .def_property_readonly("publish_start_ns", &PyBucket::publish_start_ns)
      .def_property_readonly("published_ns", &PyBucket::published_ns)
      .def_property_readonly("received_ns", &PyBucket::received_ns)
      .def_property_readonly("released", &PyBucket::released)
      .def("release", &PyBucket::release);

  py::class_<PyUpdate>(m, "Update")
      .def("__len__", &PyUpdate::size)
      .def("__contains__", &PyUpdate::contains)
      .def("__getitem__", &PyUpdate::get_item)
      .def("keys", &PyUpdate::keys)
      .def("tensors", &PyUpdate::tensors)
      .def_property_readonly("buckets", &PyUpdate::buckets)
      .def_property_readonly("version", &PyUpdate::version)
      .def_property_readonly("incarnation", &PyUpdate::incarnation)
      .def_property_readonly("sequence", &PyUpdate::sequence)
      .def_property_readonly("publish_start_ns", &PyUpdate::publish_start_ns)
      .def_property_readonly("published_ns", &PyUpdate::published_ns)
      .def_property_readonly("received_ns", &PyUpdate::received_ns)
      .def_property_readonly("released", &PyUpdate::released)
      .def("release", &PyUpdate::release);

  py::class_<PySubscriber>(m, "Subscriber")
      .def(py::init<const std::string&, std::optional<double>, const py::handle&, bool, bool>(), py::arg("channel"),
           py::arg("timeout"), py::arg("device"), py::arg("follow"), py::arg("whole_updates"))
      .def("next", &PySubscriber::next, py::arg("timeout"), py::arg("expected"))
      .def("next_update", &PySubscriber::next_update, py::arg("timeout"), py::arg("expected"))
      .def_property_readonly("incarnation", &PySubscriber::incarnation)
      .def_property_readonly("policy", &PySubscriber::policy)
      .def("close", &PySubscriber::close);

  m.def("load_into", &load_into, py::arg("module"), py::arg("tensors"));
  m.def("save", &save, py::arg("received"), py::arg("path"));

#ifdef TENSORBUCKET_NET  // built where UCX is found
  py::class_<PyServer>(m, "Server")
      .def(py::init<const std::string&, const std::string&, const std::string&, double, std::uint32_t, std::uint32_t,
                    std::optional<double>>(),
           py::arg("channel"), py::arg("listen"), py::arg("token_file"), py::arg("peer_timeout"), py::arg("max_peers"),
           py::arg("window"), py::arg("timeout"))
      .def("serve", &PyServer::serve, py::arg("duration"))
      .def("close", &PyServer::close)
      .def_property_readonly("address", &PyServer::address)
      .def_property_readonly("peers", &PyServer::peers)
      .def_property_readonly("buckets_served", &PyServer::buckets_served);
  py::class_<PyRelay>(m, "Relay")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&, std::uint32_t,
                    std::uint32_t, std::uint32_t, const std::string&, std::uint32_t, std::optional<double>, double,
                    std::uint64_t>(),
           py::arg("connect"), py::arg("channel"), py::arg("token_file"), py::arg("local"), py::arg("slots"),
           py::arg("min_consumers"), py::arg("max_consumers"), py::arg("policy"), py::arg("update_buckets"),
           py::arg("timeout"), py::arg("idle_timeout"), py::arg("max_bucket_bytes"))
      .def("relay", &PyRelay::relay, py::arg("duration"), py::arg("buckets"))
      .def("drain", &PyRelay::drain, py::arg("timeout"))
      .def("close", &PyRelay::close)
      .def_property_readonly("local_channel", &PyRelay::local_channel)
      .def_property_readonly("buckets_relayed", &PyRelay::buckets_relayed);
#endif
}
