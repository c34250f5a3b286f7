// Element-wise score masking by the visibility rule (visibility.hpp), for accumulator fragments
// of any layout given their coordinates.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/math.hpp>
#include <flashkiln/common/visibility.hpp>

namespace flashkiln {

// Sets to -inf the scores of one (query tile at row0, key tile at col0) pair that their rows do
// not see (visibility.hpp, needs_mask says whether any). `coord` is the identity partition giving
// each score's (row, col) in the tile.
template <Causal kCausal, bool kWindow, class TensorS, class Coord>
__device__ __forceinline__ void mask_scores(TensorS&& s, Coord const& coord, Visibility<kCausal, kWindow> v,
                                            int row0, int col0) {
  CUTE_UNROLL
  for (int r = 0; r < cute::size<0>(s); ++r) {
    // A row sees the tile's columns [first, limit): compares per score against a column that is a
    // constant per register (the left one only with a left edge: the columns come from the thread
    // index, so the compiler cannot fold a compare against 0).
    const int row = row0 + cute::get<0>(coord(r, 0));
    const int first = first_visible_column(v, row, col0);
    const int limit = first_hidden_column(v, row, col0);
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(s); ++c) {
      const int col = cute::get<1>(coord(r, c));
      if (col >= limit || (Visibility<kCausal, kWindow>::kLeftEdge && col < first)) {
        s(r, c) = -kInfinity;
      }
    }
  }
}

}  // namespace flashkiln
