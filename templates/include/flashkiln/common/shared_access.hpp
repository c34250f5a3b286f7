// 2-, 4- and 16-byte shared-memory loads and a warp's 8 x 8 block loads and stores (ldmatrix,
// stmatrix) by 32-bit shared address (cute::cast_smem_ptr_to_uint). CuTe
// swizzles a shared pointer by rewriting its integer value; the compiler then no longer knows the
// pointer is shared and emits generic LD.E / ST.E (64-bit address math, the generic path). These
// go through the shared window explicitly. Volatile: they must stay ordered with the mbarrier
// waits and named barriers around.
#pragma once

#include <cuda/std/cstdint>
#include <cute/arch/util.hpp>

namespace flashkiln {

// tests/host/tile_layouts.cpp defines FLASHKILN_HOST_SHARED_ACCESS and these functions over a host
// buffer, to check the kernels' shared-memory arithmetic without a GPU.
#ifndef FLASHKILN_HOST_SHARED_ACCESS
// `address`: in the shared window (cute::cast_smem_ptr_to_uint).
__device__ __forceinline__ uint32_t load_shared_u32_at(uint32_t address) {
  uint32_t value;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(value) : "r"(address));
  return value;
}

__device__ __forceinline__ uint16_t load_shared_u16_at(uint32_t address) {
  uint16_t value;
  asm volatile("ld.shared.b16 %0, [%1];" : "=h"(value) : "r"(address));
  return value;
}

__device__ __forceinline__ uint4 load_shared_u128_at(uint32_t address) {
  uint4 value;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
               : "r"(address));
  return value;
}

// Four 8 x 8 blocks of 2-byte entries, transposed (a warp's ldmatrix): lane l gives the address of
// row l % 8 of block l / 8 (8 entries, 16 bytes) and receives, from block b, the entries
// (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4) in out[b].
__device__ __forceinline__ void load_blocks_transposed(uint32_t address, uint32_t (&out)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
               : "r"(address));
}

// Four 8 x 8 blocks of 2-byte entries as registers hold them (a warp's stmatrix): lane l gives the
// address of row l % 8 of block l / 8 and, in in[b], the entries (l / 4, 2 (l % 4)) and
// (l / 4, 2 (l % 4) + 1) of block b; row j of block b receives the block's row j, 16 bytes.
__device__ __forceinline__ void store_blocks(uint32_t address, uint32_t const (&in)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(address), "r"(in[0]), "r"(in[1]), "r"(in[2]), "r"(in[3])
               : "memory");
}

// The transposed store (a warp's stmatrix.trans): lane l gives the address of row l % 8 of block l / 8 and,
// in in[b], the entries (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of block b as registers hold
// it; row j of block b receives its column j, entry i from lane 4 i + j / 2.
__device__ __forceinline__ void store_blocks_transposed(uint32_t address, uint32_t const (&in)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(address), "r"(in[0]), "r"(in[1]), "r"(in[2]), "r"(in[3])
               : "memory");
}
#endif

}  // namespace flashkiln
