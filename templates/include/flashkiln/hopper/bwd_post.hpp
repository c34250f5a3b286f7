// The Hopper backward's postprocess: dQ = scale * dQ_accum, from the accumulator's tile order
// (hopper/bwd_dq_tiles.hpp) to the element type by dQ's strides. A CTA per (query tile, head,
// sequence): it reads the tile in the accumulator's order (coalesced), stages it row-major in
// shared memory and writes dQ's rows in 16-byte pieces.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <flashkiln/common/sequence.hpp>
#include <flashkiln/hopper/bwd_dq_tiles.hpp>
#include <flashkiln/params.hpp>

namespace flashkiln::hopper {

template <class Element_, int kDim_, int kThreads_>
struct BwdPostTraits {
  using Element = Element_;
  static constexpr int kDim = kDim_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kParts = dq_tile_parts(kDim);  // as the main kernel's BwdTraits
  using DqLayout = DqTileLayout<kDim, kParts>;
  static_assert(kThreads == 128, "a thread per accumulator thread of the m64 fragment");
  static constexpr int kSmemBytes = 0;
};

template <class T>
__device__ __forceinline__ void bwd_postprocess(BwdParams const& p) {
  using Element = typename T::Element;
  using Layout = typename T::DqLayout;
  constexpr int kCols = T::kDim;
  constexpr int kLd = kCols + 8;  // a 16-byte pad per row: rows start in different banks
  constexpr int kChunks = kCols / 8;  // 16-byte pieces per row
  __shared__ alignas(16) Element staged[kDqTileRows * kLd];
  const int t = threadIdx.x;
  const int m = blockIdx.x;
  const int head = blockIdx.y;
  const Sequence s = sequence_of(p, blockIdx.z);
  if (m * kDqTileRows >= s.seqlen_q) {
    return;  // a packed batch's grid covers its longest sequence
  }
  // The tile in 16-byte pieces (coalesced), each the column pairs of two neighbouring threads,
  // scaled and converted into a row-major tile in shared memory.
  float4 const* tile = reinterpret_cast<float4 const*>(reinterpret_cast<float const*>(p.dq_accum) +
                                                       (s.dq_accum_row(p, head) + m * kDqTileRows) * T::kDim);
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int i = 0; i < Layout::kTileFloats / 4 / T::kThreads; ++i) {
    const int q = i * T::kThreads + t;
    const float4 value = tile[q];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const auto [row, col] = Layout::pair_position(4 * q + 2 * h);
      const float x = h == 0 ? value.x : value.z, y = h == 0 ? value.y : value.w;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(staged + row * kLd + col) =
          convert(cutlass::Array<float, 2>{x * p.scale, y * p.scale});
    }
  }
  __syncthreads();
  Element* dq = reinterpret_cast<Element*>(p.dq) + s.q_offset(p.dq_batch_stride, p.dq_row_stride) +
                head * p.dq_head_stride;
  // 16-byte stores: the runtime passes dQ in a kernel layout (inputs.is_kernel_layout); 4-byte
  // ones for a caller of the kernel that does not.
  const bool wide = (reinterpret_cast<uintptr_t>(dq) | uintptr_t(p.dq_row_stride * sizeof(Element))) % 16 == 0;
  CUTE_UNROLL
  for (int i = 0; i < kDqTileRows * kChunks / T::kThreads; ++i) {
    const int c = i * T::kThreads + t;
    const int r = c / kChunks;
    const int col = c % kChunks * 8;
    const int row = m * kDqTileRows + r;
    if (row < s.seqlen_q) {
      const uint4 piece = *reinterpret_cast<uint4 const*>(staged + r * kLd + col);
      Element* out = dq + row * p.dq_row_stride + col;
      if (wide) {
        *reinterpret_cast<uint4*>(out) = piece;
      } else {
        uint32_t const* words = reinterpret_cast<uint32_t const*>(&piece);
        CUTE_UNROLL
        for (int w = 0; w < 4; ++w) {
          reinterpret_cast<uint32_t*>(out)[w] = words[w];
        }
      }
    }
  }
}

}  // namespace flashkiln::hopper
