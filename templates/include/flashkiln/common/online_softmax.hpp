// Online (streaming) softmax over key tiles, in fp32 and base 2. Rows that see no key at all
// (every score -inf) end with O = 0 and LSE = -inf, never NaN.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/fragment.hpp>
#include <flashkiln/common/math.hpp>

namespace flashkiln {

template <int kRows, bool kLazyRescale = false>
struct OnlineSoftmax {
  static constexpr float kLazySlack = 8.f;

  // Per row: the reference maximum of the raw scores (before scaling; the running maximum, or
  // with kLazyRescale up to kLazySlack behind it) and this thread's partial sum of
  // exp(scale * (s - reference)); the quad's partial sums are combined once, at the end.
  float row_max[kRows];
  float row_sum[kRows];

  __device__ __forceinline__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -kInfinity;
      row_sum[r] = 0.f;
    }
  }

  // Turn the scores `s` (rows, cols) of one key tile into unnormalized probabilities in place
  // and rescale the running output `o` (rows, d_v) to the new row maxima.
  template <bool kFirstTile, class TensorS, class TensorO>
  __device__ __forceinline__ void update(TensorS&& s, TensorO&& o, float scale_log2) {
    float rescale[kRows];
    if (exponentiate<kFirstTile>(s, scale_log2, rescale)) {
      rescale_output(o, rescale);
    }
  }

  // The first half of `update`, for kernels whose O is still being accumulated into (an
  // asynchronous P V GEMM): the scores become probabilities and the row sums move to the new
  // reference maxima. Returns whether o must then be multiplied by `rescale` (rescale_output)
  // before it accumulates this tile; a compile-time false on the first tile, true without
  // kLazyRescale.
  //
  // kLazyRescale: row_max is a reference point that may lag the running maximum by up to
  // kLazySlack (log2 units of the scaled scores, so probabilities stay below 2^kLazySlack). o and
  // the sums are rescaled only when a row of the warp outgrows its reference by more, which after
  // the first key tiles is rare: the multiplications over o are skipped otherwise.
  template <bool kFirstTile, class TensorS>
  __device__ __forceinline__ bool exponentiate(TensorS&& s, float scale_log2, float (&rescale)[kRows]) {
    static_assert(decltype(cute::size<0>(s))::value == kRows);
    constexpr bool kLazy = kLazyRescale && !kFirstTile;
    float new_max[kRows];
    bool outgrown = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float tile_max = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(s); ++c) {
        tile_max = fmaxf(tile_max, s(r, c));
      }
      new_max[r] = quad_allreduce(tile_max, [](float a, float b) { return fmaxf(a, b); });
      if constexpr (kLazy) {
        outgrown |= new_max[r] * scale_log2 > row_max[r] * scale_log2 + kLazySlack;  // or row_max is -inf
      }
    }
    if constexpr (kLazy) {
      outgrown = __any_sync(0xffffffff, outgrown);
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      rescale[r] = 1.f;
      if (!kLazy || outgrown) {
        if constexpr (!kFirstTile) {
          // Nothing accumulated yet when the old max is -inf: the factor only has to stay finite.
          const float new_max_scaled = new_max[r] == -kInfinity ? 0.f : new_max[r] * scale_log2;
          rescale[r] = row_max[r] == -kInfinity ? 0.f : exp2f(row_max[r] * scale_log2 - new_max_scaled);
          row_sum[r] *= rescale[r];
        }
        row_max[r] = new_max[r];
      }
      // A row with no visible key so far keeps max -inf; subtracting 0 instead keeps exp2 at 0.
      const float max_scaled = row_max[r] == -kInfinity ? 0.f : row_max[r] * scale_log2;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(s); ++c) {
        const float p = exp2f(fmaf(s(r, c), scale_log2, -max_scaled));
        s(r, c) = p;
        sum += p;
      }
      row_sum[r] += sum;
    }
    if constexpr (kFirstTile) {
      return false;
    } else if constexpr (kLazy) {
      return outgrown;
    } else {
      return true;
    }
  }

  // The second half of `update`: o (rows, d_v) times the factors `exponentiate` returned.
  template <class TensorO>
  __device__ __forceinline__ void rescale_output(TensorO&& o, float const (&rescale)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(o); ++c) {
        o(r, c) *= rescale[r];
      }
    }
  }

  // Normalize `o` and return each row's natural-log sum-exp of the scaled scores in `lse`. A
  // finite `sink` (a logit in the units of the scaled scores) joins the denominator and the LSE
  // without a value: o is scaled by sum / (sum + exp(sink - max)).
  template <class TensorO>
  __device__ __forceinline__ void finalize(TensorO&& o, float scale, float sink, float (&lse)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float sum = quad_allreduce(row_sum[r], [](float a, float b) { return a + b; });
      float top = row_max[r] == -kInfinity ? -kInfinity : row_max[r] * scale;  // natural units
      float kept = 1.f;  // factor of the keys' terms after moving the reference point to `top`
      if (sink != -kInfinity) {
        const float new_top = fmaxf(top, sink);
        kept = top == -kInfinity ? 0.f : exp2f((top - new_top) * kLog2e);
        sum = sum * kept + exp2f((sink - new_top) * kLog2e);
        top = new_top;
      }
      const bool empty = sum == 0.f;
      const float inv = empty ? 0.f : kept / sum;
      lse[r] = empty ? -kInfinity : top + logf(sum);
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(o); ++c) {
        o(r, c) *= inv;
      }
    }
  }
};

}  // namespace flashkiln
