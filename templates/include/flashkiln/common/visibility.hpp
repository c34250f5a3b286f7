// Which keys a query sees, and from it which tiles meet: the one rule every kernel tiles by.
// Mirrored by runtime/visibility.py (same names, same semantics); tests/test_visibility_gpu.py
// compiles this header alone into a probe kernel, so it includes nothing and uses plain integer
// math only.
//
// Query row i of a sequence sees key j iff 0 <= j < seqlen_k and left(i) <= j <= right(i). The
// right edge is i + offset under a causal mask and unbounded without one; the left edge is
// unbounded (a sliding window would bound it at i + offset - left). Each rule below says where
// a left edge would enter; the kernels' loops rely on its absence: key tiles from tile 0, query
// tiles up to the last.
#pragma once

namespace flashkiln {

// The causal modes. top_left: key j visible to query i iff j <= i (PyTorch's is_causal).
// bottom_right: iff j <= i + seqlen_k - seqlen_q (FlashAttention's convention).
enum class Causal : int { none = 0, top_left = 1, bottom_right = 2 };

// The lesser of two ints, in constant expressions too (CUDA's min is not constexpr).
__host__ __device__ __forceinline__ constexpr int lesser(int a, int b) { return a < b ? a : b; }

// Tiles [first, end) along one axis: empty where end <= first.
struct TileRange {
  int first, end;
};

// The rule for one sequence (built by `visibility`).
template <Causal kCausal>
struct Visibility {
  static constexpr bool kRightEdge = kCausal != Causal::none;
  int seqlen_k;
  int offset;  // the right edge's shift: row i sees keys up to i + offset
};

template <Causal kCausal>
__host__ __device__ __forceinline__ constexpr Visibility<kCausal> visibility(int seqlen_q, int seqlen_k) {
  return {seqlen_k, kCausal == Causal::bottom_right ? seqlen_k - seqlen_q : 0};
}

// The first key column of the key tile at col0, counted from col0, that row `row` does not see:
// the sequence end, or the right edge where that comes first. (Without a left edge, the row sees
// every column before it.)
template <Causal kCausal>
__host__ __device__ __forceinline__ constexpr int first_hidden_column(Visibility<kCausal> v, int row, int col0) {
  int limit = v.seqlen_k - col0;
  if constexpr (Visibility<kCausal>::kRightEdge) {
    limit = lesser(limit, row + v.offset + 1 - col0);
  }
  return limit;
}

// Whether the pair of the query tile from row0 and the kBlockN keys from col0 hides any key from
// any of its rows: keys past the sequence end, or past the right edge of the tile's first row
// (the lowest right edge; a left edge would add keys before the last row's). The caller masks
// element-wise only where this holds.
template <int kBlockN, Causal kCausal>
__host__ __device__ __forceinline__ constexpr bool needs_mask(Visibility<kCausal> v, int row0, int col0) {
  const bool past_end = col0 + kBlockN > v.seqlen_k;
  const bool past_right_edge = Visibility<kCausal>::kRightEdge && col0 + kBlockN - 1 > row0 + v.offset;
  return past_end || past_right_edge;
}

// The key tiles (kBlockN keys from key 0; n_tiles of them cover the sequence) in which rows
// [row_begin, row_end) see a key. The right edge's tile comes from the last row, row_end - 1,
// alone (an empty range gives that row's), and rows past the sequence end count where the
// caller passes them; the left edge's would come from row_begin.
template <int kBlockN, Causal kCausal>
__host__ __device__ __forceinline__ constexpr TileRange visible_key_tiles(Visibility<kCausal> v,
                                                                        [[maybe_unused]] int row_begin,
                                                                        int row_end, int n_tiles) {
  int end = n_tiles;
  if constexpr (Visibility<kCausal>::kRightEdge) {
    const int last_visible = row_end - 1 + v.offset;
    end = last_visible < 0 ? 0 : lesser(end, last_visible / kBlockN + 1);
  }
  return {0, end};
}

// The query tiles (kBlockM rows from row 0; m_tiles of them cover the sequence) with a row that
// sees a key of key tile n_block: the dual of visible_key_tiles over whole query tiles, key tile
// n in visible_key_tiles(m * kBlockM, (m + 1) * kBlockM) iff query tile m in this range. The
// backward's key-tile CTAs loop over it, and its ordered dQ route and dQ kernel count on the
// duality. (A left edge would end the range at the last row that reaches the tile's last key.)
template <int kBlockM, int kBlockN, Causal kCausal>
__host__ __device__ __forceinline__ constexpr TileRange visiting_query_tiles(Visibility<kCausal> v, int n_block,
                                                                           int m_tiles) {
  int first = 0;
  if constexpr (Visibility<kCausal>::kRightEdge) {
    const int first_row = n_block * kBlockN - v.offset;  // the first row whose right edge reaches the tile
    first = first_row <= 0 ? 0 : first_row / kBlockM;
  }
  return {first, m_tiles};
}

}  // namespace flashkiln
