// Hopper attention forward (sm_90a): a persistent, warp-specialized kernel. Warpgroup 0 is the
// producer (one thread issues every TMA load); the other warpgroups consume, 64 query rows each,
// with wgmma. Q, K and V arrive in swizzled shared memory (head_boxes.hpp) through an mbarrier ring of
// kStages K/V buffers; O leaves through TMA stores (staged in its own buffer where it fits, else in
// the last key tile's K/V stage). See
// docs/design.md, "Hopper forward kernel".
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <flashkiln/common/math.hpp>
#include <flashkiln/hopper/fwd_epilogue.hpp>
#include <flashkiln/hopper/fwd_mainloop.hpp>
#include <flashkiln/hopper/fwd_params.hpp>
#include <flashkiln/hopper/fwd_traits.hpp>
#include <flashkiln/hopper/pipeline.hpp>
#include <flashkiln/hopper/shared_storage.hpp>
#include <flashkiln/hopper/tile_scheduler.hpp>

namespace flashkiln::hopper {

using namespace cute;

template <class T>
__device__ __forceinline__ void fwd_kernel(HopperFwdParams const& p) {
  auto& ss = aligned_shared_storage<typename T::SharedStorage>();
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    CUTE_UNROLL
    for (int s = 0; s < T::kQSlots; ++s) {
      Barrier::init(&ss.q_full[s], 1);
      // A Q slot (and its tile record) is released by every consumer thread after its tile's last
      // S (a tile without keys: once O's stores have read it, where O has no buffer of its own).
      Barrier::init(&ss.q_empty[s], T::kConsumerThreads);
    }
    Barrier::init(&ss.stage_read, T::kConsumerThreads);
    CUTE_UNROLL
    for (int s = 0; s < T::kStages; ++s) {
      Barrier::init(&ss.k_full[s], 1);
      Barrier::init(&ss.v_full[s], 1);
      Barrier::init(&ss.k_empty[s], T::kConsumerThreads);
      Barrier::init(&ss.v_empty[s], T::kConsumerThreads);
      if constexpr (T::kBias) {
        Barrier::init(&ss.bias.full[s], 1);
        Barrier::init(&ss.bias.empty[s], T::kConsumerThreads);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    if (threadIdx.x == 0) {
      produce<T>(p, ss);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    consume<T>(p, ss, threadIdx.x - 128);
  }
}

}  // namespace flashkiln::hopper
