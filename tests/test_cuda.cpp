// The CUDA toolchain, end to end: the runtime nvcc linked answers, a kernel nvcc compiled runs
// on every device, and the CUDA libraries of the torch we build against load. Where there is
// no driver or no device (CI), what needs one is skipped, saying why.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <type_traits>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "device_query.hpp"
#include "ipc/cuda/cuda_driver.hpp"

namespace tensorbucket {
namespace {

// The driver ABI the library declares itself (ipc/cuda/cuda_driver.hpp), against cuda.h.
namespace abi = ipc::cuda;
static_assert(sizeof(abi::CUdeviceptr) == sizeof(CUdeviceptr));
static_assert(sizeof(abi::CUuuid) == sizeof(CUuuid));
static_assert(sizeof(abi::CUipcMemHandle) == sizeof(CUipcMemHandle));
static_assert(sizeof(abi::CUipcEventHandle) == sizeof(CUipcEventHandle));
static_assert(sizeof(abi::CUmemcpyAttributes) == sizeof(CUmemcpyAttributes));
static_assert(offsetof(abi::CUmemcpyAttributes, flags) == offsetof(CUmemcpyAttributes, flags));
static_assert(ipc::kDeviceHandleBytes == CU_IPC_HANDLE_SIZE);
static_assert(abi::kErrorInvalidDevice == CUDA_ERROR_INVALID_DEVICE);
static_assert(abi::kEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(abi::kEventInterprocess == CU_EVENT_INTERPROCESS);
static_assert(abi::kIpcMemLazyEnablePeerAccess == CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
static_assert(abi::kMemcpySourceAccessOrderStream == CU_MEMCPY_SRC_ACCESS_ORDER_STREAM);
static_assert(abi::kGetProcAddressLegacyStream == CU_GET_PROC_ADDRESS_LEGACY_STREAM);
static_assert(abi::kStreamNonBlocking == CU_STREAM_NON_BLOCKING);

// Each entry point's declared signature, its types mapped onto cuda.h's one for one, is the
// PFN type cudaTypedefs.h gives for the version the library asks for.
template <typename T>
struct InCudaH {
  using type = T;
};
template <typename T>
struct InCudaH<T*> {
  using type = typename InCudaH<T>::type*;
};
template <typename T>
struct InCudaH<const T> {
  using type = const typename InCudaH<T>::type;
};
template <typename R, typename... Arguments>
struct InCudaH<R (*)(Arguments...)> {
  using type = typename InCudaH<R>::type (*)(typename InCudaH<Arguments>::type...);
};
#define TENSORBUCKET_SAME_TYPE_IN_CUDA_H(ours, theirs) \
  template <>                                          \
  struct InCudaH<ours> {                               \
    using type = theirs;                               \
  };
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUresult, ::CUresult)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUctx_st, ::CUctx_st)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUstream_st, ::CUstream_st)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUevent_st, ::CUevent_st)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUmod_st, ::CUmod_st)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUfunc_st, ::CUfunc_st)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUuuid, ::CUuuid)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUipcMemHandle, ::CUipcMemHandle)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUipcEventHandle, ::CUipcEventHandle)
TENSORBUCKET_SAME_TYPE_IN_CUDA_H(abi::CUmemcpyAttributes, ::CUmemcpyAttributes)
#undef TENSORBUCKET_SAME_TYPE_IN_CUDA_H

#define TENSORBUCKET_CHECK_ENTRY_POINT(member, symbol, version, pfn_version, required)                   \
  static_assert(std::is_same_v<InCudaH<decltype(abi::Driver::member)>::type, PFN_##symbol##_v##pfn_version>, \
                #symbol " at CUDA " #version " is not declared as cudaTypedefs.h's PFN_" #symbol "_v" #pfn_version);
TENSORBUCKET_CUDA_ENTRY_POINTS(TENSORBUCKET_CHECK_ENTRY_POINT)
#undef TENSORBUCKET_CHECK_ENTRY_POINT

TEST(Cuda, DeclaredDriverStreamHandlesMatchCudaH) {
  EXPECT_EQ(reinterpret_cast<CUstream>(abi::kStreamLegacy), CU_STREAM_LEGACY);
}

TEST(Cuda, RuntimeAnswersWithoutADevice) {
  auto report = cuda::query_devices();
  EXPECT_GE(report.runtime_version, 12000);
  if (report.devices.empty()) {
    EXPECT_FALSE(report.error.empty()) << "no device, and no reason given";
  } else {
    EXPECT_TRUE(report.error.empty()) << report.error;
    EXPECT_GE(report.driver_version, report.runtime_version)
        << "the driver is older than the runtime it runs";
  }
}

TEST(Cuda, KernelRunsOnEveryDevice) {
  auto report = cuda::query_devices();
  if (report.devices.empty()) GTEST_SKIP() << "no CUDA device: " << report.error;
  for (int device = 0; device < static_cast<int>(report.devices.size()); ++device) {
    SCOPED_TRACE(report.devices[device]);
    std::string error;
    constexpr int kCount = 1000;  // more than one block
    auto values = cuda::run_probe_kernel(device, kCount, error);
    ASSERT_EQ(values.size(), static_cast<std::size_t>(kCount)) << error;
    for (int i = 0; i < kCount; ++i) ASSERT_EQ(values[i], 3 * i + 1) << "at " << i;
  }
}

// TORCH_CUDA_LIBRARIES: the paths of torch's CUDA libraries (meson sets it where torch was
// built for CUDA). They load, with every library they need, even on a machine without a GPU.
TEST(Cuda, TorchCudaLibrariesLoad) {
  const char* paths = std::getenv("TORCH_CUDA_LIBRARIES");
  if (paths == nullptr) GTEST_SKIP() << "this build's torch has no CUDA libraries";
  std::string list = paths;
  for (std::size_t start = 0; start < list.size();) {
    auto end = std::min(list.find(':', start), list.size());
    auto path = list.substr(start, end - start);
    void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    EXPECT_NE(library, nullptr) << path << ": " << ::dlerror();
    if (library != nullptr) ::dlclose(library);
    start = end + 1;
  }
}

}  // namespace
}  // namespace tensorbucket
