// Building blocks shared by the portable family's traits: swizzled shared-memory tiles, 16-byte
// global<->shared tile copies, the mma.sync atom and the ldmatrix/store atoms.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>

namespace flashkiln::portable {

using namespace cute;

// A (rows, dim) row-major tile in shared memory. Rows are grouped into 8 x 64 (or 8 x 32)
// element atoms whose 16-byte chunks are XOR-swizzled by row, so that both the 16-byte cp.async
// writes and the ldmatrix reads of eight consecutive rows land in distinct banks.
template <class Element, int kRows, int kDim>
struct SmemTile {
  static_assert(kDim % 32 == 0, "head dims are multiples of 32");
  static constexpr int kAtomCols = kDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kAtomCols == 64 ? 3 : 2;
  using Atom = decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                                    Layout<Shape<_8, Int<kAtomCols>>, Stride<Int<kAtomCols>, _1>>{}));
  using Layout = decltype(tile_to_shape(Atom{}, Shape<Int<kRows>, Int<kDim>>{}));
};

// Global <-> shared copies of a (rows, dim) tile: each thread moves 16 bytes per access, the
// threads of a row cover one swizzle atom's width, so a warp touches whole 128-byte lines.
template <class Element, int kThreads, int kDim>
struct GmemTileCopy {
  static constexpr int kElemsPerAccess = 16 / sizeof(Element);
  static constexpr int kThreadsPerRow = SmemTile<Element, 8, kDim>::kAtomCols / kElemsPerAccess;
  static constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  using ThreadLayout = Layout<Shape<Int<kRowsPerPass>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using ValueLayout = Layout<Shape<_1, Int<kElemsPerAccess>>>;
  using AsyncLoad = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
                                             ThreadLayout{}, ValueLayout{}));
  using Move = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, ThreadLayout{},
                                        ValueLayout{}));
};

// 16-byte copies of (kRows, kCols) score-shaped tiles (dS, bias) between global and shared memory.
template <class Element, int kThreads, int kRows, int kCols>
struct DsTileCopy : GmemTileCopy<Element, kThreads, kCols> {
  static_assert(kRows % GmemTileCopy<Element, kThreads, kCols>::kRowsPerPass == 0,
                "tile_m must be a multiple of the rows one pass of 16-byte copies covers (tile_n wide)");
};

// mma.sync.m16n8k16 with fp32 accumulators for the element type.
template <class Element>
using Sm80MmaAtom = cute::conditional_t<cute::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                        SM80_16x8x16_F32BF16BF16F32_TN>;

// A (cols, rows) view of a (rows, cols) shared-memory layout: the transposed operand of a GEMM,
// read with transposing ldmatrix.
template <class Layout, int kRows, int kCols>
using TransposedView = decltype(composition(Layout{}, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{})));

// Copy atoms and tile copies of a kernel whose tiles are (kBlockM or kBlockN) rows of Q/K (d_qk
// wide) and V/O/dO (d_v wide).
template <class Element, int kThreads, int kDimQK, int kDimV, int kBlockM, int kBlockN>
struct TileCopies {
  using SmemLoad = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemLoadTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemStore = Copy_Atom<DefaultCopy, Element>;
  using GmemCopyQK = GmemTileCopy<Element, kThreads, kDimQK>;
  using GmemCopyVO = GmemTileCopy<Element, kThreads, kDimV>;
  static_assert(kBlockM % GmemCopyQK::kRowsPerPass == 0 && kBlockN % GmemCopyQK::kRowsPerPass == 0,
                "tile rows must be a multiple of the rows one pass of 16-byte copies covers (d_qk)");
  static_assert(kBlockM % GmemCopyVO::kRowsPerPass == 0 && kBlockN % GmemCopyVO::kRowsPerPass == 0,
                "tile rows must be a multiple of the rows one pass of 16-byte copies covers (d_v)");
};

}  // namespace flashkiln::portable
