// The backward's transposed accumulators in the tiles of swizzled_tile.hpp's layout: an m64
// fragment of S^T (or dP^T, dS^T) per consumer warpgroup of 64 keys, in which lane l of warp w
// holds keys 16 w + l / 4 + {0, 8} and rows 2 (l % 4) + 8 j + {0, 1}, read from and written to
// (query rows, keys) tiles such as the bias's.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <flashkiln/common/shared_access.hpp>
#include <flashkiln/common/visibility.hpp>
#include <flashkiln/hopper/swizzled_tile.hpp>

namespace flashkiln::hopper {

using namespace cute;

// The bias tile at shared address `tile`, a (kRows query rows, keys) tile, divided by the scale and
// added to acc, a transposed (keys, rows) accumulator (S^T) of kFragRows of the rows (all, or a
// warpgroup's part where the warpgroups split them): each of a lane's (key, row pair) is what
// ldmatrix.trans hands it of an 8 x 8 block of 8 rows by 8 keys (load_blocks_transposed,
// common/shared_access.hpp), so 8 x 4 blocks per warp come in 4 loads. kRowBroadcast: every row
// reads row 0, one 2-byte load per key.
template <int kRows, int kFragRows, bool kRowBroadcast, class Element, class Acc, class Coords>
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
    static_assert(kFragRows % 32 == 0 && kRows % kFragRows == 0, "whole loads of 4 row blocks");
    const int row_base = kFragRows == kRows ? 0 : r0 - r0 % 8;  // r0 less the lane's own 2 (l % 4)
    const int lane = threadIdx.x % 32;
    const int chunk = (k0 % 64) / 16 * 2;  // the warp's first 8 keys, as a 16-byte chunk of a row
    cutlass::NumericArrayConverter<float, Element, 2> convert;
    CUTE_UNROLL
    for (int g = 0; g < 2; ++g) {  // keys k0 + 8 g, one at a time to keep few registers live
      uint32_t pairs[kFragRows / 8];  // rows r0 + 8 j + {0, 1}
      CUTE_UNROLL
      for (int h = 0; h < kFragRows / 32; ++h) {
        const int row = row_base + (4 * h + lane / 8) * 8 + lane % 8;
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

// P^T = exp2(S^T * scale_log2 - LSE) in place, S^T a transposed (keys, rows) accumulator of the tile
// from query row row0 and key key0, `lse_log2(row)` its rows' LSEs in base 2 (+inf: P = 0). With
// kMasked, 0 where the row does not see the key or lies past the sequence: a select, not a multiply
// (a row that sees no key has an infinite LSE). The caller picks kMasked per tile (needs_mask), so
// that whole tiles run without the per-score compares, which a run-time branch inside the loop
// would leave in every tile's code.
template <bool kMasked, class Acc, class Coords, class Vis, class LseOf>
__device__ __forceinline__ void exponentiate_transposed(Acc& acc, Coords const& coords, Vis const& vis, int row0,
                                                        int key0, int seqlen_q, float scale_log2, LseOf&& lse_log2) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int key = get<0>(coords(i));
    const int row = get<1>(coords(i));
    float prob = exp2f(fmaf(acc(i), scale_log2, -lse_log2(row)));
    if constexpr (kMasked) {
      bool visible = row0 + row < seqlen_q && key < first_hidden_column(vis, row0 + row, key0);
      if constexpr (Vis::kLeftEdge) {
        visible = visible && key >= first_visible_column(vis, row0 + row, key0);
      }
      prob = visible ? prob : 0.f;
    }
    acc(i) = prob;
  }
}

// A transposed (keys, rows) accumulator fragment of 2-byte entries as row-major (rows, keys) pairs:
// the entry pair i, i + 1 holds rows r, r + 1 of one key, and lane l ^ 4 holds the same rows of
// the neighbouring key, so one exchange gives each lane two neighbouring keys of one row (the even
// key's lane row r, the other row r + 1). row_pair: entry pair i's, with its coordinates in the
// tile (key even).
struct RowPair {
  int row, key;
  uint32_t keys;
};

template <class Frag, class Coords>
__device__ __forceinline__ RowPair row_pair(Frag const& frag, Coords const& coords, int i) {
  static_assert(sizeof(typename Frag::value_type) == 2, "pairs of 2-byte entries");
  const bool even_key = (threadIdx.x / 4) % 2 == 0;  // keys k0 + lane / 4 (+ 8) of an m64 fragment
  const uint32_t word = *reinterpret_cast<uint32_t const*>(&frag(i));
  const uint32_t other = __shfl_xor_sync(0xffffffff, even_key ? word >> 16 : word & 0xffff, 4);
  const uint32_t keys = even_key ? __byte_perm(word, other, 0x5410) : __byte_perm(other, word, 0x7610);
  return {get<1>(coords(i)) + (even_key ? 0 : 1), get<0>(coords(i)) - (even_key ? 0 : 1), keys};
}

// `emit(row, key, keys)` gets each row pair of the fragment (row_pair). The pairs a warp emits are
// the entries its fragment holds.
template <class Frag, class Coords, class Emit>
__device__ __forceinline__ void for_rows_of_transposed(Frag const& frag, Coords const& coords, Emit&& emit) {
  CUTE_UNROLL
  for (int i = 0; i < size(frag); i += 2) {
    const RowPair pair = row_pair(frag, coords, i);
    emit(pair.row, pair.key, pair.keys);
  }
}

// The row pairs joined into runs of four keys of one row. Lanes l and l ^ 8 hold the same rows'
// pairs, two keys apart (the lane with l & 8 clear the first two, which start at a multiple of 4);
// of a key's two pairs 8 rows apart, that lane takes the first rows' four keys and the other lane
// the second rows'. `emit(row, key, low, high)` gets keys key, key + 1 in `low` and key + 2,
// key + 3 in `high` (key % 4 == 0): half the emits of for_rows_of_transposed.
template <class Frag, class Coords, class Emit>
__device__ __forceinline__ void for_quads_of_transposed(Frag const& frag, Coords const& coords, Emit&& emit) {
  const bool first_half = (threadIdx.x & 8) == 0;
  const int r0 = get<1>(coords(0));
  CUTE_UNROLL
  for (int i = 0; i < size(frag); i += 2) {
    CUTE_UNROLL
    for (int i8 = 0; i8 < size(frag); i8 += 2) {
      // Entry pair i8: the same key 8 rows on, from rows of even 8-row steps (compile-time once unrolled).
      if ((get<1>(coords(i)) - r0) / 8 % 2 == 0 && get<0>(coords(i8)) == get<0>(coords(i)) &&
          get<1>(coords(i8)) == get<1>(coords(i)) + 8) {
        const RowPair first = row_pair(frag, coords, i), second = row_pair(frag, coords, i8);
        const uint32_t other = __shfl_xor_sync(0xffffffff, first_half ? second.keys : first.keys, 8);
        // (first and second hold one key; the lane l ^ 8 keys two on: this lane's key + 2 or - 2.)
        emit(first_half ? first.row : second.row, first_half ? first.key : first.key - 2,
             first_half ? first.keys : other, first_half ? other : second.keys);
      }
    }
  }
}

// The row-major pairs of a transposed fragment (for_rows_of_transposed) into the (kRows, cols) tile
// at shared address `tile`. A thread's pairs lie 8-row steps and 0 or 8 keys from its first, inside
// one 64-key box whose 16-byte chunk index is even there (keys 16 w + {0, 2, 4, 6} of warp w), so
// each address is the first one's with one XOR and one add.
template <int kRows, class Frag, class Coords>
__device__ __forceinline__ void store_rows_of_transposed(Frag const& frag, Coords const& coords, uint32_t tile) {
  const bool even_key = (threadIdx.x / 4) % 2 == 0;
  const int r = get<1>(coords(0)) + (even_key ? 0 : 1);
  const int k = get<0>(coords(0)) - (even_key ? 0 : 1);
  const uint32_t base = tile + swizzled_offset<kRows>(r, k);
  for_rows_of_transposed(frag, coords, [&](int row, int key, uint32_t keys) {
    store_shared_u32_at((base ^ uint32_t((key - k) / 8 * 16)) + (row - r) * 128, keys);
  });
}

}  // namespace flashkiln::hopper
