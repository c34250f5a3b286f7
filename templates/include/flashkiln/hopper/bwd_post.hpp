// The Hopper backward's postprocess: dQ = scale * dQ_accum, from the accumulator's tile order
// (hopper/bwd_dq_tiles.hpp) to the element type by dQ's strides. A CTA per (query tile, head,
// sequence); each thread reads pairs of columns in the accumulator's order (coalesced).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <flashkiln/common/sequence.hpp>
#include <flashkiln/hopper/bwd_dq_tiles.hpp>
#include <flashkiln/params.hpp>

namespace flashkiln::hopper {

template <class Element_, int kDim_, int kBlockN_, int kThreads_>
struct BwdPostTraits {
  using Element = Element_;
  static constexpr int kDim = kDim_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kParts = dq_tile_parts(kDim, kBlockN_ / 64);  // as the main kernel's BwdTraits
  using DqLayout = DqTileLayout<kDim, kParts>;
  static_assert(kThreads == 128, "a thread per accumulator thread of the m64 fragment");
  static constexpr int kSmemBytes = 0;
};

template <class T>
__device__ __forceinline__ void bwd_postprocess(BwdParams const& p) {
  using Element = typename T::Element;
  using Layout = typename T::DqLayout;
  const int t = threadIdx.x;
  const int m = blockIdx.x;
  const int head = blockIdx.y;
  const Sequence s = sequence_of(p, blockIdx.z);
  if (m * kDqTileRows >= s.seqlen_q) {
    return;  // a packed batch's grid covers its longest sequence
  }
  float const* tile =
      reinterpret_cast<float const*>(p.dq_accum) + (s.dq_accum_row(p, head) + m * kDqTileRows) * T::kDim;
  Element* dq = reinterpret_cast<Element*>(p.dq) + s.q_offset(p.dq_batch_stride, p.dq_row_stride) +
                head * p.dq_head_stride;
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int part = 0; part < T::kParts; ++part) {
    CUTE_UNROLL
    for (int pair = 0; pair < Layout::kCols / 4; ++pair) {
      const int row = m * kDqTileRows + 16 * (t / 32) + (t % 32) / 4 + 8 * (pair % 2);
      const int col = part * Layout::kCols + 8 * (pair / 2) + 2 * (t % 4);
      const float2 value = reinterpret_cast<float2 const*>(tile + part * Layout::kPartFloats)[pair * 128 + t];
      if (row < s.seqlen_q) {
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dq + row * p.dq_row_stride + col) =
            convert(cutlass::Array<float, 2>{value.x * p.scale, value.y * p.scale});
      }
    }
  }
}

}  // namespace flashkiln::hopper
