// What a CTA of the Hopper backward's main kernel works on, and in which order: its place in the
// grid (key tile, head, batch entry or sequence), the query tiles that see its key tile and the
// order of its sweep over them, its turn among the key tiles that add to a query tile's dQ in a
// deterministic call, and its slice and member of a bias that several (batch entry, head) pairs
// share. The producer, the dQ writers and the consumers (bwd_producer.hpp, bwd_writers.hpp,
// bwd_mainloop.hpp) each derive the sweep from here, so that they agree on it.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/math.hpp>
#include <flashkiln/common/sequence.hpp>
#include <flashkiln/common/visibility.hpp>
#include <flashkiln/hopper/bwd_params.hpp>

namespace flashkiln::hopper {

using namespace cute;

// The visibility rule of sequence s (common/visibility.hpp).
template <class T>
__device__ __forceinline__ Visibility<T::kCausal, T::kWindow> visibility_of(HopperBwdParams const& p,
                                                                          Sequence const& s) {
  return visibility<T::kCausal, T::kWindow>(s.seqlen_q, s.seqlen_k, reach_of(p));
}

// The query tiles of sequence s that see its key tile n_block.
template <class T>
__device__ __forceinline__ TileRange query_tiles(HopperBwdParams const& p, Sequence const& s, int n_block) {
  return visiting_query_tiles<T::kBlockM, T::kBlockN>(visibility_of<T>(p, s), n_block,
                                                      ceil_div(s.seqlen_q, T::kBlockM));
}

// The order in which a key tile visits its query tiles (index i of the sweep -> query tile): from
// the first, or staggered, from query tile n_block of the range on, wrapping at its end. Staggered
// where the call allows it (HopperBwdParams::staggered_sweep: deterministic, and the sequence's key
// tiles all run at once) and every key tile visits the same range, of at least as many query tiles
// as there are key tiles: the key tiles of a head then start on different query tiles, and a query
// tile's dQ turns (dq_turn) follow their order of arrival instead of a pipeline as deep as the key
// tiles.
struct QuerySweep {
  int first, count;
  bool staggered;
  int start;

  __device__ __forceinline__ int tile(int i) const {
    if (!staggered) {
      return first + i;
    }
    const int j = i + start;
    return first + (j >= count ? j - count : j);
  }
};

template <class T>
__device__ __forceinline__ QuerySweep query_sweep(HopperBwdParams const& p, Sequence const& s, int n_block) {
  const TileRange tiles = query_tiles<T>(p, s, n_block);
  const int count = max(tiles.end - tiles.first, 0);
  bool staggered = false;
  using Vis = decltype(visibility_of<T>(p, s));
  if constexpr (!Vis::kRightEdge && !Vis::kLeftEdge) {
    staggered = p.staggered_sweep != 0 && ceil_div(s.seqlen_k, T::kBlockN) <= count;
  }
  return {tiles.first, count, staggered, staggered ? n_block : 0};
}

// Key tile n_block's turn among the key tiles that add to query tile m's dQ in a deterministic
// call (0: the first to add). Those key tiles are visible_key_tiles of m's rows, one unbroken
// range: they add from the last down to the first, or, staggered (every key tile visits every
// query tile, query tile i of the sweep at step (i - n) mod count), in the order they reach m:
// min(i, n_last), its predecessor, ..., wrapping from key tile 0 to n_last.
template <class T, class Vis>
__device__ __forceinline__ int dq_turn(QuerySweep const& sweep, Vis const& vis, Sequence const& s, int m,
                                       int n_block) {
  const int n_tiles = ceil_div(s.seqlen_k, T::kBlockN);
  if (sweep.staggered) {
    const int leader = min(m - sweep.first, n_tiles - 1);
    return (leader - n_block + n_tiles) % n_tiles;
  }
  const int row0 = m * T::kBlockM;
  return visible_key_tiles<T::kBlockN>(vis, row0, row0 + T::kBlockM, n_tiles).end - 1 - n_block;
}

// A bias shared by several (batch entry, head) pairs, broadcast over batch entries or heads but
// not rows: its dBias tile (m, n) is the sum of their dS tiles, which their CTAs add to
// p.dbias_sum; in a deterministic call (p.dbias_semaphore) in the order of `member` (their
// position among the pairs that share the slice, batch entries before heads), where the count of
// (slice, m, n) says how many have added; else in any order.
struct DbiasShare {
  int slice, member;
};

__device__ __forceinline__ DbiasShare dbias_share(HopperBwdParams const& p, int batch, int head) {
  const int slices_per_entry = p.bias_head_step ? p.heads_q : 1;
  const int members_per_entry = p.bias_head_step ? 1 : p.heads_q;
  return {(p.bias_batch_step ? batch * slices_per_entry : 0) + (p.bias_head_step ? head : 0),
          (p.bias_batch_step ? 0 : batch * members_per_entry) + (p.bias_head_step ? 0 : head)};
}

// A CTA's place in the grid (key tiles, heads, batch entries or sequences): its key tile slot x
// (n_block before a deterministic call's reversal), head and entry.
struct BwdBlock {
  int x, head, entry;
};

// Where the (batch entry, head) pairs that share a bias slice add their dS into one fp32 plane
// (p.dbias_sum), they run in groups of up to members_inner side by side, innermost, then the key
// tiles, then the next group. In the grid's own order each pair swept the whole plane before the
// next one started, more than L2 holds, so that the plane went to DRAM and back once per pair
// (docs/perf.md v47). But every pair of a group adds into the same tile at the same time, which
// costs more the longer a pair's tile takes: groups of 8 measured best up to d_qk 128, groups of
// 4 above (docs/perf.md v51). A pair keeps its key tiles' order, and lower members
// (dbias_share's) start first, as the deterministic turns need.
template <class T>
inline constexpr int members_inner = T::kDimQK > 128 ? 4 : 8;

template <class T>
__device__ __forceinline__ BwdBlock bwd_block(HopperBwdParams const& p) {
  if constexpr (T::kBiasGrad) {
    if (p.dbias_sum != 0) {
      const bool over_heads = p.bias_head_step == 0, over_entries = p.bias_batch_step == 0;
      const int keys = gridDim.x, heads = gridDim.y, entries = gridDim.z;
      const int members = (over_heads ? heads : 1) * (over_entries ? entries : 1);
      int group = members;
      if (group > members_inner<T>) {
        group = members_inner<T>;
        while (members % group != 0) {
          group /= 2;
        }
      }
      const int linear = int(blockIdx.x) + keys * (int(blockIdx.y) + heads * int(blockIdx.z));
      const int x = linear / group % keys;
      const int rest = linear / group / keys;  // (group, slice)
      const int groups = members / group;
      const int member = linear % group + group * (rest % groups);  // heads inner, as dbias_share counts
      const int slice = rest / groups;
      const int head = over_heads ? member % heads : slice % heads;
      const int entry = over_entries ? (over_heads ? member / heads : member) : (over_heads ? slice : slice / heads);
      return {x, head, entry};
    }
  }
  return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
}

}  // namespace flashkiln::hopper
