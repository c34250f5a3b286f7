// The hopper forward's score mask, on the wgmma accumulator's fixed layout: a thread's
// entries in a row sit at columns c0 + 8 * (i / 2) + i % 2 (c0 = 2 * (lane % 4)), increasing with
// the entry index i. So a row limit hides a suffix of the row's entries, and the kept prefix is a
// bit mask built once per row; each score then costs a predicate taken from the mask (ptxas
// moves 7 mask bits into predicates at once, R2P) and a select, instead of a compare and a select.
// A window's left edge hides a prefix the same way.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/math.hpp>
#include <flashkiln/common/visibility.hpp>

namespace flashkiln::hopper {

using namespace cute;

// The entries of a thread's row whose column offset 8 * (i / 2) + i % 2 lies below `limit - c0`.
__device__ __forceinline__ int entries_below(int limit, int c0) {
  const int t = max(limit - c0, 0);
  return 2 * (t / 8) + min(t % 8, 2);
}

// The bits of entries [0, n) among the 32 from entry q.
__device__ __forceinline__ uint32_t entry_prefix(int n, int q) {
  n -= q;
  return n >= 32 ? 0xffffffffu : (1u << max(n, 0)) - 1u;
}

// As flashkiln::mask_scores (common/masking.hpp): the scores that their rows do not see get
// -inf. `coord` is the accumulator's identity partition (rowcol view).
template <Causal kCausal, bool kWindow, class TensorS, class Coord>
__device__ __forceinline__ void mask_scores(TensorS&& s, Coord const& coord, Visibility<kCausal, kWindow> v,
                                            int row0, int col0) {
  constexpr int kEntries = decltype(size<1>(s))::value;  // per row
  static_assert(kEntries % 2 == 0, "column pairs");
  const int c0 = get<1>(coord(0, 0));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int row = row0 + get<0>(coord(r, 0));
    const int kept = entries_below(first_hidden_column(v, row, col0), c0);
    CUTE_UNROLL
    for (int q = 0; q < kEntries; q += 32) {
      uint32_t bits = entry_prefix(kept, q);
      if constexpr (kWindow) {
        bits &= ~entry_prefix(entries_below(first_visible_column(v, row, col0), c0), q);
      }
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
