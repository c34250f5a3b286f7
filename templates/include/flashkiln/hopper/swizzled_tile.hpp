// A thread's wgmma accumulator entries in a shared-memory tile laid out as TMA reads and writes
// it: (rows, cols) in 64-column boxes of 128 bytes, 128-byte swizzled, so that the byte offset of
// (r, c) is (c / 64) * rows * 128 + r * 128 + ((c % 64 / 8) ^ (r % 8)) * 16 + (c % 8) * 2.
//
// A thread's entries sit at its first entry (r0, c0), c0 < 8, plus row offsets that are
// multiples of 8 and column offsets that are multiples of 8 (or the pair's second column), so
// r % 8 and c % 8 are the thread's own and every entry's swizzle is one XOR of a per-thread base
// with a constant: plain 32-bit shared accesses at base ^ constant + constant. (CuTe's swizzled
// pointers recompute the swizzle on 64-bit generic addresses at every access, which made the
// bias reads about twice as expensive as the bias add itself.)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <flashkiln/common/shared_access.hpp>

namespace flashkiln::hopper {

using namespace cute;

// Byte offsets of a thread's column pairs in a (kRows, cols) tile; `coords` is the MMA's C
// partition of the tile's identity tensor. kRowBroadcast: every row reads row 0.
template <int kRows, bool kRowBroadcast, class Coords>
struct SwizzledPairs {
  Coords const& coords;
  int r0, c0;
  uint32_t base;

  __device__ __forceinline__ explicit SwizzledPairs(Coords const& coords_)
      : coords(coords_), r0(get<0>(coords_(0))), c0(get<1>(coords_(0))),
        base(kRowBroadcast ? uint32_t(c0 * 2) : uint32_t(r0 * 128 + (r0 % 8) * 16 + c0 * 2)) {}

  // Of the pair that starts at entry i (even); compile-time arithmetic on `base` once unrolled.
  __device__ __forceinline__ uint32_t operator()(int i) const {
    const int dr = kRowBroadcast ? 0 : get<0>(coords(i)) - r0;
    const int dc = get<1>(coords(i)) - c0;
    return (dc / 64) * kRows * 128 + dr * 128 + (base ^ ((dc % 64 / 8) * 16));
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

// Four 8 x 8 blocks of 2-byte entries, transposed: lane l gives the address of row l % 8 of block
// l / 8 (8 entries, 16 bytes) and receives, from block b, the entries (2 (l % 4), l / 4) and
// (2 (l % 4) + 1, l / 4) in out[b].
__device__ __forceinline__ void load_blocks_transposed(uint32_t address, uint32_t (&out)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
               : "r"(address));
}

// The bias tile at shared address `tile`, a (kRows query rows, keys) tile in this layout, divided
// by the scale and added to acc, a transposed (keys, rows) accumulator: the backward's S^T, one
// m64 fragment per warpgroup of 64 keys. In it a lane l of warp w holds keys 16 w + l / 4 + {0, 8}
// and rows 2 (l % 4) + 8 j + {0, 1}: each (key, row pair) is what ldmatrix.trans hands lane l of
// an 8 x 8 block of 8 rows by 8 keys (load_blocks_transposed), so 8 x 4 blocks per warp come in
// 4 loads. kRowBroadcast: every row reads row 0, one 2-byte load per key.
template <int kRows, bool kRowBroadcast, class Element, class Acc, class Coords>
__device__ __forceinline__ void bias_transposed_into(Acc& acc, Coords const& coords, uint32_t tile, float inv_scale) {
  static_assert(sizeof(Element) == 2, "2-byte entries");
  const int k0 = get<0>(coords(0));
  const int r0 = kRowBroadcast ? 0 : get<1>(coords(0));
  const uint32_t box = tile + (k0 / 64) * kRows * 128;  // the warpgroup's 64 keys
  if constexpr (kRowBroadcast) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const int key = get<0>(coords(i)) % 64;
      const uint16_t raw = load_shared_u16_at(box + ((key / 8) * 16 + (key % 8) * 2));
      acc(i) = fmaf(float(reinterpret_cast<Element const&>(raw)), inv_scale, acc(i));
    }
  } else {
    static_assert(kRows % 32 == 0, "whole loads of 4 row blocks");
    const int lane = threadIdx.x % 32;
    const int chunk = (k0 % 64) / 16 * 2;  // the warp's first 8 keys, as a 16-byte chunk of a row
    cutlass::NumericArrayConverter<float, Element, 2> convert;
    CUTE_UNROLL
    for (int g = 0; g < 2; ++g) {  // keys k0 + 8 g, one at a time to keep few registers live
      uint32_t pairs[kRows / 8];   // rows r0 + 8 j + {0, 1}
      CUTE_UNROLL
      for (int h = 0; h < kRows / 32; ++h) {
        const int row = (4 * h + lane / 8) * 8 + lane % 8;
        uint32_t (&out)[4] = *reinterpret_cast<uint32_t(*)[4]>(&pairs[4 * h]);
        load_blocks_transposed(box + row * 128 + (((chunk + g) ^ (row % 8)) * 16), out);
      }
      CUTE_UNROLL
      for (int i = 0; i < size(acc); i += 2) {
        if ((get<0>(coords(i)) - k0) / 8 == g) {  // compile-time once unrolled
          const int j = (get<1>(coords(i)) - r0) / 8;
          const auto pair = convert(reinterpret_cast<cutlass::Array<Element, 2> const&>(pairs[j]));
          acc(i) = fmaf(pair[0], inv_scale, acc(i));
          acc(i + 1) = fmaf(pair[1], inv_scale, acc(i + 1));
        }
      }
    }
  }
}

// A transposed (keys, rows) accumulator fragment of 2-byte entries (the backward's S^T layout,
// as bias_transposed_into reads) as row-major (rows, keys) pairs: the entry pair i, i + 1 holds
// rows r, r + 1 of one key, and lane l ^ 4 holds the same rows of the neighbouring key, so one
// exchange gives each lane two neighbouring keys of one row (the even key's lane row r, the other
// row r + 1). `emit(index, keys)` gets each pair inside `rows` rows and `ld` keys (`ld` even) with
// its element index row * ld + key in a plane of `ld` columns.
template <class Frag, class Coords, class Emit>
__device__ __forceinline__ void for_rows_of_transposed(Frag const& frag, Coords const& coords, int row0, int key0,
                                                       int rows, int ld, Emit&& emit) {
  static_assert(sizeof(typename Frag::value_type) == 2, "pairs of 2-byte entries");
  const bool even_key = (threadIdx.x / 4) % 2 == 0;  // keys k0 + lane / 4 (+ 8) of an m64 fragment
  CUTE_UNROLL
  for (int i = 0; i < size(frag); i += 2) {
    const uint32_t word = *reinterpret_cast<uint32_t const*>(&frag(i));
    const uint32_t other = __shfl_xor_sync(0xffffffff, even_key ? word >> 16 : word & 0xffff, 4);
    const uint32_t keys = even_key ? __byte_perm(word, other, 0x5410) : __byte_perm(other, word, 0x7610);
    const int key = key0 + get<0>(coords(i)) - (even_key ? 0 : 1);
    const int row = row0 + get<1>(coords(i)) + (even_key ? 0 : 1);
    if (row < rows && key < ld) {
      emit(int64_t(row) * ld + key, keys);
    }
  }
}

// Zeroes rows [first, kRows) of a (kRows, kCols) tile of 2-byte elements in this layout, in whole
// 128-byte rows (the swizzle only permutes chunks within a row), spread over the 128 threads of a
// warpgroup (`thread` counts within it). The caller fences and synchronizes before wgmma reads it.
template <int kRows, int kCols, class Element>
__device__ __forceinline__ void zero_rows(Element* tile, int first, int thread) {
  static_assert(sizeof(Element) == 2 && kCols % 64 == 0, "64-column boxes of 2-byte elements");
  constexpr int kChunksPerRow = 128 / 16;
  CUTE_UNROLL
  for (int c = 0; c < kCols / 64; ++c) {
    uint4* box = reinterpret_cast<uint4*>(tile + c * kRows * 64);
    for (int i = first * kChunksPerRow + thread; i < kRows * kChunksPerRow; i += 128) {
      box[i] = make_uint4(0, 0, 0, 0);
    }
  }
}

// The fragment `frag` (2-byte entries, accumulator layout) into the tile at shared address `tile`.
template <int kRows, class Frag, class Coords>
__device__ __forceinline__ void store_fragment(Frag const& frag, Coords const& coords, uint32_t tile) {
  static_assert(sizeof(typename Frag::value_type) == 2, "pairs of 2-byte entries");
  const SwizzledPairs<kRows, false, Coords> offset(coords);
  CUTE_UNROLL
  for (int i = 0; i < size(frag); i += 2) {
    store_shared_u32_at(tile + offset(i), *reinterpret_cast<uint32_t const*>(&frag(i)));
  }
}

}  // namespace flashkiln::hopper
