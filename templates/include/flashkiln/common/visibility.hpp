// Which keys a query sees, and from it which tiles meet: the one rule every kernel tiles by.
// Mirrored by runtime/visibility.py (same names, same semantics); tests/test_visibility_gpu.py
// compiles this header alone into a probe kernel, so it includes nothing and uses plain integer
// math only.
//
// Query row i of a sequence sees key j iff 0 <= j < seqlen_k and left(i) <= j <= right(i). The
// right edge is i + offset under a causal mask or a window and unbounded otherwise; the left edge
// is i + offset - span under a window and unbounded otherwise. Row i aligns with key
// i + seqlen_k - seqlen_q, or with key i where the call asks for top-left alignment; a window
// (FlashAttention's window_size) reaches `left` keys below and `right` keys above that key, and a
// causal mask caps `right` at 0.
#pragma once

namespace flashkiln {

// Whether a kernel masks a causal right edge. Where the edge lies is the call's (Reach::top_left),
// so one kernel serves both causal modes. top-left: key j visible to query i iff j <= i
// (PyTorch's is_causal); bottom-right: iff j <= i + seqlen_k - seqlen_q (FlashAttention's).
enum class Causal : int { none = 0, masked = 1 };

// A call's reach: a sliding window on either side of a row's aligned key (negative: unbounded),
// and the alignment (nonzero top_left: row i aligns with key i, else with i + seqlen_k - seqlen_q).
struct Reach {
  int left, right, top_left;
};

// A parameter block's reach: every kernel's block names these fields alike.
template <class Params>
__host__ __device__ __forceinline__ constexpr Reach reach_of(Params const& p) {
  return {p.window_left, p.window_right, p.top_left};
}

// The lesser of two ints, in constant expressions too (CUDA's min is not constexpr).
__host__ __device__ __forceinline__ constexpr int lesser(int a, int b) { return a < b ? a : b; }

// Tiles [first, end) along one axis: empty where end <= first.
struct TileRange {
  int first, end;
};

// The rule for one sequence (built by `visibility`).
template <Causal kCausal, bool kWindow = false>
struct Visibility {
  static constexpr bool kRightEdge = kCausal != Causal::none || kWindow;
  static constexpr bool kLeftEdge = kWindow;
  int seqlen_k;
  int offset;  // the right edge's shift: row i sees keys up to i + offset
  int span;    // the left edge's distance below the right one: row i sees keys from i + offset - span
};

// An unbounded side's reach: past every key of every row of sequences and tiles below 2^28
// rows, and the sums of the rules stay within int.
constexpr int kUnboundedReach = 1 << 29;

template <Causal kCausal, bool kWindow = false>
__host__ __device__ __forceinline__ constexpr Visibility<kCausal, kWindow> visibility(int seqlen_q, int seqlen_k,
                                                                                     Reach reach = {-1, -1, 0}) {
  const int align = reach.top_left ? 0 : seqlen_k - seqlen_q;
  if constexpr (!kWindow) {
    return {seqlen_k, kCausal == Causal::none ? 0 : align, 0};
  }
  const int right = kCausal != Causal::none ? 0 : reach.right < 0 ? kUnboundedReach : reach.right;
  const int left = reach.left < 0 ? kUnboundedReach : reach.left;
  return {seqlen_k, align + right, left + right};
}

// The first key column of the key tile at col0, counted from col0, that row `row` does not see:
// the sequence end, or the right edge where that comes first.
template <Causal kCausal, bool kWindow>
__host__ __device__ __forceinline__ constexpr int first_hidden_column(Visibility<kCausal, kWindow> v, int row,
                                                                     int col0) {
  int limit = v.seqlen_k - col0;
  if constexpr (Visibility<kCausal, kWindow>::kRightEdge) {
    limit = lesser(limit, row + v.offset + 1 - col0);
  }
  return limit;
}

// The first key column of the key tile at col0, counted from col0, that row `row` sees unless it
// lies at or past first_hidden_column (0 or less: the row sees the tile from its first column).
template <Causal kCausal, bool kWindow>
__host__ __device__ __forceinline__ constexpr int first_visible_column(Visibility<kCausal, kWindow> v, int row,
                                                                      int col0) {
  if constexpr (Visibility<kCausal, kWindow>::kLeftEdge) {
    return row + v.offset - v.span - col0;
  }
  return 0;
}

// Whether the pair of the kBlockM query rows from row0 and the kBlockN keys from col0 hides any
// key from any of its rows: keys past the sequence end, past the right edge of the tile's first
// row (the lowest right edge), or before the left edge of its last row (the highest left edge).
// The caller masks element-wise only where this holds.
template <int kBlockM, int kBlockN, Causal kCausal, bool kWindow>
__host__ __device__ __forceinline__ constexpr bool needs_mask(Visibility<kCausal, kWindow> v, int row0, int col0) {
  const bool past_end = col0 + kBlockN > v.seqlen_k;
  const bool past_right_edge = Visibility<kCausal, kWindow>::kRightEdge && col0 + kBlockN - 1 > row0 + v.offset;
  const bool before_left_edge =
      Visibility<kCausal, kWindow>::kLeftEdge && col0 < row0 + kBlockM - 1 + v.offset - v.span;
  return past_end || past_right_edge || before_left_edge;
}

// The key tiles (kBlockN keys from key 0; n_tiles of them cover the sequence) in which rows
// [row_begin, row_end) see a key. The right edge's tile comes from the last row, row_end - 1,
// the left edge's from the first, row_begin, each alone (an empty range gives those rows'), and
// rows past the sequence end count where the caller passes them.
template <int kBlockN, Causal kCausal, bool kWindow>
__host__ __device__ __forceinline__ constexpr TileRange visible_key_tiles(Visibility<kCausal, kWindow> v,
                                                                        [[maybe_unused]] int row_begin,
                                                                        int row_end, int n_tiles) {
  int first = 0, end = n_tiles;
  if constexpr (Visibility<kCausal, kWindow>::kRightEdge) {
    const int last_visible = row_end - 1 + v.offset;
    end = last_visible < 0 ? 0 : lesser(end, last_visible / kBlockN + 1);
  }
  if constexpr (Visibility<kCausal, kWindow>::kLeftEdge) {
    const int first_visible = row_begin + v.offset - v.span;  // past the sequence end: no tile
    first = first_visible <= 0 ? 0 : first_visible >= v.seqlen_k ? n_tiles : first_visible / kBlockN;
  }
  return {first, end};
}

// The query tiles (kBlockM rows from row 0; m_tiles of them cover the sequence) with a row that
// sees a key of key tile n_block: the dual of visible_key_tiles over whole query tiles, key tile
// n in visible_key_tiles(m * kBlockM, (m + 1) * kBlockM) iff query tile m in this range. The
// backward's key-tile CTAs loop over it, and its ordered dQ route and dQ kernel count on the
// duality. The right edge starts the range at the first row that reaches the tile's first key,
// the left edge ends it after the last row that reaches its last key in the sequence.
template <int kBlockM, int kBlockN, Causal kCausal, bool kWindow>
__host__ __device__ __forceinline__ constexpr TileRange visiting_query_tiles(Visibility<kCausal, kWindow> v,
                                                                           int n_block, int m_tiles) {
  int first = 0, end = m_tiles;
  if constexpr (Visibility<kCausal, kWindow>::kRightEdge) {
    const int first_row = n_block * kBlockN - v.offset;  // the first row whose right edge reaches the tile
    first = first_row <= 0 ? 0 : first_row / kBlockM;
  }
  if constexpr (Visibility<kCausal, kWindow>::kLeftEdge) {
    // The last row that reaches the tile's last key in the sequence.
    const int last_row = lesser(n_block * kBlockN + kBlockN, v.seqlen_k) - 1 - v.offset + v.span;
    end = last_row < 0 ? 0 : lesser(end, last_row / kBlockM + 1);
  }
  return {first, end};
}

}  // namespace flashkiln
