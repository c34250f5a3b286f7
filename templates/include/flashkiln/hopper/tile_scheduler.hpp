// Persistent tile scheduler: the grid holds at most one CTA per SM and each CTA runs work tiles
// (query tile, head, batch) until none are left. Its first tile is its block index; further ones
// come from a global counter when the runtime passes one (claimed in order as CTAs free up, so
// long and short causal tiles balance out), else with a stride of the grid size. Only the
// producer thread walks the schedule; it hands each tile to the consumers through shared memory.
//
// Order: batch, then head, then query tile, so that the CTAs in flight share the K/V of few heads
// in L2. Under a causal mask a head's query tiles run last to first: the longest tiles start
// first and the short ones fill the tail.
#pragma once

#include <flashkiln/common.hpp>

namespace flashkiln::hopper {

struct WorkTile {
  int row0;  // the tile's first query row: negative where the grid starts above the sequence
  int head, batch;
};

template <bool kLongestFirst>
struct TileScheduler {
  int num_m_blocks, heads, total;
  int* counter;  // or nullptr
  int block_m, row_shift;  // query tile rows; rows the grid starts above the sequence

  __device__ __forceinline__ TileScheduler(int num_m_blocks_, int heads_, int batch, uint64_t counter_, int block_m_,
                                           int row_shift_)
      : num_m_blocks(num_m_blocks_), heads(heads_), total(num_m_blocks_ * heads_ * batch),
        counter(reinterpret_cast<int*>(counter_)), block_m(block_m_), row_shift(row_shift_) {}

  __device__ __forceinline__ int first() const { return int(blockIdx.x); }
  __device__ __forceinline__ int next(int tile) const {
    return counter != nullptr ? int(gridDim.x) + atomicAdd(counter, 1) : tile + int(gridDim.x);
  }
  __device__ __forceinline__ bool valid(int tile) const { return tile < total; }

  __device__ __forceinline__ WorkTile decode(int tile) const {
    const int m = tile % num_m_blocks;
    const int bh = tile / num_m_blocks;
    const int m_block = kLongestFirst ? num_m_blocks - 1 - m : m;
    return {m_block * block_m - row_shift, bh % heads, bh / heads};
  }
};

}  // namespace flashkiln::hopper
