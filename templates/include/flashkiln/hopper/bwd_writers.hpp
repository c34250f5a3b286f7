// The Hopper backward's other producer-warpgroup threads (bwd_kernel.hpp): one dQ writer per
// consumer warpgroup, which adds the dQ that warpgroup stages to the fp32 accumulator with bulk
// reduce-adds, and, for a deterministic call's shared-bias dBias, the thread that passes the
// CTA's turns. Deterministic orders go through counting semaphores in global memory.
#pragma once

#include <cuda/atomic>

#include <cute/tensor.hpp>

#include <flashkiln/common/math.hpp>
#include <flashkiln/common/sequence.hpp>
#include <flashkiln/hopper/bwd_params.hpp>
#include <flashkiln/hopper/bwd_schedule.hpp>
#include <flashkiln/hopper/bwd_traits.hpp>
#include <flashkiln/hopper/pipeline.hpp>

namespace flashkiln::hopper {

using namespace cute;

// Adds `bytes` of fp32 from shared memory to global memory, as one asynchronous bulk operation of
// the calling thread's bulk group (cute::tma_store_arrive commits it, tma_store_wait waits for its reads).
__device__ __forceinline__ void bulk_reduce_add(float* global, uint32_t shared, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               ::"l"(global), "r"(shared), "r"(bytes) : "memory");
}

// A deterministic call's dQ order: the semaphore of a query tile's part counts the key tiles that
// have added to it. The bulk adds run in the async proxy and the counts in the generic one, so a
// proxy fence stands between the acquire and the next add, and between an add's completion (not
// only its reads of shared memory) and the release.
__device__ __forceinline__ void wait_for_count(int* semaphore, int count) {
  cuda::atomic_ref<int, cuda::thread_scope_device> counter(*semaphore);
  while (counter.load(cuda::memory_order_acquire) != count) {
  }
}

__device__ __forceinline__ void wait_for_turn(int* semaphore, int turn) {
  wait_for_count(semaphore, turn);
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ void pass_turn(int* semaphore) {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  cuda::atomic_ref<int, cuda::thread_scope_device>(*semaphore).fetch_add(1, cuda::memory_order_release);
}

// The dQ writer of consumer warpgroup `warpgroup`, one thread: adds the piece of a query tile's
// dQ that the warpgroup stages (its part or row tile of every query tile, or taking turns every
// other tile's whole dQ) to the accumulator, then frees the staging buffer. With semaphores the
// key tiles of a query tile add in a fixed order (dq_turn): from the last one that sees it down to
// the first, where the CTAs run from the last key tile first and a later key tile starts its
// sweep no later, so that in steady state under a causal mask nobody waits; or, on a staggered
// sweep, in the order the key tiles reach it.
template <class T>
__device__ __forceinline__ void write_dq(HopperBwdParams const& p, typename T::SharedStorage& ss, Sequence const& s,
                                         int warpgroup, int n_block, int head) {
  const QuerySweep sweep = query_sweep<T>(p, s, n_block);
  const int piece = T::kDqAlternate ? 0 : warpgroup;  // (row tile, part) of a query tile's dQ
  const int part = piece % T::kDqParts, row_tile = piece / T::kDqParts;
  float* const accum = reinterpret_cast<float*>(p.dq_accum) + s.dq_accum_row(p, head) * T::kDimQK +
                       row_tile * T::DqLayout::kTileFloats + part * T::DqLayout::kPartFloats;
  const int64_t semaphore_tiles = (int64_t(s.batch) * p.heads_q + head) * ceil_div(p.seqlen_q, T::kBlockM);
  int* const semaphores = p.dq_semaphore == 0 ? nullptr
                                              : reinterpret_cast<int*>(p.dq_semaphore) +
                                                    semaphore_tiles * T::kConsumerWarpgroups + piece;
  const auto vis = visibility_of<T>(p, s);
  const uint32_t staged = cute::cast_smem_ptr_to_uint(ss.dq + warpgroup * T::DqLayout::kPartFloats);
  constexpr int kStep = T::kDqAlternate ? T::kConsumerWarpgroups : 1;
  uint32_t phase = 0;
  for (int i = T::kDqAlternate ? warpgroup : 0; i < sweep.count; i += kStep, phase ^= 1) {
    const int m = sweep.tile(i);
    Barrier::wait(&ss.dq_full[warpgroup], phase);
    int* const semaphore = semaphores == nullptr ? nullptr : semaphores + m * T::kConsumerWarpgroups;
    if (semaphore != nullptr) {
      wait_for_turn(semaphore, dq_turn<T>(sweep, vis, s, m, n_block));
    }
    bulk_reduce_add(accum + int64_t(m) * T::kDqRowTiles * T::DqLayout::kTileFloats, staged, T::kBytesDqPart);
    cute::tma_store_arrive();
    cute::tma_store_wait<0>();
    Barrier::arrive(&ss.dq_empty[warpgroup]);
    if (semaphore != nullptr) {
      pass_turn(semaphore);
    }
  }
}

// One thread of the producer warpgroup: per query tile, waits for this CTA's turn to add its dS
// tile, hands it to the consumers (dbias_turn), and once they have issued their adds
// (dbias_done) makes them visible and passes the turn on. The adds are the consumers' own, so
// the release follows a fence that orders what the dbias_done barrier made this thread observe.
template <class T>
__device__ __forceinline__ void pass_dbias_turns(HopperBwdParams const& p, typename T::SharedStorage& ss,
                                                 Sequence const& s, int n_block, int head) {
  const QuerySweep sweep = query_sweep<T>(p, s, n_block);
  const DbiasShare share = dbias_share(p, s.batch, head);
  const int64_t tiles_q = ceil_div(p.seqlen_q, T::kBlockM), tiles_k = ceil_div(p.seqlen_k, T::kBlockN);
  int* const counts = reinterpret_cast<int*>(p.dbias_semaphore) + (share.slice * tiles_q) * tiles_k + n_block;
  uint32_t phase = 0;
  for (int i = 0; i < sweep.count; ++i, phase ^= 1) {
    int* const count = counts + sweep.tile(i) * tiles_k;
    wait_for_count(count, share.member);
    Barrier::arrive(&ss.dbias_turn);
    Barrier::wait(&ss.dbias_done, phase);
    __threadfence();
    cuda::atomic_ref<int, cuda::thread_scope_device>(*count).fetch_add(1, cuda::memory_order_release);
  }
}

}  // namespace flashkiln::hopper
