// Where the workspace route keeps dS: the main kernel (one CTA per key tile) writes the tiles of
// the pairs it visits (common/visibility.hpp, visiting_query_tiles) and the dQ kernel (one CTA
// per query tile) reads those of the dual rule, visible_key_tiles over whole query tiles, so it
// reads exactly the tiles written.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/math.hpp>
#include <flashkiln/params.hpp>

namespace flashkiln::portable {

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
