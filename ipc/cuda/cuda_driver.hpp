// Internal: the CUDA driver's C ABI, as much of it as cuda_driver.cpp calls, and the table
// over it. Declared here, not taken from cuda.h: see cuda_driver.cpp.
#pragma once

#include "base/private.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "ipc/cuda/device.hpp"

namespace tensorbucket::ipc::cuda {

// Its own type, not an int, so that tests/test_cuda.cpp can map every signature below onto
// cuda.h's types one for one.
enum CUresult : int {};
using CUdevice = int;
using CUdeviceptr = unsigned long long;
// Declared here by name, so that they are ours even where cuda.h came first.
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
struct CUmod_st;
struct CUfunc_st;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;
using CUmodule = CUmod_st*;
using CUfunction = CUfunc_st*;
struct CUuuid {
  char bytes[16];
};
struct CUipcMemHandle {
  char reserved[kDeviceHandleBytes];
};
struct CUipcEventHandle {
  char reserved[kDeviceHandleBytes];
};
struct CUmemLocation {
  int type;
  int id;
};
struct CUmemcpyAttributes {
  int source_access_order;
  CUmemLocation source_location_hint;
  CUmemLocation destination_location_hint;
  unsigned flags;
};

inline constexpr int kErrorInvalidDevice = 101;                // CUDA_ERROR_INVALID_DEVICE
inline constexpr unsigned kEventDisableTiming = 0x2;           // CU_EVENT_DISABLE_TIMING
inline constexpr unsigned kEventInterprocess = 0x4;            // CU_EVENT_INTERPROCESS
inline constexpr unsigned kIpcMemLazyEnablePeerAccess = 0x1;   // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
inline constexpr int kMemcpySourceAccessOrderStream = 0x1;     // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
inline constexpr std::uint64_t kGetProcAddressLegacyStream = 1;  // CU_GET_PROC_ADDRESS_LEGACY_STREAM
inline constexpr std::uintptr_t kStreamLegacy = 0x1;            // CU_STREAM_LEGACY
inline constexpr unsigned kStreamNonBlocking = 0x1;              // CU_STREAM_NON_BLOCKING

// The driver's entry points that cuda_driver.cpp calls, each with the signature of the CUDA
// version it is resolved at (cuGetProcAddress gives the newest variant at or below it).
struct Driver {
  CUresult (*init)(unsigned flags);
  CUresult (*error_name)(CUresult code, const char** name);
  CUresult (*device_count)(int* count);
  CUresult (*device_get)(CUdevice* device, int ordinal);
  CUresult (*device_uuid)(CUuuid* uuid, CUdevice device);
  CUresult (*retain_primary)(CUcontext* context, CUdevice device);
  CUresult (*push_context)(CUcontext context);
  CUresult (*pop_context)(CUcontext* context);
  CUresult (*allocate)(CUdeviceptr* address, std::size_t bytes);
  CUresult (*free)(CUdeviceptr address);
  CUresult (*export_memory)(CUipcMemHandle* handle, CUdeviceptr address);
  CUresult (*import_memory)(CUdeviceptr* address, CUipcMemHandle handle, unsigned flags);
  CUresult (*close_memory)(CUdeviceptr address);
  CUresult (*address_range)(CUdeviceptr* base, std::size_t* size, CUdeviceptr address);
  CUresult (*create_event)(CUevent* event, unsigned flags);
  CUresult (*export_event)(CUipcEventHandle* handle, CUevent event);
  CUresult (*import_event)(CUevent* event, CUipcEventHandle handle);
  CUresult (*destroy_event)(CUevent event);
  CUresult (*record_event)(CUevent event, CUstream stream);
  CUresult (*wait_event)(CUstream stream, CUevent event, unsigned flags);
  CUresult (*copy_batch)(CUdeviceptr* to, CUdeviceptr* from, std::size_t* bytes, std::size_t count,
                         CUmemcpyAttributes* attributes, std::size_t* attribute_indices,
                         std::size_t attribute_count, std::size_t* failed_index, CUstream stream);
  CUresult (*copy)(CUdeviceptr to, CUdeviceptr from, std::size_t bytes, CUstream stream);
  CUresult (*zero)(CUdeviceptr address, unsigned char value, std::size_t bytes, CUstream stream);
  CUresult (*synchronize)(CUstream stream);
  CUresult (*synchronize_event)(CUevent event);
  CUresult (*synchronize_context)();
  CUresult (*current_context)(CUcontext* context);
  CUresult (*create_stream)(CUstream* stream, unsigned flags);
  CUresult (*destroy_stream)(CUstream stream);
  CUresult (*load_module)(CUmodule* module, const void* image);
  CUresult (*get_function)(CUfunction* function, CUmodule module, const char* name);
  CUresult (*unload_module)(CUmodule module);
  CUresult (*launch)(CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                     unsigned block_y, unsigned block_z, unsigned shared_bytes, CUstream stream, void** parameters,
                     void** extra);
};

// X(member, symbol, version asked for, the cudaTypedefs.h PFN version that gives, required):
// one list for cuda_driver.cpp, which resolves each, and tests/test_cuda.cpp, which checks each
// member's type against PFN_<symbol>_v<that version>. A version raised here without a new
// signature above fails to compile there instead of crashing in the driver (cuCtxSynchronize
// and cuMemcpyBatchAsync change their arguments at 13000).
#define TENSORBUCKET_CUDA_ENTRY_POINTS(X)                         \
  X(init, cuInit, 12000, 2000, true)                              \
  X(error_name, cuGetErrorName, 12000, 6000, true)                \
  X(device_count, cuDeviceGetCount, 12000, 2000, true)            \
  X(device_get, cuDeviceGet, 12000, 2000, true)                   \
  X(device_uuid, cuDeviceGetUuid, 12000, 11040, true)             \
  X(retain_primary, cuDevicePrimaryCtxRetain, 12000, 7000, true)  \
  X(push_context, cuCtxPushCurrent, 12000, 4000, true)            \
  X(pop_context, cuCtxPopCurrent, 12000, 4000, true)              \
  X(allocate, cuMemAlloc, 12000, 3020, true)                      \
  X(free, cuMemFree, 12000, 3020, true)                           \
  X(export_memory, cuIpcGetMemHandle, 12000, 4010, true)          \
  X(import_memory, cuIpcOpenMemHandle, 12000, 11000, true)        \
  X(close_memory, cuIpcCloseMemHandle, 12000, 4010, true)         \
  X(address_range, cuMemGetAddressRange, 12000, 3020, true)       \
  X(create_event, cuEventCreate, 12000, 2000, true)               \
  X(export_event, cuIpcGetEventHandle, 12000, 4010, true)         \
  X(import_event, cuIpcOpenEventHandle, 12000, 4010, true)        \
  X(destroy_event, cuEventDestroy, 12000, 4000, true)             \
  X(record_event, cuEventRecord, 12000, 2000, true)               \
  X(wait_event, cuStreamWaitEvent, 12000, 3020, true)             \
  X(copy_batch, cuMemcpyBatchAsync, 12080, 12080, false)          \
  X(copy, cuMemcpyAsync, 12000, 4000, true)                       \
  X(zero, cuMemsetD8Async, 12000, 3020, true)                     \
  X(synchronize, cuStreamSynchronize, 12000, 2000, true)          \
  X(synchronize_event, cuEventSynchronize, 12000, 2000, true)     \
  X(synchronize_context, cuCtxSynchronize, 12000, 2000, true)     \
  X(current_context, cuCtxGetCurrent, 12000, 4000, true)          \
  X(create_stream, cuStreamCreate, 12000, 2000, true)             \
  X(destroy_stream, cuStreamDestroy, 12000, 4000, true)           \
  X(load_module, cuModuleLoadData, 12000, 2000, true)             \
  X(get_function, cuModuleGetFunction, 12000, 2000, true)         \
  X(unload_module, cuModuleUnload, 12000, 2000, true)             \
  X(launch, cuLaunchKernel, 12000, 4000, true)

// The block-hash kernel's PTX (block_hash.cu), or null in a build without nvcc.
extern const char* const kBlockHashPtx;

// The driver's table, loaded on first call; CudaUnavailable when it cannot be.
const DeviceApi& driver_api();

}  // namespace tensorbucket::ipc::cuda
