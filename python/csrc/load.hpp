// load_into(): a strict load_state_dict from a mapping, a Bucket or a whole Update.
#pragma once

#include <torch/extension.h>

#include "convert.hpp"
#include "received.hpp"
#include "tensorbucket/torch.hpp"
#include "waits.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

// Strict load_state_dict: every problem in one error, nothing copied when any.
// Into a module, or into its tensors as a mapping: state_dict() of 1000 tensors costs more
// than loading them, and a server that built it once saves that on every step.
inline void load_into(const py::object& module, const py::handle& tensors) {
  // keep_vars: the parameters themselves, without the detach() per entry that is about half
  // of what a state_dict() costs
  bool is_module = py::hasattr(module, "state_dict");
  if (!is_module && !py::hasattr(module, "items")) {
    text::fail(ErrorCode::InvalidArgument, "module must be a torch.nn.Module or its state_dict(keep_vars=True), not ",
               type_name(module));
  }
  auto targets = to_named(is_module ? module.attr("state_dict")(py::arg("keep_vars") = true) : module);
  py::object rest;  // the views of an update whose buckets were not all kept
  if (py::isinstance<PyUpdate>(tensors)) {
    const auto& handle = tensors.cast<const PyUpdate&>();
    if (handle.whole()) {  // each bucket straight from its bytes
      // Held: another thread may release() the handle while this copies without the GIL.
      auto update = handle.held();
      auto stream = current_stream(update->buckets().front().view().location());
      OutsideGil::run([&] { torch_bridge::load_into(targets, *update, stream); });
      return;
    }
    rest = handle.tensors();  // a bucket released on its own took its names out
  }
  if (py::isinstance<PyBucket>(tensors)) {  // straight from its bytes: no view of each entry
    auto bucket = tensors.cast<const PyBucket&>().received();
    auto stream = current_stream(bucket->view().location());
    OutsideGil::run([&] { torch_bridge::load_into(targets, bucket->view(), stream); });
    return;
  }
  auto sources = to_named(rest ? rest : tensors);
  OutsideGil::run([&] { torch_bridge::load_into(targets, sources); });
}

}  // namespace tensorbucket::python
