// Device buffers with a known byte pattern, written and checked by kernels: what the GPU
// tests and scripts/gpu-check's producers send and consumers check, every byte, on the GPU.
// No CUDA header leaks from here. Every call acts on the current device and returns false
// (or -1) with `error` set when CUDA failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tensorbucket::cuda {

bool select_device(int device, std::string& error);
void* allocate(std::size_t bytes, std::string& error);
void release(void* device_memory);
void* make_stream(std::string& error);  // a non-blocking stream (a cudaStream_t)

// Queues a kernel on `stream` that writes byte i as (131 i + i / 1024 + 7919 seed) mod 256.
bool fill_pattern(void* device_memory, std::size_t bytes, std::uint64_t seed, void* stream, std::string& error);

// Waits for the work queued on `stream`, for at most `timeout_s` seconds (then false, saying
// so): a stream waiting on the ready event of a producer killed before its record ran may
// never go on (docs/channel.md, "CUDA"), and a test must then fail, not hang.
bool finish(void* stream, std::string& error, double timeout_s = 60);

// Copies `bytes` of device memory to `host` after the work queued on `stream`, and waits.
bool copy_to_host(void* host, const void* device_memory, std::size_t bytes, void* stream, std::string& error);

// The bytes that differ from the pattern, counted on the device after the work queued on
// `stream`; waits for it, as finish() does (-1 on failure).
std::int64_t count_mismatches(const void* device_memory, std::size_t bytes, std::uint64_t seed, void* stream,
                              std::string& error);

}  // namespace tensorbucket::cuda
