// Score masking shared by the forward and backward kernels.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common.hpp>

namespace flashkiln::portable {

using namespace cute;

// The first column of the key tile at col0, counted from col0, that query row `row` does not see:
// the sequence end, or the causal diagonal where that comes first (row sees keys up to
// row + causal_offset).
template <Causal kCausal>
__device__ __forceinline__ int first_hidden_column(int row, int col0, int seqlen_k, int causal_offset) {
  int limit = seqlen_k - col0;
  if constexpr (kCausal != Causal::none) {
    limit = min(limit, row + causal_offset + 1 - col0);
  }
  return limit;
}

// Masks the scores of one (query tile, key tile) pair: keys past the sequence end, and keys a
// causal mask hides. `coord` is the identity partition giving each score's (row, col) in the tile.
template <Causal kCausal, class TensorS, class Coord>
__device__ __forceinline__ void mask_scores(TensorS&& s, Coord const& coord, int row0, int col0, int seqlen_k,
                                            int causal_offset) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    // A row hides the tile's columns from `limit` on: one compare per score, against a column
    // that is a constant per register.
    const int limit = first_hidden_column<kCausal>(row0 + get<0>(coord(r, 0)), col0, seqlen_k, causal_offset);
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      if (get<1>(coord(r, c)) >= limit) {
        s(r, c) = -kInfinity;
      }
    }
  }
}

// Whether the (query tile at row0, key tile at col0) pair needs masking at all: keys past the
// sequence end, or keys above the causal diagonal for the tile's first query.
template <Causal kCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ bool needs_mask(int row0, int col0, int seqlen_k, int causal_offset) {
  const bool past_end = col0 + kBlockN > seqlen_k;
  const bool on_diagonal = kCausal != Causal::none && col0 + kBlockN - 1 > row0 + causal_offset;
  return past_end || on_diagonal;
}

}  // namespace flashkiln::portable
