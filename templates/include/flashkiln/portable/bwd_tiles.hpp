// Which (query tile, key tile) pairs the backward's main kernel visits, and where the
// deterministic workspace route keeps each pair's dS tile. The main kernel (one CTA per key tile)
// and the dQ kernel (one CTA per query tile) both derive their loops from here, so the dQ kernel
// reads exactly the dS tiles the main kernel wrote.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common.hpp>
#include <flashkiln/params.hpp>

namespace flashkiln::portable {

// The first query tile that sees a key of key tile `n_block` (query i sees key j iff
// j <= i + causal_offset); every later query tile sees one too.
template <Causal kCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ int first_query_tile(int n_block, int causal_offset) {
  if constexpr (kCausal == Causal::none) {
    return 0;
  } else {
    const int first_row = n_block * kBlockN - causal_offset;
    return first_row <= 0 ? 0 : first_row / kBlockM;
  }
}

// How many key tiles (0, 1, ...) visit query tile `m_block`: those with
// first_query_tile(n) <= m_block, i.e. n * kBlockN < (m_block + 1) * kBlockM + causal_offset.
template <Causal kCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ int visiting_key_tiles(int m_block, int n_tiles, int causal_offset) {
  if constexpr (kCausal == Causal::none) {
    return n_tiles;
  } else {
    const int bound = (m_block + 1) * kBlockM + causal_offset;
    return bound <= 0 ? 0 : min(n_tiles, ceil_div(bound, kBlockN));
  }
}

// The dS tile of one (head, query tile, key tile) pair in the workspace: tiles are dense
// (kBlockM, kBlockN) row-major blocks, ordered (batch * heads_q + head, m_block, n_block).
template <class Element, int kBlockM, int kBlockN>
__device__ __forceinline__ auto ds_workspace_tile(BwdParams const& p, int64_t bh, int m_block, int n_block) {
  const int64_t m_tiles = ceil_div(p.seqlen_q, kBlockM);
  const int64_t n_tiles = ceil_div(p.seqlen_k, kBlockN);
  Element* tile = reinterpret_cast<Element*>(p.ds_workspace) +
                  ((bh * m_tiles + m_block) * n_tiles + n_block) * (kBlockM * kBlockN);
  return cute::make_tensor(cute::make_gmem_ptr(tile),
                           cute::Layout<cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>,
                                        cute::Stride<cute::Int<kBlockN>, cute::_1>>{});
}

}  // namespace flashkiln::portable
