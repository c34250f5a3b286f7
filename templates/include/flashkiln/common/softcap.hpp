// Logit softcapping (Gemma 2): a score z = scale * s becomes cap * tanh(z / cap), before the bias,
// the sink and the mask. The kernels see it in their own units: with a softcap the runtime passes
// scale = cap (so scale_log2, the LSE and the bias's 1 / scale are those of the capped logit),
// and `softcap_scale` = scale / cap, by which the raw scores enter the tanh. The backward's dS
// then picks up d(cap * tanh(x)) / ds / cap = (1 - tanh(x)^2) * softcap_scale.
#pragma once

#include <cute/tensor.hpp>

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

// dS's factor of one score from its probability P = exp2(t * scale_log2 - lse_log2), t the capped
// score: the backwards keep P where t was (in the accumulator), so t is read back from P, which
// costs no registers; P = 0 (a hidden key, or one too unlikely to count) gives 0.
__device__ __forceinline__ float softcap_slope(float prob, float lse_log2, float inv_scale_log2,
                                               float softcap_scale) {
  const float t = (__log2f(prob) + lse_log2) * inv_scale_log2;
  return prob > 0.f ? fmaxf(fmaf(-t, t, 1.f), 0.f) * softcap_scale : 0.f;
}

}  // namespace flashkiln
