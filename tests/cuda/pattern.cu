#include "pattern.hpp"

#include <cuda_runtime.h>

#include <chrono>
#include <thread>

namespace tensorbucket::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

bool ok(cudaError_t status, const char* call, std::string& error) {
  if (status == cudaSuccess) return true;
  error = std::string(call) + ": " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status);
  return false;
}

__device__ std::uint8_t pattern_byte(std::uint64_t index, std::uint64_t seed) {
  return static_cast<std::uint8_t>((index * 131 + (index >> 10) + seed * 7919) & 0xff);
}

int blocks_for(std::size_t bytes) {
  auto needed = (bytes + kThreads - 1) / kThreads;
  return static_cast<int>(needed < kMaxBlocks ? (needed == 0 ? 1 : needed) : kMaxBlocks);
}

__global__ void write_pattern(std::uint8_t* out, std::size_t bytes, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += gridDim.x * blockDim.x) {
    out[i] = pattern_byte(i, seed);
  }
}

__global__ void check_pattern(const std::uint8_t* in, std::size_t bytes, std::uint64_t seed,
                              unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += gridDim.x * blockDim.x) {
    local += in[i] != pattern_byte(i, seed);
  }
  if (local != 0) atomicAdd(mismatches, local);
}

}  // namespace

bool select_device(int device, std::string& error) { return ok(cudaSetDevice(device), "cudaSetDevice", error); }

void* allocate(std::size_t bytes, std::string& error) {
  void* memory = nullptr;
  return ok(cudaMalloc(&memory, bytes), "cudaMalloc", error) ? memory : nullptr;
}

void release(void* device_memory) { cudaFree(device_memory); }

void* make_stream(std::string& error) {
  cudaStream_t stream = nullptr;
  return ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate", error) ? stream : nullptr;
}

bool fill_pattern(void* device_memory, std::size_t bytes, std::uint64_t seed, void* stream, std::string& error) {
  write_pattern<<<blocks_for(bytes), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<std::uint8_t*>(device_memory), bytes, seed);
  return ok(cudaGetLastError(), "write_pattern", error);
}

bool finish(void* stream, std::string& error, double timeout_s) {
  auto on = static_cast<cudaStream_t>(stream);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    auto status = cudaStreamQuery(on);
    if (status != cudaErrorNotReady) return ok(status, "cudaStreamQuery", error);
    if (std::chrono::steady_clock::now() > deadline) {
      error = "the stream's work did not finish within " + std::to_string(timeout_s) + " s";
      return false;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool copy_to_host(void* host, const void* device_memory, std::size_t bytes, void* stream, std::string& error) {
  auto on = static_cast<cudaStream_t>(stream);
  return ok(cudaMemcpyAsync(host, device_memory, bytes, cudaMemcpyDeviceToHost, on), "cudaMemcpyAsync", error) &&
         ok(cudaStreamSynchronize(on), "cudaStreamSynchronize", error);
}

std::int64_t count_mismatches(const void* device_memory, std::size_t bytes, std::uint64_t seed, void* stream,
                              std::string& error) {
  auto on = static_cast<cudaStream_t>(stream);
  unsigned long long* counter = nullptr;
  unsigned long long count = 0;
  if (!ok(cudaMallocAsync(reinterpret_cast<void**>(&counter), sizeof count, on), "cudaMallocAsync", error)) return -1;
  bool done = ok(cudaMemsetAsync(counter, 0, sizeof count, on), "cudaMemsetAsync", error);
  if (done) {
    check_pattern<<<blocks_for(bytes), kThreads, 0, on>>>(static_cast<const std::uint8_t*>(device_memory), bytes,
                                                          seed, counter);
    // The count is read back only after the bounded wait: a copy to pageable memory would
    // block the host on the stream, without a bound.
    done = ok(cudaGetLastError(), "check_pattern", error) && finish(stream, error) &&
           ok(cudaMemcpy(&count, counter, sizeof count, cudaMemcpyDeviceToHost), "cudaMemcpy", error);
  }
  if (!done) return -1;  // the counter is left to the stream, which may never get to its free
  cudaFreeAsync(counter, on);
  return static_cast<std::int64_t>(count);
}

}  // namespace tensorbucket::cuda
