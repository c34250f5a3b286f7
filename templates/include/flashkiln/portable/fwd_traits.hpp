// Compile-time configuration of the portable (mma.sync) attention forward: tile shapes, the
// tiled MMA, shared-memory layouts and copy atoms. Everything here derives from the template
// arguments, which the generator renders from one variant descriptor.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>

#include <flashkiln/common.hpp>

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

// mma.sync.m16n8k16 with fp32 accumulators for the element type.
template <class Element>
using Sm80MmaAtom = cute::conditional_t<cute::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                        SM80_16x8x16_F32BF16BF16F32_TN>;

template <class Element_, int kDimQK_, int kDimV_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_,
          Causal kCausal_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kDimQK = kDimQK_;
  static constexpr int kDimV = kDimV_;
  static constexpr int kBlockM = kBlockM_;  // query rows per CTA
  static constexpr int kBlockN = kBlockN_;  // key rows per main-loop step
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  // 1: one K and one V buffer, loads staggered (K of the next step streams in during softmax and
  // P V, V during Q K^T). 2: K and V double-buffered, a whole step ahead.
  static constexpr int kStages = kStages_;
  static constexpr Causal kCausal = kCausal_;

  static_assert(cute::is_same_v<Element, cutlass::half_t> || cute::is_same_v<Element, cutlass::bfloat16_t>);
  static_assert(kStages == 1 || kStages == 2, "stages must be 1 or 2");
  // Warps split the query rows; each warp owns whole 16-row MMA tiles.
  static_assert(kBlockM % (16 * kWarps) == 0, "tile_m must be a multiple of 16 * warps");
  static_assert(kBlockN % 16 == 0, "tile_n must be a multiple of 16 (the k-step of P V)");

  using MmaAtom = Sm80MmaAtom<Element>;
  // N tile of 16 so that one ldmatrix.x4 feeds two n8 MMAs of the B operand.
  using TiledMma = TiledMMA<MMA_Atom<MmaAtom>, Layout<Shape<Int<kWarps>, _1, _1>>, Tile<Int<16 * kWarps>, _16, _16>>;

  using SmemLayoutQ = typename SmemTile<Element, kBlockM, kDimQK>::Layout;
  using SmemLayoutK = typename SmemTile<Element, kBlockN, kDimQK>::Layout;
  using SmemLayoutV = typename SmemTile<Element, kBlockN, kDimV>::Layout;
  using SmemLayoutO = typename SmemTile<Element, kBlockM, kDimV>::Layout;
  // V seen as (d_v, key): the B operand of P V, read with transposing ldmatrix.
  using SmemLayoutVt =
      decltype(composition(SmemLayoutV{}, make_layout(Shape<Int<kDimV>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtPlain = decltype(get_nonswizzle_portion(SmemLayoutVt{}));

  using SmemLoad = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemLoadTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemStoreO = Copy_Atom<DefaultCopy, Element>;

  using GmemCopyQK = GmemTileCopy<Element, kThreads, kDimQK>;
  using GmemCopyVO = GmemTileCopy<Element, kThreads, kDimV>;
  static_assert(kBlockM % GmemCopyQK::kRowsPerPass == 0 && kBlockN % GmemCopyQK::kRowsPerPass == 0);
  static_assert(kBlockM % GmemCopyVO::kRowsPerPass == 0 && kBlockN % GmemCopyVO::kRowsPerPass == 0);

  // Shared memory: Q (reused for O after the main loop), then kStages x (K, V).
  static constexpr int kElemsQO = kBlockM * (kDimQK > kDimV ? kDimQK : kDimV);
  static constexpr int kElemsK = kBlockN * kDimQK;
  static constexpr int kElemsV = kBlockN * kDimV;
  static constexpr int kSmemBytes = int(sizeof(Element)) * (kElemsQO + kStages * (kElemsK + kElemsV));
};

}  // namespace flashkiln::portable
