// fp32 reductions into global memory, for accumulators that several CTAs add into.
#pragma once

namespace flashkiln {

// *dst += (a, b) for two adjacent floats (8-byte aligned). On Hopper one vector reduction adds
// both: half the reduction requests and L2 sectors of two scalar ones.
__device__ __forceinline__ void reduce_add_pair(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

}  // namespace flashkiln
