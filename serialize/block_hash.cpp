#include "block_hash.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "tensorbucket/header.hpp"

namespace tensorbucket::block_hash {

std::uint64_t hash_of_block(std::span<const std::byte> block, std::uint64_t index) {
  std::uint64_t lanes[kHashLanes];
  for (unsigned lane = 0; lane < kHashLanes; ++lane) lanes[lane] = lane_seed(index, lane);
  auto words = (block.size() + 7) / 8;
  for (std::uint64_t j = 0; j < words; ++j) {
    std::uint64_t word = 0;  // little-endian, zero-padded: the hosts we build for are little-endian
    std::memcpy(&word, block.data() + 8 * j, std::min<std::size_t>(8, block.size() - 8 * j));
    lanes[j % kHashLanes] = lane_step(lanes[j % kHashLanes], word);
  }
  auto hash = fold_start(block.size());
  for (unsigned lane = 0; lane < kHashLanes; ++lane) hash = fold_lane(hash, lanes[lane]);
  return hash;
}

std::uint64_t combine(std::span<const std::uint64_t> block_hashes) {
  return xxh3(std::as_bytes(block_hashes));
}

std::uint64_t hash_of(std::span<const std::byte> payload) {
  std::vector<std::uint64_t> blocks(blocks_in(payload.size()));
  for (std::uint64_t b = 0; b < blocks.size(); ++b) {
    blocks[b] = hash_of_block(payload.subspan(b * kHashBlockBytes,
                                              std::min<std::uint64_t>(kHashBlockBytes, payload.size() - b * kHashBlockBytes)),
                              b);
  }
  return combine(blocks);
}

}  // namespace tensorbucket::block_hash
