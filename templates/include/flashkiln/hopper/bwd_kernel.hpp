// Hopper attention backward (sm_90a), the main kernel: a CTA per (key tile, query head, batch
// entry), warp-specialized. Warpgroup 0 is the producer: one thread loads K and V once, then Q
// and dO of every query tile that sees the key tile through a ring of kStages buffers (and stores
// the dS tiles that are a full bias's dBias), and one thread per consumer warpgroup adds the dQ
// that warpgroup stages to an fp32 accumulator with bulk reduce-adds (in a fixed key-tile order
// for a deterministic call). The two consumer warpgroups keep the key tile's dK and dV in
// registers over the loop, split by keys or by columns (bwd_traits.hpp). Around it run the
// preprocess (delta, the accumulator zeroed) and the postprocess (hopper/bwd_post.hpp). See
// docs/design.md, "Hopper backward kernel". This file gives each thread its role; the roles live in
// bwd_producer.hpp (the loads), bwd_writers.hpp (the dQ writers, the dBias turns) and
// bwd_mainloop.hpp (the consumers), and bwd_schedule.hpp says what a CTA works on, in which order.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include <flashkiln/common/sequence.hpp>
#include <flashkiln/hopper/bwd_mainloop.hpp>
#include <flashkiln/hopper/bwd_params.hpp>
#include <flashkiln/hopper/bwd_producer.hpp>
#include <flashkiln/hopper/bwd_schedule.hpp>
#include <flashkiln/hopper/bwd_traits.hpp>
#include <flashkiln/hopper/bwd_writers.hpp>
#include <flashkiln/hopper/pipeline.hpp>
#include <flashkiln/hopper/shared_storage.hpp>
#include <flashkiln/hopper/timeline.hpp>

namespace flashkiln::hopper {

using namespace cute;

template <class T>
__device__ __forceinline__ void bwd_kernel(HopperBwdParams const& p) {
  auto& ss = aligned_shared_storage<typename T::SharedStorage>();
  const BwdBlock block = bwd_block<T>(p);
  const Sequence s = sequence_of(p, block.entry);
  const int n_tiles = ceil_div(s.seqlen_k, T::kBlockN);  // a packed batch's grid covers its longest sequence
  if (block.x >= n_tiles) {
    return;
  }
  // A deterministic call's dQ order runs from the last key tile down (dq_turn): CTAs start in that
  // order, so that none waits for one not yet running (on a staggered sweep, which turns the order,
  // the runtime ensures that a sequence's key tiles all run at once).
  const int n_block = p.dq_semaphore != 0 ? n_tiles - 1 - block.x : block.x;
  const int head = block.head;

  if (threadIdx.x == 0) {
    Barrier::init(&ss.kv_full, 1);
    CUTE_UNROLL
    for (int s = 0; s < T::kStages; ++s) {
      Barrier::init(&ss.q_full[s], 1);
      Barrier::init(&ss.q_empty[s], T::kConsumerThreads);
    }
    CUTE_UNROLL
    for (int w = 0; w < T::kConsumerWarpgroups; ++w) {
      Barrier::init(&ss.dq_full[w], 128);
      Barrier::init(&ss.dq_empty[w], 1);
    }
    Barrier::init(&ss.dbias_turn, 1);
    Barrier::init(&ss.dbias_done, T::kConsumerThreads);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 128) {
    timeline_start();
  }

  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    const int warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
      produce<T>(p, ss, s, n_block, head);
    } else if (threadIdx.x % 32 == 0 && warp <= T::kConsumerWarpgroups) {
      write_dq<T>(p, ss, s, warp - 1, n_block, head);
    } else if (threadIdx.x == 32 * (T::kConsumerWarpgroups + 1) && T::kBiasGrad && p.dbias_semaphore != 0) {
      pass_dbias_turns<T>(p, ss, s, n_block, head);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    if (p.dsink_parts != 0) {
      consume_routed<T, true>(p, ss, s, threadIdx.x - 128, n_block, head);
    } else {
      consume_routed<T, false>(p, ss, s, threadIdx.x - 128, n_block, head);
    }
    if (threadIdx.x == 128) {
      timeline_end();
    }
  }
}

}  // namespace flashkiln::hopper
