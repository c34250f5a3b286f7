// The forward's epilogue, per consumer warpgroup: normalize O, stage it in the warpgroup's rows
// of the O buffer (O's own, or Q's; swizzled like Q) and write it with TMA stores, which clip rows
// past the sequence end; LSE goes straight from registers. Q's buffer is handed back to the
// producer once the stores have read it; O's own buffer is reused once they have (next tile).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <flashkiln/common.hpp>
#include <flashkiln/hopper/mma.hpp>
#include <flashkiln/hopper/params.hpp>
#include <flashkiln/hopper/pipeline.hpp>
#include <flashkiln/hopper/tile_scheduler.hpp>
#include <flashkiln/hopper/swizzled_tile.hpp>
#include <flashkiln/portable/tile_ops.hpp>

namespace flashkiln::hopper {

using namespace cute;

template <class T, class AccO, class Softmax>
__device__ __forceinline__ void store_tile(HopperFwdParams const& p, typename T::SharedStorage& ss, int thread,
                                           WorkTile const& w, AccO& acc_o, Softmax& softmax) {
  constexpr int kRows = decltype(size<0>(rowcol(acc_o)))::value;
  typename T::TiledMmaO mma_o;
  auto thr_o = mma_o.get_thread_slice(thread);
  const int warpgroup = thread / 128;

  float lse[kRows];
  const float sink = p.sink != 0 ? reinterpret_cast<float const*>(p.sink)[w.head] : -kInfinity;
  softmax.finalize(rowcol(acc_o), p.scale, sink, lse);
  Tensor rO = portable::convert_fragment<typename T::Element>(acc_o);
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kDimV>>{}));
  typename T::Element* o_buffer = ss.q;
  if constexpr (T::kOwnO) {
    o_buffer = ss.o;
  }
  const bool leader = thread % 128 == 0;
  if (T::kOwnO && leader) {
    cute::tma_store_wait<0>();  // the previous tile's stores have read the warpgroup's O rows
  }
  // Own O buffer: the leader's wait is done. O in Q's buffer: the last wgmma has read those rows.
  named_barrier_sync(1 + warpgroup, 128);
  store_fragment<T::kBlockM>(rO, cO, cute::cast_smem_ptr_to_uint(o_buffer));
  // Generic-proxy writes that the TMA engine reads next: fence, then gather the warpgroup.
  cutlass::arch::fence_view_async_shared();
  named_barrier_sync(1 + warpgroup, 128);
  if (leader && w.row0 + warpgroup * 64 >= 0) {  // rows above row 0 (make_scheduler) are padding
    CUTE_UNROLL
    for (int c = 0; c < T::kDimV / T::kBoxCols; ++c) {
      cute::SM90_TMA_STORE_4D::copy(&p.tma_o, o_buffer + c * T::kBlockM * T::kBoxCols + warpgroup * 64 * T::kBoxCols,
                                    c * T::kBoxCols, w.row0 + warpgroup * 64, w.head, w.batch);
    }
    cute::tma_store_arrive();
    if (!T::kOwnO) {
      cute::tma_store_wait<0>();  // the stores have read Q's buffer
    }
  }
  if constexpr (!T::kOwnO) {
    // Every thread releases Q's buffer (and the tile index it read) itself, once the leader's
    // stores are done with it: the producer may refill both.
    named_barrier_sync(1 + warpgroup, 128);
    Barrier::arrive(&ss.q_empty);
  }

  // The thread holding column 0 of a row writes that row's LSE.
  Tensor tOcO = rowcol(cO);
  if (get<1>(tOcO(0, 0)) == 0) {
    float* lse_rows = reinterpret_cast<float*>(p.lse) + (int64_t(w.batch) * p.heads_q + w.head) * p.seqlen_q;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = w.row0 + get<0>(tOcO(r, 0));
      if (row >= 0 && row < p.seqlen_q) {
        lse_rows[row] = lse[r];
      }
    }
  }
}

}  // namespace flashkiln::hopper
