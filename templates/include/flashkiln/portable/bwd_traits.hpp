// Compile-time configuration of the portable attention backward: the main kernel (one CTA per key
// tile, looping over query tiles: three tiled MMAs, shared-memory layouts and their transposed
// views) and the dQ kernel of the deterministic workspace route (one CTA per query tile).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <flashkiln/common/score_mods.hpp>
#include <flashkiln/portable/tile_traits.hpp>

namespace flashkiln::portable {

using namespace cute;

// How many of `warps` split the rows of an (rows, cols) accumulator (the rest split the cols): 32
// rows per warp where the tile allows, fewer when the column split would not divide `cols`.
constexpr int row_warps(int rows, int cols_a, int cols_b, int warps) {
  int wm = rows / 32 < warps ? rows / 32 : warps;
  wm = wm < 1 ? 1 : wm;
  while (wm < warps && (rows % (16 * wm) || cols_a % (16 * (warps / wm)) || cols_b % (16 * (warps / wm)))) {
    wm *= 2;
  }
  return wm;
}

template <class Element_, int kDimQK_, int kDimV_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_,
          Causal kCausal_, bool kDeterministic_, bool kBias_, bool kWindow_, bool kSoftcap_>
struct BwdTraits : TileCopies<Element_, 32 * kWarps_, kDimQK_, kDimV_, kBlockM_, kBlockN_>,
                   ScoreMods<kCausal_, kBias_, kWindow_, kSoftcap_> {
  using Element = Element_;
  static constexpr int kDimQK = kDimQK_;
  static constexpr int kDimV = kDimV_;
  static constexpr int kBlockM = kBlockM_;  // query rows per inner step
  static constexpr int kBlockN = kBlockN_;  // key rows owned by the CTA
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  // Buffers of the Q and dO ring: with 2, the next query tile streams in during this one.
  static constexpr int kStages = kStages_;
  // dQ contributions of the key tiles are added in key-tile order (bitwise reproducible).
  static constexpr bool kDeterministic = kDeterministic_;

  static_assert(cute::is_same_v<Element, cutlass::half_t> || cute::is_same_v<Element, cutlass::bfloat16_t>);
  static_assert(kWarps == 4 || kWarps == 8, "backward warps must be 4 or 8");
  static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0);
  static_assert(kStages == 1 || kStages == 2, "stages must be 1 or 2");
  // Warp grids of the three GEMM shapes (see row_warps).
  static constexpr int kWarpsSdP = row_warps(kBlockM, kBlockN, kBlockN, kWarps);
  static constexpr int kWarpsKV = row_warps(kBlockN, kDimQK, kDimV, kWarps);
  static constexpr int kWarpsQ = row_warps(kBlockM, kDimQK, kDimQK, kWarps);

  using MmaAtom = MMA_Atom<Sm80MmaAtom<Element>>;
  template <int kWarpsRows>
  using Mma = TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsRows>, Int<kWarps / kWarpsRows>, _1>>,
                       Tile<Int<16 * kWarpsRows>, Int<16 * (kWarps / kWarpsRows)>, _16>>;
  using TiledMmaSdP = Mma<kWarpsSdP>;  // S = Q K^T and dP = dO V^T: (M, N)
  using TiledMmaKV = Mma<kWarpsKV>;    // dV += P^T dO and dK += dS^T Q: (N, d)
  using TiledMmaQ = Mma<kWarpsQ>;      // dQ = dS K: (M, d_qk)
  static_assert(kBlockM % (16 * kWarpsSdP) == 0 && kBlockN % (16 * (kWarps / kWarpsSdP)) == 0,
                "tile_m / tile_n do not split over the warps of S = Q K^T");
  static_assert(kBlockN % (16 * kWarpsKV) == 0 && kDimQK % (16 * (kWarps / kWarpsKV)) == 0 &&
                    kDimV % (16 * (kWarps / kWarpsKV)) == 0,
                "tile_n / head dims do not split over the warps of dK, dV");
  static_assert(kBlockM % (16 * kWarpsQ) == 0 && kDimQK % (16 * (kWarps / kWarpsQ)) == 0,
                "tile_m / d_qk do not split over the warps of dQ");

  using SmemLayoutQ = typename SmemTile<Element, kBlockM, kDimQK>::Layout;
  using SmemLayoutdO = typename SmemTile<Element, kBlockM, kDimV>::Layout;
  using SmemLayoutK = typename SmemTile<Element, kBlockN, kDimQK>::Layout;
  using SmemLayoutV = typename SmemTile<Element, kBlockN, kDimV>::Layout;
  // P and dS of one (query tile, key tile) pair, stored to be re-read transposed.
  using SmemLayoutPdS = typename SmemTile<Element, kBlockM, kBlockN>::Layout;

  using SmemLayoutQt = TransposedView<SmemLayoutQ, kBlockM, kDimQK>;     // (d_qk, M)
  using SmemLayoutdOt = TransposedView<SmemLayoutdO, kBlockM, kDimV>;    // (d_v, M)
  using SmemLayoutKt = TransposedView<SmemLayoutK, kBlockN, kDimQK>;     // (d_qk, N)
  using SmemLayoutPdSt = TransposedView<SmemLayoutPdS, kBlockM, kBlockN>;  // (N, M)
  // Fragment shapes of the transposed operands (the swizzle does not change them).
  using SmemLayoutQtPlain = decltype(get_nonswizzle_portion(SmemLayoutQt{}));
  using SmemLayoutdOtPlain = decltype(get_nonswizzle_portion(SmemLayoutdOt{}));
  using SmemLayoutKtPlain = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  using SmemLayoutPdStPlain = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  // dS tiles to the workspace (deterministic workspace route) and bias tiles in: 16-byte copies.
  using GmemCopydS = DsTileCopy<Element, kThreads, kBlockM, kBlockN>;

  // Shared memory: kStages x (Q, dO), then K, V, then P and dS, then kStages bias tiles.
  static constexpr int kElemsQ = kBlockM * kDimQK;
  static constexpr int kElemsdO = kBlockM * kDimV;
  static constexpr int kElemsPdS = kBlockM * kBlockN;
  static constexpr int kElemsBias = kBias_ ? kBlockM * kBlockN : 0;  // a bias tile per Q/dO stage (bias.hpp)
  static constexpr int kSmemBytes = int(sizeof(Element)) * (kStages * (kElemsQ + kElemsdO + kElemsBias) +
                                                            kBlockN * (kDimQK + kDimV) + 2 * kElemsPdS);
};

// dQ = dS K for one query tile, over the dS tiles the main kernel wrote (deterministic workspace
// route). kBlockM and kBlockN must be the main kernel's tiles.
template <class Element_, int kDimQK_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_, Causal kCausal_,
          bool kWindow_>
struct DqTraits : TileCopies<Element_, 32 * kWarps_, kDimQK_, kDimQK_, kBlockM_, kBlockN_> {
  using Element = Element_;
  static constexpr int kDimQK = kDimQK_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = kStages_;  // buffers of the (dS, K) ring
  static constexpr Causal kCausal = kCausal_;
  // A sliding window (common/visibility.hpp): its reach is the call's (params' window_left/right).
  static constexpr bool kWindow = kWindow_;
  static_assert(kStages == 1 || kStages == 2, "stages must be 1 or 2");

  static constexpr int kWarpsQ = row_warps(kBlockM, kDimQK, kDimQK, kWarps);
  using TiledMmaQ = TiledMMA<MMA_Atom<Sm80MmaAtom<Element>>, Layout<Shape<Int<kWarpsQ>, Int<kWarps / kWarpsQ>, _1>>,
                             Tile<Int<16 * kWarpsQ>, Int<16 * (kWarps / kWarpsQ)>, _16>>;
  static_assert(kBlockM % (16 * kWarpsQ) == 0 && kDimQK % (16 * (kWarps / kWarpsQ)) == 0,
                "tile_m / d_qk do not split over the warps of dQ");

  using SmemLayoutdS = typename SmemTile<Element, kBlockM, kBlockN>::Layout;
  using SmemLayoutK = typename SmemTile<Element, kBlockN, kDimQK>::Layout;
  using SmemLayoutKt = TransposedView<SmemLayoutK, kBlockN, kDimQK>;  // (d_qk, N)
  using SmemLayoutKtPlain = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  using GmemCopydS = DsTileCopy<Element, kThreads, kBlockM, kBlockN>;

  // Shared memory: kStages x (dS tile, K tile).
  static constexpr int kElemsdS = kBlockM * kBlockN;
  static constexpr int kElemsK = kBlockN * kDimQK;
  static constexpr int kSmemBytes = int(sizeof(Element)) * kStages * (kElemsdS + kElemsK);
};

}  // namespace flashkiln::portable
