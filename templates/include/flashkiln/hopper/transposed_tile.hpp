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

// The 8 x 8 blocks in which a warp's transposed fragment (kFragRows of a (kRows, keys) tile's rows:
// all, or a warpgroup's part where the warpgroups split them) meets the tile, for ldmatrix.trans
// and stmatrix.trans (common/shared_access.hpp): blocks of 8 rows by the 8 keys k0 + 8 g (g < 2,
// k0 the lane's first key), rows 8 j, four at a time (j = 4 h + b); a lane's pair of rows of key
// k0 + 8 g is entry pair j of block-row g, and it gives the address of row lane % 8 of block
// lane / 8.
template <int kRows, int kFragRows>
struct TransposedBlocks {
  static_assert(kFragRows % 32 == 0 && kRows % kFragRows == 0, "whole groups of 4 row blocks");
  static constexpr int kGroups = kFragRows / 32;  // h
  static constexpr int kPairs = kFragRows / 8;    // j
  uint32_t first;  // this lane's address in group (g, h) = (0, 0)

  template <class Coords>
  __device__ __forceinline__ TransposedBlocks(Coords const& coords, uint32_t tile) {
    const int k0 = get<0>(coords(0)), r0 = get<1>(coords(0));
    const int row_base = kFragRows == kRows ? 0 : r0 - r0 % 8;  // r0 less the lane's own 2 (l % 4)
    const int lane = threadIdx.x % 32;
    const int chunk = (k0 % 64) / 16 * 2;  // the warp's first 8 keys, as a 16-byte chunk of its box's rows
    first = tile + (k0 / 64) * kRows * 128 + (row_base + lane / 8 * 8 + lane % 8) * 128 + ((chunk ^ (lane % 8)) * 16);
  }

  // (The tile is 1024-byte aligned and `chunk` even: the next chunk flips bit 4 of the address.)
  __device__ __forceinline__ uint32_t address(int g, int h) const { return (first ^ uint32_t(g * 16)) + h * 32 * 128; }

  // Entry pair i's place among the pairs of its block-row: (g, j).
  template <class Coords>
  __device__ __forceinline__ static int block_row(Coords const& coords, int i) {
    return (get<0>(coords(i)) - get<0>(coords(0))) / 8;
  }
  template <class Coords>
  __device__ __forceinline__ static int pair(Coords const& coords, int i) {
    return (get<1>(coords(i)) - get<1>(coords(0))) / 8;
  }
};

// The bias tile at shared address `tile`, a (kRows query rows, keys) tile, divided by the scale and
// added to acc, a transposed (keys, rows) accumulator (S^T) of kFragRows of the rows: each lane's
// (key, row pair) comes from ldmatrix.trans (TransposedBlocks), 8 x 4 blocks per warp in 4 loads.
// kRowBroadcast: every row reads row 0, one 2-byte load per key.
template <int kRows, int kFragRows, bool kRowBroadcast, class Element, class Acc, class Coords>
__device__ __forceinline__ void bias_transposed_into(Acc& acc, Coords const& coords, uint32_t tile, float inv_scale) {
  static_assert(sizeof(Element) == 2, "2-byte entries");
  if constexpr (kRowBroadcast) {
    const uint32_t box = tile + (get<0>(coords(0)) / 64) * kRows * 128;  // the warpgroup's 64 keys
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const int key = get<0>(coords(i)) % 64;
      const uint16_t raw = load_shared_u16_at(box + ((key / 8) * 16 + (key % 8) * 2));
      acc(i) = fmaf(float(reinterpret_cast<Element const&>(raw)), inv_scale, acc(i));
    }
  } else {
    using Blocks = TransposedBlocks<kRows, kFragRows>;
    const Blocks blocks(coords, tile);
    cutlass::NumericArrayConverter<float, Element, 2> convert;
    CUTE_UNROLL
    for (int g = 0; g < 2; ++g) {
      CUTE_UNROLL
      for (int h = 0; h < Blocks::kGroups; ++h) {  // one load at a time, to keep few registers live
        uint32_t pairs[4];
        load_blocks_transposed(blocks.address(g, h), pairs);
        CUTE_UNROLL
        for (int i = 0; i < size(acc); i += 2) {
          const int j = Blocks::pair(coords, i);
          if (Blocks::block_row(coords, i) == g && j / 4 == h) {  // compile-time once unrolled
            const auto pair = convert(reinterpret_cast<cutlass::Array<Element, 2> const&>(pairs[j % 4]));
            acc(i) = fmaf(pair[0], inv_scale, acc(i));
            acc(i + 1) = fmaf(pair[1], inv_scale, acc(i + 1));
          }
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

// The row pairs joined into runs of four keys of one row. Lanes l and l ^ 8 hold the same rows'
// pairs, two keys apart (the lane with l & 8 clear the first two, which start at a multiple of 4);
// of a key's two pairs 8 rows apart, that lane takes the first rows' four keys and the other lane
// the second rows'. `emit(row, key, low, high)` gets keys key, key + 1 in `low` and key + 2,
// key + 3 in `high` (key % 4 == 0).
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

// A transposed fragment of 2-byte entries (kFragRows of the rows, as bias_transposed_into reads
// them) into the (kRows, keys) tile at shared address `tile`, in that tile's layout (a bias tile's):
// stmatrix.trans, 4 stores per 32 rows.
template <int kRows, int kFragRows, class Frag, class Coords>
__device__ __forceinline__ void store_rows_of_transposed(Frag const& frag, Coords const& coords, uint32_t tile) {
  static_assert(sizeof(typename Frag::value_type) == 2, "pairs of 2-byte entries");
  using Blocks = TransposedBlocks<kRows, kFragRows>;
  const Blocks blocks(coords, tile);
  CUTE_UNROLL
  for (int g = 0; g < 2; ++g) {
    uint32_t pairs[Blocks::kPairs];
    CUTE_UNROLL
    for (int i = 0; i < size(frag); i += 2) {
      if (Blocks::block_row(coords, i) == g) {  // compile-time once unrolled
        pairs[Blocks::pair(coords, i)] = *reinterpret_cast<uint32_t const*>(&frag(i));
      }
    }
    CUTE_UNROLL
    for (int h = 0; h < Blocks::kGroups; ++h) {
      store_blocks_transposed(blocks.address(g, h), *reinterpret_cast<uint32_t const(*)[4]>(&pairs[4 * h]));
    }
  }
}

}  // namespace flashkiln::hopper
