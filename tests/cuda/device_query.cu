#include "device_query.hpp"

#include <cuda_runtime.h>

#include <cstdio>

namespace tensorbucket::cuda {

namespace {

std::string describe(cudaError_t status) {
  return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
}

__global__ void write_probe(int* out, int count) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) out[i] = 3 * i + 1;
}

}  // namespace

DeviceReport query_devices() {
  DeviceReport report;
  cudaRuntimeGetVersion(&report.runtime_version);
  cudaDriverGetVersion(&report.driver_version);  // leaves 0 without a driver
  int count = 0;
  if (auto status = cudaGetDeviceCount(&count); status != cudaSuccess) {
    report.error = describe(status);
    return report;
  }
  for (int device = 0; device < count; ++device) {
    cudaDeviceProp properties{};
    if (auto status = cudaGetDeviceProperties(&properties, device); status != cudaSuccess) {
      report.devices.clear();
      report.error = "device " + std::to_string(device) + ": " + describe(status);
      return report;
    }
    char line[320];
    std::snprintf(line, sizeof line, "%s (sm_%d%d, %.0f GB)", properties.name, properties.major,
                  properties.minor, static_cast<double>(properties.totalGlobalMem) / 1e9);
    report.devices.emplace_back(line);
  }
  if (count == 0) report.error = "the driver reports no CUDA device";
  return report;
}

std::vector<int> run_probe_kernel(int device, int count, std::string& error) {
  int* on_device = nullptr;
  std::vector<int> values(static_cast<std::size_t>(count));
  auto failed = [&](const char* step, cudaError_t status) {
    error = std::string(step) + ": " + describe(status);
    if (on_device != nullptr) cudaFree(on_device);
    return std::vector<int>{};
  };
  if (auto status = cudaSetDevice(device); status != cudaSuccess) return failed("cudaSetDevice", status);
  if (auto status = cudaMalloc(&on_device, values.size() * sizeof(int)); status != cudaSuccess) {
    return failed("cudaMalloc", status);
  }
  write_probe<<<(count + 255) / 256, 256>>>(on_device, count);
  if (auto status = cudaGetLastError(); status != cudaSuccess) return failed("kernel launch", status);
  if (auto status = cudaMemcpy(values.data(), on_device, values.size() * sizeof(int),
                               cudaMemcpyDeviceToHost);
      status != cudaSuccess) {
    return failed("cudaMemcpy", status);
  }
  cudaFree(on_device);
  return values;
}

}  // namespace tensorbucket::cuda
