// tensorbucket.save(): a received Bucket or Update written as a safetensors file.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

#include "received.hpp"
#include "tensorbucket/tensorbucket.hpp"
#include "waits.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

// Writes without the GIL, holding what it writes (another thread may release() the handle
// meanwhile); a device bucket's bytes are copied to the host first.
inline void save(const py::handle& received, const std::string& path) {
  std::shared_ptr<const void> hold;
  std::vector<const ReceivedBucket*> buckets;
  if (py::isinstance<PyBucket>(received)) {
    auto bucket = received.cast<const PyBucket&>().received();
    buckets.push_back(bucket.get());
    hold = std::move(bucket);
  } else if (py::isinstance<PyUpdate>(received)) {
    const auto& handle = received.cast<const PyUpdate&>();
    auto update = handle.held();
    // A file says it holds a whole update (tensorbucket.bucket_count): not one short of a
    // bucket released on its own.
    auto kept = handle.kept();
    for (std::size_t k = 0; k < kept.size(); ++k) {
      if (!kept[k]) {
        text::fail(ErrorCode::InvalidArgument, "bucket ", k, " of this update was released: save() writes a whole "
                   "update, or one bucket (save each bucket kept)");
      }
    }
    for (const auto& bucket : update->buckets()) buckets.push_back(&bucket);
    hold = std::move(update);
  } else {
    throw py::type_error("save() takes a tensorbucket.Bucket or Update");
  }
  OutsideGil::run([&] {
    std::vector<std::vector<std::byte>> copies;
    std::vector<BucketView> views;
    views.reserve(buckets.size());
    for (const auto* bucket : buckets) {
      if (bucket->view().location().on_host()) {
        views.push_back(bucket->view());
      } else {
        copies.push_back(bucket->copy_to_host());
        views.push_back(BucketView::open(bucket->view().frame(), copies.back()));
      }
    }
    std::vector<const BucketView*> pointers;
    for (const auto& view : views) pointers.push_back(&view);
    safetensors::save(pointers, path);
  });
}

}  // namespace tensorbucket::python
