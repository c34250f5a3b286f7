// Register- and shared-memory-level building blocks of the portable family: fragment layout
// views, predicated tile copies and the two GEMM shapes of attention.
#pragma once

#include <cute/tensor.hpp>

namespace flashkiln::portable {

using namespace cute;

// View an m16n8 accumulator fragment ((2,2), MMA_M, MMA_N) as (rows, cols) = ((2, MMA_M), (2, MMA_N)).
// Within an atom a thread holds columns (2c, 2c+1) of rows r and r+8: mode 0,0 is the column
// pair and mode 0,1 the row pair.
template <class Layout>
__device__ __forceinline__ constexpr auto rowcol_view(Layout const& acc) {
  static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 2);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

// View an m16n8 accumulator fragment ((2,2), MMA_M, MMA_N) as the A operand of an m16n8k16 MMA:
// ((2,2,2), MMA_M, MMA_N / 2). Two n8 accumulator tiles side by side hold exactly the values a
// thread supplies for one k16 slice, in the same order.
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_operand_a(Layout const& acc) {
  static_assert(size<2>(Layout{}) % 2 == 0);
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2,2), MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
}

template <class Tensor>
__device__ __forceinline__ auto rowcol(Tensor&& t) {
  return make_tensor(t.data(), rowcol_view(t.layout()));
}

// Copy the rows of a (CPY, CPY_ROWS, CPY_COLS) partition whose row coordinate (from the
// matching partition of an identity tensor) is below `row_limit`. Loads zero-fill the other
// rows, so keys past the sequence end contribute exactly nothing (0 * garbage could be NaN).
template <bool kZeroFillRest, class TiledCopy, class Src, class Dst, class Coord>
__device__ __forceinline__ void copy_rows(TiledCopy const& tiled_copy, Src const& src, Dst&& dst,
                                          Coord const& coord, int row_limit) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < row_limit) {
      copy(tiled_copy, src(_, m, _), dst(_, m, _));
    } else if constexpr (kZeroFillRest) {
      clear(dst(_, m, _));
    }
  }
}

// Copy the 16-byte pieces of a (CPY, CPY_ROWS, CPY_COLS) partition whose first element lies
// below `row_limit` and left of `col_limit`; loads zero-fill the others.
template <bool kZeroFillRest, class TiledCopy, class Src, class Dst, class Coord>
__device__ __forceinline__ void copy_rows_cols(TiledCopy const& tiled_copy, Src const& src, Dst&& dst,
                                               Coord const& coord, int row_limit, int col_limit) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      if (get<0>(coord(0, m, k)) < row_limit && get<1>(coord(0, m, k)) < col_limit) {
        copy(tiled_copy, src(_, m, k), dst(_, m, k));
      } else if constexpr (kZeroFillRest) {
        clear(dst(_, m, k));
      }
    }
  }
}

// acc += A B with both operands in shared memory; the ldmatrix loads run one k-slice ahead of
// the MMAs so that each MMA's operands are already in registers.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemA, class SmemB, class CopyA, class CopyB,
          class ThrCopyA, class ThrCopyB>
__device__ __forceinline__ void gemm_smem_smem(TiledMma& mma, Acc& acc, RegA& rA, RegB& rB, SmemA const& sA,
                                               SmemB const& sB, CopyA const& copy_a, CopyB const& copy_b,
                                               ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b) {
  auto rA_view = thr_copy_a.retile_D(rA);
  auto rB_view = thr_copy_b.retile_D(rB);
  copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A B with A already in registers (the probabilities P) and B in shared memory.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemB, class CopyB, class ThrCopyB>
__device__ __forceinline__ void gemm_regs_smem(TiledMma& mma, Acc& acc, RegA const& rA, RegB& rB, SmemB const& sB,
                                               CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  auto rB_view = thr_copy_b.retile_D(rB);
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// Writes an (N, d) accumulator scaled by `scale` to rows below `row_limit` of a global tile,
// converted to the tile's element type; `coord` is the identity partition of the accumulator.
template <class Acc, class Dst, class Coord>
__device__ __forceinline__ void store_accumulator(Acc const& acc, Dst&& dst, Coord const& coord, float scale,
                                                  int row_limit) {
  using Out = typename cute::remove_cvref_t<Dst>::value_type;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    if (get<0>(coord(i)) < row_limit) {
      dst(i) = static_cast<Out>(acc(i) * scale);
    }
  }
}

// The (rows, kDim) row-major matrix at `base` (head dim contiguous), cut into (kRows, kDim) tiles;
// `tile` picks one (an index) or keeps them all as a trailing mode (`_`).
template <int kRows, int kDim, class Element, class Tile>
__device__ __forceinline__ auto gmem_tiles(Element* base, int rows, int64_t row_stride, Tile tile) {
  return local_tile(make_tensor(make_gmem_ptr(base), make_shape(rows, Int<kDim>{}), make_stride(row_stride, _1{})),
                    Shape<Int<kRows>, Int<kDim>>{}, make_coord(tile, 0));
}

// The same shared-memory partition shifted to another pipeline stage's buffer.
template <class Tensor>
__device__ __forceinline__ auto at_offset(Tensor const& t, int elements) {
  return make_tensor(t.data() + elements, t.layout());
}

}  // namespace flashkiln::portable
