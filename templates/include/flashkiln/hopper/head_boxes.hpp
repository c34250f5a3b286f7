// How the hopper kernels lay out a head dim's tiles (Q, K, V, O, dO) in shared memory: in TMA
// boxes as wide as the widest swizzle atom that divides the head dim, 128 bytes (64 columns) where
// it is a multiple of 64, else 64 bytes (32 columns: d 96). Mirrored by runtime/tma.py
// (head_box_cols), which encodes the tensor maps' boxes and swizzle to match.
#pragma once

#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace flashkiln::hopper {

// Columns of 2-byte elements per box of a head dim.
__host__ __device__ constexpr int head_box_cols(int dim) { return dim % 64 == 0 ? 64 : 32; }

// The K-major layout atom of such a tile: 8 rows by one box, swizzled across the box's width.
template <class Element, int kDim>
using HeadSmemAtom = cute::conditional_t<head_box_cols(kDim) == 64, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                         cute::GMMA::Layout_K_SW64_Atom<Element>>;

}  // namespace flashkiln::hopper
