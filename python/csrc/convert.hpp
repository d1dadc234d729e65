// From Python objects to what the C++ API takes: named tensors, groups, devices, streams. Each
// refusal is an InvalidArgument that names the entry and the type it got.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/text.hpp"
#include "tensorbucket/tensorbucket.hpp"
#include "tensorbucket/torch.hpp"

namespace tensorbucket::python {

namespace py = pybind11;
using torch_bridge::NamedTensors;

// The name of a Python object's type, for error messages: "int", "list".
inline std::string type_name(PyObject* value) { return Py_TYPE(value)->tp_name; }
inline std::string type_name(const py::handle& value) { return type_name(value.ptr()); }

// Whether a Python object is a torch.Tensor: its type is Tensor's or a subtype's, which is what
// THPVariable_Unpack() reads it as. Not THPVariable_Check(): that is an isinstance(), which asks
// the object's __class__, so runs Python code and takes a mock with spec=torch.Tensor for a
// tensor (read as one, it crashed the process); it was also ~30 ns for any type but Tensor.
inline bool is_tensor(const py::handle& value) {
  return THPVariable_CheckExact(value.ptr()) ||
         (THPVariableClass != nullptr && PyObject_TypeCheck(value.ptr(), reinterpret_cast<PyTypeObject*>(THPVariableClass)));
}

// A dict, list or tuple: what for_each_item() walks without calling any Python code.
inline bool is_plain_container(const py::handle& tensors) {
  auto* all = tensors.ptr();
  return PyDict_Check(all) || PyList_Check(all) || PyTuple_Check(all);
}

// Calls visit(name, tensor) for a (name, tensor) pair: a tuple or a list of two.
template <class Visit>
void visit_pair(PyObject* pair, Visit& visit) {
  if (!(PyTuple_Check(pair) || PyList_Check(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) {
    text::fail(ErrorCode::InvalidArgument, "expected (name, tensor) pairs, not an item of type ", type_name(pair));
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
    const char* hint = py::hasattr(tensors, "state_dict")
                           ? "; for a module, pass module.state_dict(keep_vars=True), built once"
                           : "";
    text::fail(ErrorCode::InvalidArgument, "tensors must be a dict {name: tensor} or a list of (name, tensor) pairs, not ",
               type_name(tensors), hint);
  }
  for (auto item : py::reinterpret_borrow<py::iterable>(tensors)) visit_pair(item.ptr(), visit);
}

// `tensors` as something for_each_item() can read more than once: a one-shot iterable (a
// generator of pairs) read into a list, anything else as it is (what for_each_item() refuses
// is left for it to refuse). A publish may read the items twice: once to check them against
// the kept layout, again to lay them out afresh or to stage them for a wait.
inline py::object readable_twice(const py::handle& tensors) {
  PyObject* all = tensors.ptr();
  bool again = PyDict_Check(all) || PyList_Check(all) || PyTuple_Check(all) || py::hasattr(tensors, "items") ||
               is_tensor(tensors) || PyUnicode_Check(all) || !py::isinstance<py::iterable>(tensors);
  if (again) return py::reinterpret_borrow<py::object>(tensors);
  return py::list(py::reinterpret_borrow<py::object>(tensors));
}

// The tensor a Python object holds; InvalidArgument naming the entry otherwise.
inline const at::Tensor& tensor_of(const py::handle& value, const std::string& name) {
  if (!is_tensor(value)) {
    text::fail(ErrorCode::InvalidArgument, "entry ", text::Quoted{name}, " is of type ", type_name(value),
               ", not torch.Tensor");
  }
  return THPVariable_Unpack(value.ptr());
}

// A str's UTF-8 form, kept by the str; none for anything else, or a str without one (a lone
// surrogate).
inline std::optional<std::string_view> utf8_of(const py::handle& text) {
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
inline std::string name_of(const py::handle& name, const char* what = "tensor names") {
  if (!PyUnicode_Check(name.ptr())) {
    text::fail(ErrorCode::InvalidArgument, what, " must be str, not ", type_name(name));
  }
  auto utf8 = utf8_of(name);
  if (!utf8) {
    text::fail(ErrorCode::InvalidArgument, "name ", std::string(py::repr(name)), " has no UTF-8 form");
  }
  return std::string(*utf8);
}

inline NamedTensors to_named(const py::handle& tensors, std::vector<py::object>* keys = nullptr) {
  NamedTensors out;
  for_each_item(tensors, [&](py::handle key, py::handle value) {
    auto name = name_of(key);
    const auto& tensor = tensor_of(value, name);
    out.emplace_back(std::move(name), tensor);
    if (keys != nullptr) keys->push_back(py::reinterpret_borrow<py::object>(key));
  });
  return out;
}

inline Manifest to_manifest(const py::handle& tensors) { return torch_bridge::manifest_of(to_named(tensors)); }

// {group: [member, ...]} or None.
inline std::vector<ManifestGroup> to_groups(const py::handle& groups) {
  std::vector<ManifestGroup> out;
  if (groups.is_none()) return out;
  if (!PyDict_Check(groups.ptr())) {
    text::fail(ErrorCode::InvalidArgument, "groups must be a dict {group: [member, ...]}, not ", type_name(groups));
  }
  for (auto [group, members] : groups.cast<py::dict>()) {
    auto& added = out.emplace_back(ManifestGroup{name_of(group, "group names"), {}});
    if (!PyList_Check(members.ptr()) && !PyTuple_Check(members.ptr())) {  // a str would iterate
      text::fail(ErrorCode::InvalidArgument, "group ", text::Quoted{added.name},
                 ": members must be a list or tuple of names, not ", type_name(members));
    }
    for (auto member : members) added.members.push_back(name_of(member, "group members"));
  }
  return out;
}

// Whether `key` names `name`: the same str object (a state_dict's keys usually are), or an
// equal one.
inline bool names(const py::handle& key, const py::object& kept_key, const std::string& name) {
  if (key.ptr() == kept_key.ptr()) return true;
  auto utf8 = utf8_of(key);  // none: not equal either, and the slow path will say why
  return utf8 && *utf8 == name;
}

// Where a channel's payloads live, from a Python device: None, "cpu", "cuda", "cuda:N" or a
// torch.device ("cuda" alone is device 0).
inline PayloadLocation location_of(const py::handle& device) {
  if (device.is_none()) return PayloadLocation::host();
  return PayloadLocation::parse(py::str(device).cast<std::string>());
}

// torch's current stream on `where`'s device (null on the host): what device work is ordered
// with, as torch's own operations are. Asked with the GIL.
inline CudaStream current_stream(PayloadLocation where) {
  if (where.on_host()) return nullptr;
  auto stream = py::module_::import("torch").attr("cuda").attr("current_stream")(where.device);
  return reinterpret_cast<CudaStream>(stream.attr("cuda_stream").cast<std::uintptr_t>());
}

}  // namespace tensorbucket::python
