// Which (query tile, key tile) pairs the backward's main kernel visits, and where the
// workspace route keeps dS. The main kernel (one CTA per key tile)
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

// The dS workspace of the workspace route: dense (batch * heads_q, seqlen_q, ld) row-major, with
// rows padded to whole 16-byte pieces (ld = seqlen_k rounded up to 8 elements), so that dBias of
// a full bias is a view of it. A packed batch's sequences each take the top-left corner of their
// (batch, head) plane, whose sides are the longest sequence lengths. Returns one (batch, head)'s
// dS as (kBlockM, kBlockN) tiles, (M, N, m, n).
template <class Element, int kBlockM, int kBlockN>
__device__ __forceinline__ auto ds_workspace_tiles(BwdParams const& p, int64_t bh) {
  static_assert(sizeof(Element) == 2, "rows are padded to multiples of 8 two-byte elements");
  const int64_t ld = ceil_div(p.seqlen_k, 8) * 8;
  Element* base = reinterpret_cast<Element*>(p.ds_workspace) + bh * p.seqlen_q * ld;
  auto ds = cute::make_tensor(cute::make_gmem_ptr(base), cute::make_shape(p.seqlen_q, p.seqlen_k),
                              cute::make_stride(ld, cute::_1{}));
  return cute::local_tile(ds, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{},
                          cute::make_coord(cute::_, cute::_));
}

}  // namespace flashkiln::portable
