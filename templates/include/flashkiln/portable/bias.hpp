// The additive score bias: S = scale * Q K^T + bias, with bias (batch, heads_q, seqlen_q,
// seqlen_k) read by strides (0 where it broadcasts) and a contiguous key dim whose rows the host
// pads to whole 16-byte pieces. Tiles come through shared memory with 16-byte cp.async; each
// thread then adds the entries of its accumulator fragment. The kernels keep the raw Q K^T in
// their accumulators and apply the scale later, so the bias is added divided by the scale. In a
// packed batch, sequence b reads the top-left corner of plane b, whose sides are the longest
// sequence lengths.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <flashkiln/portable/tile_traits.hpp>

namespace flashkiln::portable {

using namespace cute;

// The bias tile's shared-memory layout and 16-byte copies. A kernel names these only where it has a
// bias (inside `if constexpr`), so that tiles a bias could not take (tile_n not a multiple of 32)
// stay legal without one.
template <class Element, int kThreads, int kBlockM, int kBlockN>
struct BiasTile {
  using SmemLayout = typename SmemTile<Element, kBlockM, kBlockN>::Layout;
  using GmemCopy = DsTileCopy<Element, kThreads, kBlockM, kBlockN>;
};

// The bias of one (batch, query head) as (kBlockM, kBlockN) tiles: (M, N, m, n).
template <int kBlockM, int kBlockN, class Element, class Params>
__device__ __forceinline__ auto gmem_bias_tiles(Params const& p, int batch, int head) {
  auto base = reinterpret_cast<Element const*>(p.bias) + batch * p.bias_batch_stride + head * p.bias_head_stride;
  auto bias = make_tensor(make_gmem_ptr(base), make_shape(p.seqlen_q, p.seqlen_k),
                          make_stride(p.bias_row_stride, _1{}));
  return local_tile(bias, Shape<Int<kBlockM>, Int<kBlockN>>{}, make_coord(_, _));
}

// acc += bias / scale; `bias` is the MMA's C partition of the shared tile. Accumulator fragments
// start with a column pair (2c, 2c+1), adjacent in shared memory too (the swizzle moves whole
// 16-byte pieces), so each pair is one 4-byte load and one paired conversion.
template <class Acc, class Bias>
__device__ __forceinline__ void add_bias(Acc& acc, Bias const& bias, float inv_scale) {
  using Element = typename cute::remove_cvref_t<Bias>::value_type;
  static_assert(decltype(size(acc))::value == decltype(size(bias))::value);
  static_assert(decltype(size<0, 0>(acc))::value == 2, "accumulator fragments start with a column pair");
  cutlass::NumericArrayConverter<float, Element, 2> convert;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const auto pair = convert(*reinterpret_cast<cutlass::Array<Element, 2> const*>(&bias(i)));
    acc(i) = fmaf(pair[0], inv_scale, acc(i));
    acc(i + 1) = fmaf(pair[1], inv_scale, acc(i + 1));
  }
}

}  // namespace flashkiln::portable
