// The block-hash kernel (serialize/block_hash.hpp): one warp per block, each lane mixing every
// 32nd word of it, the lanes folded in order by shuffles. Built into the library as PTX where
// nvcc is found (ipc/meson.build) and loaded through the driver (cuda_driver.cpp).
#include "serialize/block_hash.hpp"

using namespace tensorbucket::block_hash;

extern "C" __global__ void tensorbucket_block_hashes(const unsigned char* payload, unsigned long long bytes,
                                                     unsigned long long* hashes) {
  unsigned long long block = (blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x) / kHashLanes;
  unsigned lane = threadIdx.x % kHashLanes;
  if (block >= blocks_in(bytes)) return;  // the whole warp: they share `block`
  unsigned long long start = block * kHashBlockBytes;
  unsigned long long length = bytes - start < kHashBlockBytes ? bytes - start : kHashBlockBytes;
  const unsigned char* data = payload + start;
  std::uint64_t state = lane_seed(block, lane);
  for (unsigned long long j = lane; 8 * j < length; j += kHashLanes) {
    std::uint64_t word = 0;
    if (8 * j + 8 <= length) {
      word = *reinterpret_cast<const std::uint64_t*>(data + 8 * j);  // blocks start 64 KiB apart
    } else {
      for (unsigned k = 0; 8 * j + k < length; ++k) word |= static_cast<std::uint64_t>(data[8 * j + k]) << (8 * k);
    }
    state = lane_step(state, word);
  }
  std::uint64_t hash = fold_start(length);
  for (unsigned other = 0; other < kHashLanes; ++other) {
    hash = fold_lane(hash, __shfl_sync(0xffffffffu, state, other));
  }
  if (lane == 0) hashes[block] = hash;
}
