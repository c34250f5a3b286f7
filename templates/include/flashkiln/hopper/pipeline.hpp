// The mbarrier protocol between the TMA producer and the consumer warpgroups.
//
// Each K/V stage has a "full" and an "empty" barrier per operand: one arrival by the producer
// fills (it also announces the bytes TMA will deliver); every consumer thread arrives on "empty"
// once its MMAs stop reading the operand (K after S = Q K^T, V after O += P V, a step later). A
// waiter tracks the phase parity it expects; the producer starts at parity 1 on the empty
// barriers, which a fresh barrier reports as completed, so the first pass through the ring does
// not wait.
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

// Counts this thread's arrival at a named barrier without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Ping-pong of the consumer warpgroups: they take turns issuing their GEMMs, round robin, so one
// warpgroup's softmax runs while the tensor cores serve the others. Warpgroup w's turn is the
// named barrier kFirstId + w over its 128 threads and the previous warpgroup's 128, which arrive
// when they pass the turn on. Every warpgroup takes the same number of turns (they share each
// work tile's key tiles; one that skips a key tile passes its turn); the last one's final pass is
// never waited for.
template <int kWarpgroups>
struct WarpgroupTurns {
  static constexpr int kFirstId = 4;  // ids 1-3: the epilogue's per-warpgroup barriers
  int warpgroup;

  // The first turn goes to warpgroup 0.
  __device__ __forceinline__ explicit WarpgroupTurns(int warpgroup_) : warpgroup(warpgroup_) {
    if (kWarpgroups > 1 && warpgroup == kWarpgroups - 1) {
      named_barrier_arrive(kFirstId, 256);
    }
  }
  __device__ __forceinline__ void wait() const {
    if (kWarpgroups > 1) {
      named_barrier_sync(kFirstId + warpgroup, 256);
    }
  }
  __device__ __forceinline__ void pass() const {
    if (kWarpgroups > 1) {
      named_barrier_arrive(kFirstId + (warpgroup + 1) % kWarpgroups, 256);
    }
  }
};

// The 4-d TMA tile load used for Q, K, V and the bias: (column, row, head, batch) coordinates.
__device__ __forceinline__ void tma_load(void const* desc, uint64_t* barrier, void* smem, int col, int row,
                                         int head, int batch) {
  cute::SM90_TMA_LOAD_4D::copy(desc, barrier, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                               smem, col, row, head, batch);
}

}  // namespace flashkiln::hopper
