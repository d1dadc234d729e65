// Internal: the CUDA driver's C ABI, as much of it as cuda_driver.cpp calls, and the table
// over it. Declared here, not taken from cuda.h: see cuda_driver.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "device.hpp"

namespace tensorbucket::ipc::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
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

// The block-hash kernel's PTX (block_hash.cu), or null in a build without nvcc.
extern const char* const kBlockHashPtx;

// The driver's table, loaded on first call; CudaUnavailable when it cannot be.
const DeviceApi& driver_api();

}  // namespace tensorbucket::ipc::cuda
