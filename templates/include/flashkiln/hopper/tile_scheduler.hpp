// Persistent tile scheduler: the grid holds at most one CTA per SM and each CTA walks the work
// tiles (query tile, head, batch) with a stride of the grid size. Producer and consumers walk the
// same sequence independently.
//
// Order: batch, then head, then query tile, so that the CTAs in flight share the K/V of few heads
// in L2. Under a causal mask a head's query tiles run last to first: the longest tiles start
// first and the short ones fill the tail.
#pragma once

#include <flashkiln/common.hpp>

namespace flashkiln::hopper {

struct WorkTile {
  int m_block, head, batch;
};

template <bool kLongestFirst>
struct TileScheduler {
  int num_m_blocks, heads, total;

  __device__ __forceinline__ TileScheduler(int num_m_blocks_, int heads_, int batch)
      : num_m_blocks(num_m_blocks_), heads(heads_), total(num_m_blocks_ * heads_ * batch) {}

  __device__ __forceinline__ int first() const { return int(blockIdx.x); }
  __device__ __forceinline__ int next(int tile) const { return tile + int(gridDim.x); }
  __device__ __forceinline__ bool valid(int tile) const { return tile < total; }

  __device__ __forceinline__ WorkTile decode(int tile) const {
    const int m = tile % num_m_blocks;
    const int bh = tile / num_m_blocks;
    return {kLongestFirst ? num_m_blocks - 1 - m : m, bh % heads, bh / heads};
  }
};

}  // namespace flashkiln::hopper
