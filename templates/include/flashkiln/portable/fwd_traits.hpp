// Compile-time configuration of the portable (mma.sync) attention forward: tile shapes, the
// tiled MMA, shared-memory layouts and copy atoms. Everything here derives from the template
// arguments, which the generator renders from one variant descriptor.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <flashkiln/common/score_mods.hpp>
#include <flashkiln/portable/tile_traits.hpp>

namespace flashkiln::portable {

using namespace cute;

template <class Element_, int kDimQK_, int kDimV_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_,
          Causal kCausal_, bool kBias_, bool kWindow_, bool kSoftcap_>
struct FwdTraits : TileCopies<Element_, 32 * kWarps_, kDimQK_, kDimV_, kBlockM_, kBlockN_>,
                   ScoreMods<kCausal_, kBias_, kWindow_, kSoftcap_> {
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
  using SmemLayoutVt = TransposedView<SmemLayoutV, kBlockN, kDimV>;
  using SmemLayoutVtPlain = decltype(get_nonswizzle_portion(SmemLayoutVt{}));

  // Shared memory: Q (reused for O after the main loop), then kStages x (K, V), then the bias tile.
  static constexpr int kElemsQO = kBlockM * (kDimQK > kDimV ? kDimQK : kDimV);
  static constexpr int kElemsK = kBlockN * kDimQK;
  static constexpr int kElemsV = kBlockN * kDimV;
  static constexpr int kElemsBias = kBias_ ? kBlockM * kBlockN : 0;  // one bias tile buffer (bias.hpp)
  static constexpr int kSmemBytes = int(sizeof(Element)) * (kElemsQO + kStages * (kElemsK + kElemsV) + kElemsBias);
};

}  // namespace flashkiln::portable
