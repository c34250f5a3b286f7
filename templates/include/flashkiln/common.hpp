// Definitions shared by every kernel family.
#pragma once

#include <cuda/std/limits>

namespace flashkiln {

// Which keys a query sees. top_left: key j visible to query i iff j <= i (PyTorch's is_causal).
// bottom_right: iff j <= i + seqlen_k - seqlen_q (FlashAttention's convention).
enum class Causal : int { none = 0, top_left = 1, bottom_right = 2 };

inline constexpr float kInfinity = cuda::std::numeric_limits<float>::infinity();
inline constexpr float kLog2e = 1.4426950408889634f;

template <class T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace flashkiln
