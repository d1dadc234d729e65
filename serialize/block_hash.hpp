// The block hash of a payload (docs/format.md, "Payload hashes"): what a device channel's
// payload checksum is, made to be computed in parallel on a GPU and the same on the host.
// The payload is cut into kHashBlockBytes blocks; each block is read as little-endian 64-bit
// words, zero-padded, dealt to kHashLanes lanes in turn (word j to lane j mod 32); each lane
// mixes its words in order, the lanes are folded in order, and the payload's hash is the
// xxh3-64 of the block hashes (little-endian 64-bit words). The arithmetic below is compiled
// for the host (serialize/block_hash.cpp) and by nvcc for the kernel (ipc/cuda/block_hash.cu).
#pragma once

#include "base/private.hpp"

#include <cstdint>
#ifndef __CUDACC__
#include <cstddef>
#include <span>
#endif

#ifdef __CUDACC__
#define TENSORBUCKET_HOST_DEVICE __host__ __device__
#else
#define TENSORBUCKET_HOST_DEVICE
#endif

namespace tensorbucket::block_hash {

inline constexpr std::uint64_t kHashBlockBytes = 64 * 1024;
inline constexpr unsigned kHashLanes = 32;
inline constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
inline constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr std::uint64_t kPrime3 = 0x165667B19E3779F9ull;

TENSORBUCKET_HOST_DEVICE constexpr std::uint64_t rotate_left(std::uint64_t x, unsigned bits) {
  return (x << bits) | (x >> (64 - bits));
}

TENSORBUCKET_HOST_DEVICE constexpr std::uint64_t avalanche(std::uint64_t x) {
  x ^= x >> 33;
  x *= kPrime2;
  x ^= x >> 29;
  x *= kPrime3;
  x ^= x >> 32;
  return x;
}

// Lane `lane` of block `block` before its first word.
TENSORBUCKET_HOST_DEVICE constexpr std::uint64_t lane_seed(std::uint64_t block, unsigned lane) {
  return (block * kHashLanes + lane + 1) * kPrime3;
}

TENSORBUCKET_HOST_DEVICE constexpr std::uint64_t lane_step(std::uint64_t lane_state, std::uint64_t word) {
  return rotate_left(lane_state ^ (word * kPrime2), 31) * kPrime1;
}

// The block's hash so far, before the first lane is folded in: its length.
TENSORBUCKET_HOST_DEVICE constexpr std::uint64_t fold_start(std::uint64_t block_bytes) { return block_bytes; }

TENSORBUCKET_HOST_DEVICE constexpr std::uint64_t fold_lane(std::uint64_t hash, std::uint64_t lane_state) {
  return rotate_left(hash ^ avalanche(lane_state), 27) * kPrime1 + kPrime3;
}

TENSORBUCKET_HOST_DEVICE constexpr std::uint64_t blocks_in(std::uint64_t payload_bytes) {
  return (payload_bytes + kHashBlockBytes - 1) / kHashBlockBytes;
}

#ifndef __CUDACC__
// On the host: one block's hash, the payload's hash from its blocks' hashes, and the
// payload's hash from its bytes.
std::uint64_t hash_of_block(std::span<const std::byte> block, std::uint64_t index);
std::uint64_t combine(std::span<const std::uint64_t> block_hashes);
std::uint64_t hash_of(std::span<const std::byte> payload);
#endif

}  // namespace tensorbucket::block_hash
