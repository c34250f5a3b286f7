// A thread's wgmma accumulator entries in a shared-memory tile laid out as TMA reads and writes
// it: (rows, cols) in 64-column boxes of 128 bytes, 128-byte swizzled, so that the byte offset of
// (r, c) is (c / 64) * rows * 128 + r * 128 + ((c % 64 / 8) ^ (r % 8)) * 16 + (c % 8) * 2; or, for
// a head dim of 64-byte swizzled boxes (hopper/head_boxes.hpp: d 96), in 32-column boxes of 64
// bytes, whose 16-byte chunk c % 32 / 8 is XORed with (r / 2) % 4 (kBoxCols = 32 below).
//
// A thread's entries sit at its first entry (r0, c0) plus row offsets that are multiples of 8 and
// column offsets that are multiples of 8 (or the pair's second column), so r % 8 and c % 8 are the
// thread's own; where the 16-byte chunk bits of c0 % 64 and of the column offsets are disjoint (c0
// < 8, or a warpgroup's 32-column half of a box from column 32), every entry's swizzle is one XOR
// of a per-thread base with a constant: plain 32-bit shared accesses at base ^ constant + constant. (CuTe's swizzled
// pointers recompute the swizzle on 64-bit generic addresses at every access, which made the
// bias reads about twice as expensive as the bias add itself.)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <flashkiln/common/shared_access.hpp>

namespace flashkiln::hopper {

using namespace cute;

// The swizzle of row r's 16-byte chunks in boxes of kBoxCols 2-byte columns: the TMA swizzle
// XORs a chunk's index with address bits 7 and up, which hold r % 8 in 128-byte rows and
// (r / 2) % 4 in 64-byte ones.
template <int kBoxCols>
__device__ __forceinline__ constexpr int row_swizzle(int r) {
  static_assert(kBoxCols == 64 || kBoxCols == 32, "128- or 64-byte swizzled boxes of 2-byte entries");
  return kBoxCols == 64 ? r % 8 : r / 2 % 4;
}

// The byte offset of entry (r, c) in this layout, with consecutive boxes `box_bytes` apart (a
// tile's box holds all its rows; a run of rows in a taller tile's boxes keeps their stride).
template <int kBoxCols>
__device__ __forceinline__ uint32_t box_offset(int r, int c, int box_bytes) {
  return uint32_t((c / kBoxCols) * box_bytes + r * kBoxCols * 2 +
                  ((c % kBoxCols / 8) ^ row_swizzle<kBoxCols>(r)) * 16 + (c % 8) * 2);
}

// The byte offset of entry (r, c) of a (kRows, cols) tile of 2-byte entries in this layout (one entry; SwizzledPairs for a fragment's).
template <int kRows, int kBoxCols = 64>
__device__ __forceinline__ uint32_t swizzled_offset(int r, int c) {
  return box_offset<kBoxCols>(r, c, kRows * kBoxCols * 2);
}

// Byte offsets of a thread's column pairs in a (kRows, cols) tile; `coords` is the MMA's C
// partition of the tile's identity tensor. kRowBroadcast: every row reads row 0. Row offsets
// that are multiples of 8 leave the row swizzle of either box width unchanged.
template <int kRows, bool kRowBroadcast, class Coords, int kBoxCols = 64>
struct SwizzledPairs {
  Coords const& coords;
  int r0, c0;
  uint32_t base;

  __device__ __forceinline__ explicit SwizzledPairs(Coords const& coords_)
      : coords(coords_), r0(get<0>(coords_(0))), c0(get<1>(coords_(0))),
        base(swizzled_offset<kRows, kBoxCols>(kRowBroadcast ? 0 : r0, c0)) {}

  // Of the pair that starts at entry i (even); compile-time arithmetic on `base` once unrolled.
  __device__ __forceinline__ uint32_t operator()(int i) const {
    const int dr = kRowBroadcast ? 0 : get<0>(coords(i)) - r0;
    const int dc = get<1>(coords(i)) - c0;
    return (dc / kBoxCols) * kRows * kBoxCols * 2 + dr * kBoxCols * 2 + (base ^ ((dc % kBoxCols / 8) * 16));
  }
};

// The bias tile at shared address `tile`, divided by the scale, into acc: added to S (kAdd), or
// as S's initial value, onto which the S GEMM accumulates Q K^T (the scores keep the unscaled
// Q K^T until the softmax, as in the portable kernels).
template <int kRows, bool kRowBroadcast, bool kAdd, class Element, class Acc, class Coords>
__device__ __forceinline__ void bias_tile_into(Acc& acc, Coords const& coords, uint32_t tile, float inv_scale) {
  static_assert(sizeof(Element) == 2 && decltype(size<0, 0>(acc))::value == 2, "pairs of 2-byte entries");
  const SwizzledPairs<kRows, kRowBroadcast, Coords> offset(coords);
  cutlass::NumericArrayConverter<float, Element, 2> convert;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const uint32_t raw = load_shared_u32_at(tile + offset(i));
    const auto pair = convert(reinterpret_cast<cutlass::Array<Element, 2> const&>(raw));
    acc(i) = kAdd ? fmaf(pair[0], inv_scale, acc(i)) : pair[0] * inv_scale;
    acc(i + 1) = kAdd ? fmaf(pair[1], inv_scale, acc(i + 1)) : pair[1] * inv_scale;
  }
}

// Zeroes rows [first, kRows) of a (kRows, kCols) tile of 2-byte elements in boxes of kBoxCols
// columns (this layout's 64, or a 64-byte swizzled tile's 32), in whole box rows (a swizzle only
// permutes the 16-byte chunks within one), spread over the 128 threads of a warpgroup (`thread`
// counts within it). The caller fences and synchronizes before wgmma reads it.
template <int kRows, int kCols, int kBoxCols, class Element>
__device__ __forceinline__ void zero_rows(Element* tile, int first, int thread) {
  static_assert(sizeof(Element) == 2 && kCols % kBoxCols == 0 && kBoxCols % 8 == 0, "whole boxes of 2-byte elements");
  constexpr int kChunksPerRow = kBoxCols * 2 / 16;
  CUTE_UNROLL
  for (int c = 0; c < kCols / kBoxCols; ++c) {
    uint4* box = reinterpret_cast<uint4*>(tile + c * kRows * kBoxCols);
    for (int i = first * kChunksPerRow + thread; i < kRows * kChunksPerRow; i += 128) {
      box[i] = make_uint4(0, 0, 0, 0);
    }
  }
}

// The fragment `frag` (2-byte entries, accumulator layout) into the tile at shared address `tile`,
// in boxes of kBoxCols columns, with stmatrix: the fragment's 8 x 8 blocks are its rows r0 + 8 e
// (e < 2, r0 the lane's first) by the columns c0 + 8 k, four at a time (k = 2 q + {0, 1}); lane l
// gives the address of row l % 8 of block b = l / 8 (e = b % 2, k = 2 q + b / 2), whose swizzle
// is its own, and the next q's blocks lie 16 columns on (SwizzledPairs' arithmetic).
template <int kRows, int kBoxCols = 64, class Frag, class Coords>
__device__ __forceinline__ void store_fragment(Frag const& frag, Coords const& coords, uint32_t tile) {
  static_assert(sizeof(typename Frag::value_type) == 2, "pairs of 2-byte entries");
  constexpr int kGroups = decltype(size(frag))::value / 8;  // q: 4 blocks of 16 entries, 4 per lane
  static_assert(kGroups * 8 == decltype(size(frag))::value, "whole stores of four blocks");
  const int lane = threadIdx.x % 32, b = lane / 8;
  const int r0 = get<0>(coords(0)), c0 = get<1>(coords(0));
  const uint32_t base = tile + swizzled_offset<kRows, kBoxCols>(r0 - lane / 4 + 8 * (b % 2) + lane % 8,
                                                                c0 - 2 * (lane % 4) + 8 * (b / 2));
  CUTE_UNROLL
  for (int q = 0; q < kGroups; ++q) {
    uint32_t pairs[4];
    CUTE_UNROLL
    for (int i = 0; i < size(frag); i += 2) {
      const int e = (get<0>(coords(i)) - r0) / 8, k = (get<1>(coords(i)) - c0) / 8;
      if (k / 2 == q) {  // compile-time once unrolled
        pairs[e + 2 * (k % 2)] = *reinterpret_cast<uint32_t const*>(&frag(i));
      }
    }
    const int dc = 16 * q;
    store_blocks((dc / kBoxCols) * kRows * kBoxCols * 2 + (base ^ uint32_t((dc % kBoxCols / 8) * 16)), pairs);
  }
}

// Rows [0, rows) of a tile of kCols 2-byte columns in this layout at shared address `tile` (boxes
// `box_bytes` apart, rows <= kRows) to `out`, row stride `row_stride` elements, in 16-byte pieces by
// kThreads threads (`thread` counts within them), so that a warp writes whole rows. `out` and the
// stride are 16-byte aligned.
template <int kRows, int kCols, int kBoxCols, int kThreads, class Element>
__device__ __forceinline__ void copy_rows_out(uint32_t tile, int box_bytes, Element* out, int64_t row_stride, int rows,
                                              int thread) {
  constexpr int kChunks = kCols / 8;
  static_assert(sizeof(Element) == 2 && kRows * kChunks % kThreads == 0, "whole rounds of 16-byte pieces");
  CUTE_UNROLL
  for (int j = 0; j < kRows * kChunks / kThreads; ++j) {
    const int piece = j * kThreads + thread;
    const int r = piece / kChunks, c = piece % kChunks * 8;
    if (r < rows) {
      *reinterpret_cast<uint4*>(out + r * row_stride + c) =
          load_shared_u128_at(tile + box_offset<kBoxCols>(r, c, box_bytes));
    }
  }
}

}  // namespace flashkiln::hopper
