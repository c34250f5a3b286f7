// Numeric constants and integer helpers shared by every kernel family.
#pragma once

#include <cuda/std/limits>

namespace flashkiln {

inline constexpr float kInfinity = cuda::std::numeric_limits<float>::infinity();
inline constexpr float kLog2e = 1.4426950408889634f;

template <class T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace flashkiln
