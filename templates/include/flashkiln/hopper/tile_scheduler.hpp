// Persistent tile scheduler: the grid holds at most one CTA per SM and each CTA runs work tiles
// (query tile, head, batch) until none are left. Its first tile is its block index; further ones
// come from a global counter when the runtime passes one (claimed in order as CTAs free up, so
// long and short tiles, causal ones or a packed batch's, balance out), else with a stride of the
// grid size. In a packed batch `batch` counts sequences, and a head's query tiles cover the
// longest one (the producer skips those past a shorter sequence's end). Only the
// producer thread walks the schedule; it hands each tile to the consumers through shared memory.
//
// Order (TileOrder): batch, then head, then query tile, so that the CTAs in flight share the K/V
// of few heads in L2. With a bias broadcast over heads or batches that L2 cannot hold, the
// broadcast dim runs innermost instead, so that they share its tiles. Under a causal mask a
// head's query tiles run last to first: the longest tiles start first and the short ones fill
// the tail.
#pragma once

#include <flashkiln/common/math.hpp>
#include <flashkiln/hopper/fwd_params.hpp>

namespace flashkiln::hopper {

struct WorkTile {
  int row0;  // the tile's first query row in its sequence: negative where the grid starts above it
  int head, batch;
  // Of the tile's sequence (common/sequence.hpp), filled in by the producer: its lengths (packed batches
  // only: see seqlens), its first query and key tokens, and the batch entry of the tensors it
  // lies in (0 for a packed batch).
  int seqlen_q, seqlen_k;
  int q_begin, k_begin, entry;
};

// The lengths (q, k) of a tile's sequence: a packed batch's from the tile, a dense batch's from
// the parameters, where the compiler keeps them (copies in the tile took producer registers).
template <bool kPacked>
__device__ __forceinline__ int2 seqlens(HopperFwdParams const& p, WorkTile const& w) {
  return kPacked ? make_int2(w.seqlen_q, w.seqlen_k) : make_int2(p.seqlen_q, p.seqlen_k);
}

// The innermost dim of the work tiles' order (HopperFwdParams.tile_order); the others keep
// batch, head, query tile from the outside in.
enum TileOrder : int { kQueryTilesInner = 0, kHeadsInner = 1, kBatchInner = 2 };

template <bool kLongestFirst>
struct TileScheduler {
  int num_m_blocks, heads, batch, total;
  int* counter;  // or nullptr
  int block_m, row_shift;  // query tile rows; rows the grid starts above the sequence
  int order;  // TileOrder

  __device__ __forceinline__ TileScheduler(int num_m_blocks_, int heads_, int batch_, uint64_t counter_, int block_m_,
                                           int row_shift_, int order_)
      : num_m_blocks(num_m_blocks_), heads(heads_), batch(batch_), total(num_m_blocks_ * heads_ * batch_),
        counter(reinterpret_cast<int*>(counter_)), block_m(block_m_), row_shift(row_shift_), order(order_) {}

  __device__ __forceinline__ int first() const { return int(blockIdx.x); }
  __device__ __forceinline__ int next(int tile) const {
    return counter != nullptr ? int(gridDim.x) + atomicAdd(counter, 1) : tile + int(gridDim.x);
  }
  __device__ __forceinline__ bool valid(int tile) const { return tile < total; }

  __device__ __forceinline__ WorkTile decode(int tile) const {
    int m, head, b;
    if (order == kHeadsInner) {  // batch, query tile, head
      head = tile % heads;
      m = tile / heads % num_m_blocks;
      b = tile / heads / num_m_blocks;
    } else if (order == kBatchInner) {  // head, query tile, batch
      b = tile % batch;
      m = tile / batch % num_m_blocks;
      head = tile / batch / num_m_blocks;
    } else {  // batch, head, query tile
      m = tile % num_m_blocks;
      head = tile / num_m_blocks % heads;
      b = tile / num_m_blocks / heads;
    }
    const int m_block = kLongestFirst ? num_m_blocks - 1 - m : m;
    return {m_block * block_m - row_shift, head, b, 0, 0, 0, 0, 0};
  }
};

}  // namespace flashkiln::hopper
