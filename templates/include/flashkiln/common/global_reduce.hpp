// fp32 reductions into global memory, for accumulators that several CTAs add into.
#pragma once

namespace flashkiln {

// *dst += (a, b) for two adjacent floats (8-byte aligned), as one vector reduction: half the
// reduction requests and L2 sectors of two scalar ones. sm_90 and later (ptxas refuses it before).
__device__ __forceinline__ void reduce_add_pair(float* dst, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
}

// *dst += (a, b, c, d) for four adjacent floats (16-byte aligned), as one vector reduction.
__device__ __forceinline__ void reduce_add_quad(float* dst, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

}  // namespace flashkiln
