// Logit softcapping (Gemma 2): a score z = scale * s becomes cap * tanh(z / cap), before the bias,
// the sink and the mask. The kernels see it in their own units: with a softcap the runtime passes
// scale = cap (so scale_log2, the LSE and the bias's 1 / scale are those of the capped logit),
// and `softcap_scale` = scale / cap, by which the raw scores enter the tanh. The backward's dS
// then picks up d(cap * tanh(x)) / ds / cap = (1 - tanh(x)^2) * softcap_scale.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace flashkiln {

// tanh on the special function unit (max relative error about 2^-11, which the FA-style rule of
// the tests absorbs: the low-precision reference rounds the scores themselves).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Raw scores s of an accumulator fragment to tanh(s * softcap_scale), in place.
template <class TensorS>
__device__ __forceinline__ void cap_scores(TensorS&& s, float softcap_scale) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(s); ++i) {
    s(i) = fast_tanh(s(i) * softcap_scale);
  }
}

// The cap's slope at a capped score t, d tanh(x) / dx = 1 - t^2 (clamped at 0 against the fast
// tanh's rounding): dS's factor over softcap_scale.
__device__ __forceinline__ float tanh_slope(float t) { return fmaxf(fmaf(-t, t, 1.f), 0.f); }

// dS's factor of one score from its probability P = exp2(t * scale_log2 - lse_log2), t the capped
// score, where a backward keeps P where t was (in the accumulator): reading t back from P costs no
// registers, but a second special-function op per score beside the exponential. P = 0 (a hidden
// key, or one too unlikely to count) gives 0.
__device__ __forceinline__ float softcap_slope(float prob, float lse_log2, float inv_scale_log2,
                                               float softcap_scale) {
  const float t = (__log2f(prob) + lse_log2) * inv_scale_log2;
  return prob > 0.f ? tanh_slope(t) * softcap_scale : 0.f;
}

// The cap's slopes at capped scores t, 1 - t^2, in half precision (relative error 2^-11 above
// 2^-14, absolute below 2^-25 under it: less than the bf16 rounding of the dS they scale), for a
// backward with the registers to keep them from the cap to dS: half those of t, and no
// special-function op (softcap_slope's logarithm).
template <class TensorT, class TensorSlope>
__device__ __forceinline__ void softcap_slopes(TensorT const& t, TensorSlope& slopes) {
  cutlass::NumericArrayConverter<cutlass::half_t, float, 2> to_half;
  CUTE_UNROLL
  for (int i = 0; i < cute::size(t); i += 2) {
    cutlass::Array<float, 2> pair;
    pair[0] = tanh_slope(t(i));
    pair[1] = tanh_slope(t(i + 1));
    const auto halves = to_half(pair);
    slopes(i) = halves[0];
    slopes(i + 1) = halves[1];
  }
}

}  // namespace flashkiln
