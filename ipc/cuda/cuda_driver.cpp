// The CUDA driver behind the DeviceApi table (device.hpp), found at run time: dlopen of
// libcuda.so.1, then every entry point through cuGetProcAddress at the CUDA version whose
// signature is written below. So the library needs no CUDA toolkit to build (pip builds
// included), links no libcuda (a host-only user needs no driver), and stays apart from the
// CUDA runtime a torch wheel bundles: driver calls act on the device's primary context, the
// one torch's runtime uses too.
//
// The types below are the driver's stable C ABI, declared here rather than taken from cuda.h
// for that reason; tests/test_cuda.cpp checks them against cuda.h where the toolkit is.
#include <dlfcn.h>

#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "ipc/cuda/cuda_driver.hpp"
#include "serialize/block_hash.hpp"
#include "base/text.hpp"

namespace tensorbucket::ipc::cuda {

namespace {

Driver driver{};
std::mutex contexts_mutex;
std::vector<CUcontext> primary_contexts;  // by ordinal; retained for the process's life

int device_count(int* count) { return driver.device_count(count); }

int device_uuid(int ordinal, DeviceUuid* uuid) {
  CUdevice device = 0;
  if (auto code = driver.device_get(&device, ordinal)) return code;
  CUuuid raw{};
  if (auto code = driver.device_uuid(&raw, device)) return code;
  std::memcpy(uuid->data(), raw.bytes, uuid->size());
  return 0;
}

int enter(int ordinal) {
  CUcontext context = nullptr;
  {
    std::lock_guard lock(contexts_mutex);
    if (ordinal < 0) return kErrorInvalidDevice;
    if (primary_contexts.size() <= static_cast<std::size_t>(ordinal)) primary_contexts.resize(ordinal + 1);
    if (primary_contexts[ordinal] == nullptr) {
      CUdevice device = 0;
      if (auto code = driver.device_get(&device, ordinal)) return code;
      if (auto code = driver.retain_primary(&primary_contexts[ordinal], device)) return code;
    }
    context = primary_contexts[ordinal];
  }
  return driver.push_context(context);
}

int leave() {
  CUcontext popped = nullptr;
  return driver.pop_context(&popped);
}

int allocate(DeviceAddress* address, std::uint64_t bytes) { return driver.allocate(address, bytes); }
int release(DeviceAddress address) { return driver.free(address); }

int export_memory(DeviceHandle* handle, DeviceAddress address) {
  CUipcMemHandle raw{};
  if (auto code = driver.export_memory(&raw, address)) return code;
  std::memcpy(handle->bytes.data(), raw.reserved, handle->bytes.size());
  return 0;
}

int import_memory(DeviceAddress* address, std::uint64_t* bytes, const DeviceHandle& handle) {
  CUipcMemHandle raw{};
  std::memcpy(raw.reserved, handle.bytes.data(), handle.bytes.size());
  if (auto code = driver.import_memory(address, raw, kIpcMemLazyEnablePeerAccess)) return code;
  CUdeviceptr base = 0;
  std::size_t size = 0;
  if (auto code = driver.address_range(&base, &size, *address)) {
    driver.close_memory(*address);
    return code;
  }
  *bytes = size - (*address - base);
  return 0;
}

int close_memory(DeviceAddress address) { return driver.close_memory(address); }

int create_event(DeviceEvent* event) {
  return driver.create_event(reinterpret_cast<CUevent*>(event), kEventDisableTiming | kEventInterprocess);
}

int export_event(DeviceHandle* handle, DeviceEvent event) {
  CUipcEventHandle raw{};
  if (auto code = driver.export_event(&raw, static_cast<CUevent>(event))) return code;
  std::memcpy(handle->bytes.data(), raw.reserved, handle->bytes.size());
  return 0;
}

int import_event(DeviceEvent* event, const DeviceHandle& handle) {
  CUipcEventHandle raw{};
  std::memcpy(raw.reserved, handle.bytes.data(), handle.bytes.size());
  return driver.import_event(reinterpret_cast<CUevent*>(event), raw);
}

int destroy_event(DeviceEvent event) { return driver.destroy_event(static_cast<CUevent>(event)); }
int record_event(DeviceEvent event, DeviceStream stream) {
  return driver.record_event(static_cast<CUevent>(event), static_cast<CUstream>(stream));
}
int wait_event(DeviceStream stream, DeviceEvent event) {
  return driver.wait_event(static_cast<CUstream>(stream), static_cast<CUevent>(event), 0);
}

// The batched call refuses the legacy default stream (null, or CU_STREAM_LEGACY), which is
// torch's default stream. A batch for it runs on a stream of ours in the same context, fenced
// by two events: after the work queued on the caller's stream before, and before the work
// queued on it after, as if it ran there.
struct SideStream {
  CUstream stream = nullptr;
  CUevent before = nullptr;
  CUevent after = nullptr;
};
std::mutex side_mutex;  // one batch at a time on a side stream: its events are reused
std::map<CUcontext, SideStream> side_streams;

bool legacy(CUstream stream) { return stream == nullptr || stream == reinterpret_cast<CUstream>(kStreamLegacy); }

int batch(const DeviceCopy* copies, std::size_t count, CUstream stream) {
  std::vector<CUdeviceptr> to(count), from(count);
    std::vector<std::size_t> bytes(count);
  for (std::size_t i = 0; i < count; ++i) {
    to[i] = copies[i].to;
    from[i] = copies[i].from;
    bytes[i] = copies[i].bytes;
  }
  // One attribute for every copy: sources are read in stream order (they may be written by
  // work queued before on the same stream).
  CUmemcpyAttributes attributes{};
  attributes.source_access_order = kMemcpySourceAccessOrderStream;
  std::size_t first = 0, failed = 0;
  return driver.copy_batch(to.data(), from.data(), bytes.data(), count, &attributes, &first, 1, &failed, stream);
}

int batch_beside(const DeviceCopy* copies, std::size_t count, CUstream stream) {
  std::lock_guard lock(side_mutex);
  CUcontext context = nullptr;
  if (auto code = driver.current_context(&context)) return code;
  auto& side = side_streams[context];
  if (side.stream == nullptr) {
    // Kept only whole: a stream without its events would fail every batch after.
    SideStream made;
    auto code = driver.create_stream(&made.stream, kStreamNonBlocking);
    if (code == 0) code = driver.create_event(&made.before, kEventDisableTiming);
    if (code == 0) code = driver.create_event(&made.after, kEventDisableTiming);
    if (code != 0) {
      if (made.before != nullptr) driver.destroy_event(made.before);
      if (made.stream != nullptr) driver.destroy_stream(made.stream);
      return code;
    }
    side = made;
  }
  if (auto code = driver.record_event(side.before, stream)) return code;
  if (auto code = driver.wait_event(side.stream, side.before, 0)) return code;
  if (auto code = batch(copies, count, side.stream)) return code;
  if (auto code = driver.record_event(side.after, side.stream)) return code;
  return driver.wait_event(stream, side.after, 0);
}

int copy(const DeviceCopy* copies, std::size_t count, DeviceStream stream) {
  if (count == 0) return 0;
  auto on = static_cast<CUstream>(stream);
  // Drivers before 12.8 lack the batched call: one copy per entry.
  if (driver.copy_batch != nullptr && count > 1) {
    return legacy(on) ? batch_beside(copies, count, on) : batch(copies, count, on);
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (auto code = driver.copy(copies[i].to, copies[i].from, copies[i].bytes, static_cast<CUstream>(stream))) {
      return code;
    }
  }
  return 0;
}

int zero(DeviceAddress address, std::uint64_t bytes, DeviceStream stream) {
  return driver.zero(address, 0, bytes, static_cast<CUstream>(stream));
}

int synchronize(DeviceStream stream) { return driver.synchronize(static_cast<CUstream>(stream)); }
int synchronize_event(DeviceEvent event) { return driver.synchronize_event(static_cast<CUevent>(event)); }
int synchronize_context() { return driver.synchronize_context(); }

// The kernel, loaded once per context (the PTX is compiled for the device then). A driver
// older than the nvcc that made the PTX cannot compile it: then, for good, the hash is taken
// on a host copy, as in a build without the kernel. Other failures (out of memory) are errors,
// and loading is tried again next time.
std::mutex kernels_mutex;
std::map<CUcontext, std::optional<CUfunction>> block_hash_kernels;  // null: refused for good

bool refused_for_good(int code) {
  constexpr int kNoBinaryForGpu = 209, kInvalidPtx = 218, kUnsupportedPtxVersion = 222,
                     kJitCompilerNotFound = 221, kInvalidImage = 200;
  return code == kNoBinaryForGpu || code == kInvalidPtx || code == kUnsupportedPtxVersion ||
         code == kJitCompilerNotFound || code == kInvalidImage;
}

int hash_blocks(DeviceAddress payload, std::uint64_t bytes, DeviceAddress hashes, DeviceStream stream) {
  if (kBlockHashPtx == nullptr) return kDeviceNotSupported;
  CUfunction kernel = nullptr;
  {
    std::lock_guard lock(kernels_mutex);
    CUcontext context = nullptr;
    if (auto code = driver.current_context(&context)) return code;
    auto& known = block_hash_kernels[context];
    if (!known) {
      CUmodule module = nullptr;
      CUfunction loaded = nullptr;
      auto code = driver.load_module(&module, kBlockHashPtx);
      if (code == 0) {
        code = driver.get_function(&loaded, module, "tensorbucket_block_hashes");
        if (code != 0) driver.unload_module(module);
      }
      if (code != 0 && !refused_for_good(code)) return code;
      known = loaded;
    }
    if (*known == nullptr) return kDeviceNotSupported;
    kernel = *known;
  }
  constexpr unsigned kThreads = 256;  // eight warps, a block of the payload each
  auto warps = (bytes + block_hash::kHashBlockBytes - 1) / block_hash::kHashBlockBytes;
  auto grid = static_cast<unsigned>((warps * block_hash::kHashLanes + kThreads - 1) / kThreads);
  unsigned long long payload_arg = payload, bytes_arg = bytes, hashes_arg = hashes;
  void* parameters[] = {&payload_arg, &bytes_arg, &hashes_arg};
  return driver.launch(kernel, grid, 1, 1, kThreads, 1, 1, 0, static_cast<CUstream>(stream), parameters, nullptr);
}

const char* error_name(int code) {
  const char* name = nullptr;
  if (driver.error_name == nullptr || driver.error_name(static_cast<CUresult>(code), &name) != 0 || name == nullptr) {
    return "unknown";
  }
  return name;
}

constexpr DeviceApi kDriverApi{
    "the CUDA driver", device_count, device_uuid, enter,          leave,         allocate,
    release,           export_memory, import_memory, close_memory, create_event, export_event,
    import_event,      destroy_event, record_event, wait_event,    copy,          zero,
    synchronize,       synchronize_event, synchronize_context, hash_blocks, error_name,
};

const DeviceApi* load() {
  // Never unloaded: device memory and contexts live until the process ends.
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = ::dlerror();
    text::fail(ErrorCode::CudaUnavailable, "no CUDA driver in this process (", why ? why : "libcuda.so.1 not found",
               ")");
  }
  using GetProcAddress = CUresult (*)(const char*, void**, int, std::uint64_t, int*);
  auto get_proc_address = reinterpret_cast<GetProcAddress>(::dlsym(library, "cuGetProcAddress_v2"));
  if (get_proc_address == nullptr) {
    text::fail(ErrorCode::CudaUnavailable, "the CUDA driver is older than CUDA 12 (no cuGetProcAddress_v2)");
  }
  // The entry point with the signature declared for it in Driver: that of `version`.
  auto resolve = [&](auto& slot, const char* symbol, int version, bool required = true) {
    void* function = nullptr;
    int found = 0;
    if (get_proc_address(symbol, &function, version, kGetProcAddressLegacyStream, &found) != 0 ||
        function == nullptr) {
      if (required) text::fail(ErrorCode::CudaUnavailable, "the CUDA driver lacks ", symbol);
      function = nullptr;
    }
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(function);
  };
  // cuInit first: nothing else answers before it, and its failure says the most.
  resolve(driver.init, "cuInit", 12000);
  resolve(driver.error_name, "cuGetErrorName", 12000);
  if (auto code = driver.init(0)) {
    text::fail(ErrorCode::CudaUnavailable, "the CUDA driver found no usable device (cuInit: ",
               error_name(code), ")");
  }
#define TENSORBUCKET_RESOLVE(member, symbol, version, pfn_version, required) \
  resolve(driver.member, #symbol, version, required);
  TENSORBUCKET_CUDA_ENTRY_POINTS(TENSORBUCKET_RESOLVE)
#undef TENSORBUCKET_RESOLVE
  return &kDriverApi;
}

}  // namespace

const DeviceApi& driver_api() {
  static const DeviceApi* loaded = nullptr;
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  if (loaded == nullptr) loaded = load();  // a failure is retried, and reported, next time
  return *loaded;
}

}  // namespace tensorbucket::ipc::cuda
