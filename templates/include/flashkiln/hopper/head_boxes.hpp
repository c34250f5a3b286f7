// How the hopper kernels lay out a head dim's tiles (Q, K, V, O, dO) in shared memory: in TMA
// boxes as wide as the widest swizzle atom that divides the columns each consumer warpgroup takes
// of the head dim (all of them, or 1 / `parts` where the warpgroups split them): 128 bytes (64
// columns), else 64 bytes (32 columns: d 96, or d 192 split in two). Mirrored by runtime/tma.py
// (head_box_cols), which encodes the tensor maps' boxes and swizzle to match.
#pragma once

#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace flashkiln::hopper {

// Columns of 2-byte elements per box of a head dim whose columns `parts` warpgroups split.
__host__ __device__ constexpr int head_box_cols(int dim, int parts = 1) { return dim / parts % 64 == 0 ? 64 : 32; }

// The K-major layout atom of a tile in boxes of kBoxCols columns: 8 rows by one box, swizzled
// across the box's width.
template <class Element, int kBoxCols>
using BoxSmemAtom = cute::conditional_t<kBoxCols == 64, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                        cute::GMMA::Layout_K_SW64_Atom<Element>>;

}  // namespace flashkiln::hopper
