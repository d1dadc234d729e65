// A build without nvcc has no block-hash kernel: device payloads are hashed on a copy brought
// back to the host (cuda_driver.cpp).
#include "ipc/cuda/cuda_driver.hpp"

namespace tensorbucket::ipc::cuda {
extern const char* const kBlockHashPtx = nullptr;
}  // namespace tensorbucket::ipc::cuda
