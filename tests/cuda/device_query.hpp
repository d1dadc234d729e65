// What the CUDA runtime sees on this machine, and a kernel run on each device: the smallest
// proof that nvcc, the runtime and a driver work together. No CUDA header leaks from here, so
// that code built without nvcc can ask.
#pragma once

#include <string>
#include <vector>

namespace tensorbucket::cuda {

struct DeviceReport {
  int runtime_version = 0;  // of the CUDA runtime linked in, e.g. 13000 for 13.0
  int driver_version = 0;   // the most recent CUDA the driver supports; 0 without a driver
  std::vector<std::string> devices;  // "NVIDIA H200 (sm_90, 140 GB)", one per device
  std::string error;  // why `devices` is empty: no driver, no device, ...
};

DeviceReport query_devices();

// Runs a kernel on `device` that writes 3*i+1 at each index i of `count` ints, and returns
// them as copied back; empty, with `error` set, when CUDA failed.
std::vector<int> run_probe_kernel(int device, int count, std::string& error);

}  // namespace tensorbucket::cuda
