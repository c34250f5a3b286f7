// The hopper forward's score mask, on the wgmma accumulator's fixed layout: a thread's
// entries in a row sit at columns c0 + 8 * (i / 2) + i % 2 (c0 = 2 * (lane % 4)), increasing with
// the entry index i. So a row limit hides a suffix of the row's entries, and the kept prefix is a
// bit mask built once per row; each score then costs a predicate taken from the mask (ptxas
// moves 7 mask bits into predicates at once, R2P) and a select, instead of a compare and a select.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/math.hpp>
#include <flashkiln/common/visibility.hpp>

namespace flashkiln::hopper {

using namespace cute;

// As flashkiln::mask_scores (common/masking.hpp): the scores that their rows do not see get
// -inf. `coord` is the accumulator's identity partition (rowcol view).
template <Causal kCausal, class TensorS, class Coord>
__device__ __forceinline__ void mask_scores(TensorS&& s, Coord const& coord, Visibility<kCausal> v, int row0,
                                            int col0) {
  constexpr int kEntries = decltype(size<1>(s))::value;  // per row
  static_assert(kEntries % 2 == 0, "column pairs");
  const int c0 = get<1>(coord(0, 0));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int limit = first_hidden_column(v, row0 + get<0>(coord(r, 0)), col0);
    // Entries kept: those whose column offset 8 * (i / 2) + i % 2 lies below limit - c0.
    const int t = max(limit - c0, 0);
    const int kept = 2 * (t / 8) + min(t % 8, 2);
    CUTE_UNROLL
    for (int q = 0; q < kEntries; q += 32) {
      const int n = kept - q;  // kept entries of this chunk of 32
      const uint32_t bits = n >= 32 ? 0xffffffffu : (1u << max(n, 0)) - 1u;
      CUTE_UNROLL
      for (int i = q; i < q + 32 && i < kEntries; ++i) {
        if (!(bits & (1u << (i - q)))) {
          s(r, i) = -kInfinity;
        }
      }
    }
  }
}

}  // namespace flashkiln::hopper
