// The mbarrier protocol between the TMA producer and the consumer warpgroups.
//
// Each K/V stage has a "full" barrier per operand (one arrival by the producer, which also
// announces the bytes TMA will deliver) and one "empty" barrier that every consumer thread arrives
// on once its MMAs stop reading the stage. A waiter tracks the phase parity it expects; the
// producer starts at parity 1 on the empty barriers, which a fresh barrier reports as completed,
// so the first pass through the ring does not wait.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>

namespace flashkiln::hopper {

using Barrier = cutlass::arch::ClusterBarrier;
using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

// Position in a ring of kStages buffers: the stage index and the parity of its current use.
template <int kStages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Named barrier over `threads` threads (a multiple of 32); id 0 is __syncthreads'.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The 4-d TMA tile load used for Q, K and V: (column, row, head, batch) coordinates.
__device__ __forceinline__ void tma_load(void const* desc, uint64_t* barrier, void* smem, int col, int row,
                                         int head, int batch) {
  cute::SM90_TMA_LOAD_4D::copy(desc, barrier, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                               smem, col, row, head, batch);
}

}  // namespace flashkiln::hopper
