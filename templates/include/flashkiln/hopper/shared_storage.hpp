// A Hopper kernel's shared storage, placed at the dynamic allocation rounded up to 1024 bytes (the
// 128-byte swizzle of TMA and wgmma tiles repeats every 1024 bytes).
#pragma once

#include <cuda/std/cstdint>
#include <cute/arch/util.hpp>

namespace flashkiln::hopper {

// Offsets the shared array itself: a pointer rebuilt from an integer would lose its address space,
// and every access through it would be a generic LD/ST.
template <class SharedStorage>
__device__ __forceinline__ SharedStorage& aligned_shared_storage() {
  extern __shared__ char smem_raw[];
  const uint32_t misalignment = cute::cast_smem_ptr_to_uint(smem_raw) % 1024;
  return *reinterpret_cast<SharedStorage*>(smem_raw + (1024 - misalignment) % 1024);
}

}  // namespace flashkiln::hopper
