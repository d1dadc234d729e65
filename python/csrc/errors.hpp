// tensorbucket's exceptions in Python: one class per family of ErrorCode, all under
// tensorbucket.Error, each instance with the code's name (`code`) and the full list of
// problems where the message names only the first few (`details`).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <string>
#include <string_view>

#include "tensorbucket/error.hpp"
#include "waits.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

// Sets an instance of `type` as the pending Python error. The message names the code first
// only where the class does not already say it (ManifestError: "Overlap: ...", not
// "ProducerGone: ProducerGone: ...").
inline void raise_as(const py::exception<Error>& type, std::string_view code, const std::string& message,
                     const std::string& details = {}) {
  auto name = type.attr("__name__").cast<std::string>();
  auto shown = name == code ? message : text::message(code, ": ", message);
  // Names are bytes: one that is not UTF-8 (a file's, a C++ producer's) shows escaped, where
  // a strict decode would raise UnicodeDecodeError instead of this error.
  auto as_str = [](const std::string& bytes) {
    return py::reinterpret_steal<py::str>(
        PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "backslashreplace"));
  };
  auto instance = py::reinterpret_borrow<py::object>(type)(as_str(shown));
  instance.attr("code") = py::str(code.data(), code.size());
  instance.attr("details") = as_str(details);
  PyErr_SetObject(type.ptr(), instance.ptr());
}

// Adds the classes to `m`, and translates every Error (and WaitTimeout) into one of them.
inline void register_errors(py::module_& m) {
  // Those a Python user would catch as a builtin are that builtin too.
  static py::exception<Error> error(m, "Error");
  static py::exception<Error> manifest_error(m, "ManifestError", error.ptr());
  static py::exception<Error> checksum_mismatch(m, "ChecksumMismatch", error.ptr());
  static py::exception<Error> timeout(m, "Timeout", py::make_tuple(error, py::handle(PyExc_TimeoutError)));
  static py::exception<Error> producer_gone(m, "ProducerGone", error.ptr());
  static py::exception<Error> channel_error(m, "ChannelError", error.ptr());
  static py::exception<Error> device_error(m, "DeviceError", error.ptr());
  static py::exception<Error> invalid_argument(m, "InvalidArgument", py::make_tuple(error, py::handle(PyExc_ValueError)));
  static py::exception<Error> network_error(m, "NetworkError", py::make_tuple(error, py::handle(PyExc_ConnectionError)));
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const WaitTimeout& e) {
      raise_as(timeout, "Timeout", e.message);
    } catch (const Error& e) {
      auto code = to_string(e.code());
      auto raise = [&](const py::exception<Error>& type) { raise_as(type, code, e.what(), e.details()); };
      switch (family_of(e.code())) {
        case ErrorFamily::Usage: raise(invalid_argument); return;
        case ErrorFamily::Verification:
          raise(e.code() == ErrorCode::ChecksumMismatch ? checksum_mismatch : manifest_error);
          return;
        case ErrorFamily::ProducerGone: raise(producer_gone); return;
        case ErrorFamily::Channel: raise(channel_error); return;
        case ErrorFamily::Device: raise(device_error); return;
        case ErrorFamily::Network: raise(network_error); return;
        case ErrorFamily::System: raise(error); return;
      }
    }
  });
}

}  // namespace tensorbucket::python
