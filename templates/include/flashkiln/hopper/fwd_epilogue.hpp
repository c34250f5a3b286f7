// The forward's epilogue, per consumer warpgroup: normalize O, stage it in shared memory (O's own
// buffer, else the last key tile's K/V stage, else Q's buffer for a tile without keys; swizzled
// like Q) and write it with TMA stores, which clip rows past a dense sequence's end (in a packed
// batch, the warpgroup whose rows cross a sequence's end copies its rows out itself); LSE goes
// straight from registers. A borrowed buffer is handed back to the producer once the stores have read it;
// O's own is reused once they have (next tile).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <flashkiln/common/fragment.hpp>
#include <flashkiln/common/math.hpp>
#include <flashkiln/hopper/fwd_params.hpp>
#include <flashkiln/hopper/mma.hpp>
#include <flashkiln/hopper/pipeline.hpp>
#include <flashkiln/hopper/swizzled_tile.hpp>
#include <flashkiln/hopper/tile_scheduler.hpp>

namespace flashkiln::hopper {

using namespace cute;

// last_stage: the stage of the tile's last key tile (-1: none), where O is staged without a buffer
// of its own once every consumer is done reading it (stage_read, whose phase the caller keeps);
// q_slot: the tile's Q slot, where a tile without keys stages its zeros without an O buffer.
template <class T, class AccO, class Softmax>
__device__ __forceinline__ void store_tile(HopperFwdParams const& p, typename T::SharedStorage& ss, int thread,
                                           WorkTile const& w, int q_slot, int last_stage,
                                           uint32_t& stage_read_phase,
                                           AccO& acc_o, Softmax& softmax) {
  using Element = typename T::Element;
  constexpr int kRows = decltype(size<0>(rowcol(acc_o)))::value;
  typename T::TiledMmaO mma_o;
  auto thr_o = mma_o.get_thread_slice(thread);
  const int warpgroup = thread / 128;

  float lse[kRows];
  const float sink = p.sink != 0 ? reinterpret_cast<float const*>(p.sink)[w.head] : -kInfinity;
  softmax.finalize(rowcol(acc_o), p.scale, sink, lse);
  Tensor rO = convert_fragment<Element>(acc_o);
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kDimV>>{}));
  const bool in_stage = !T::kOwnO && last_stage >= 0;
  const bool leader = thread % 128 == 0;
  if (T::kOwnO && leader) {
    cute::tma_store_wait<0>();  // the previous tile's stores have read the warpgroup's O rows
  }
  if (in_stage) {
    Barrier::wait(&ss.stage_read, stage_read_phase);  // both warpgroups' last GEMMs have read the stage
    stage_read_phase ^= 1;
  }
  // Own O buffer: the leader's wait is done. Q's buffer: this warpgroup's last wgmma has read its rows.
  named_barrier_sync(1 + warpgroup, 128);
  // The warpgroup's first box and the step between its boxes. In a K/V stage the warpgroup's 64
  // rows form a tile of their own: the fragment's row coordinates, which count from the work
  // tile's first row, are offset back by the warpgroup's 64 rows (a box row's bytes each).
  constexpr int kBoxCols = T::kVBoxCols;
  Element* box;
  int box_step;
  if (in_stage) {
    box = warpgroup == 0 ? ss.k + last_stage * T::kElemsK : ss.v + last_stage * T::kElemsV;
    box_step = 64 * kBoxCols;
    store_fragment<64, kBoxCols>(rO, cO, cute::cast_smem_ptr_to_uint(box) - warpgroup * 64 * kBoxCols * 2);
  } else {
    Element* buffer = ss.q + q_slot * T::kElemsQ;
    if constexpr (T::kOwnO) {
      buffer = ss.o;
    }
    box = buffer + warpgroup * 64 * kBoxCols;
    box_step = T::kBlockM * kBoxCols;
    store_fragment<T::kBlockM, kBoxCols>(rO, cO, cute::cast_smem_ptr_to_uint(buffer));
  }
  // Generic-proxy writes that the TMA engine reads next: fence, then gather the warpgroup.
  cutlass::arch::fence_view_async_shared();
  named_barrier_sync(1 + warpgroup, 128);
  // Rows above row 0 (make_scheduler) are padding; past the sequence's end, other tokens.
  const int row = w.row0 + warpgroup * 64;
  const int seqlen_q = seqlens<T::kPacked>(p, w).x;
  const int rows = min(seqlen_q - row, 64);
  if (T::kPacked && 0 < rows && rows < 64) {
    auto out = reinterpret_cast<Element*>(p.o) + (int64_t(w.q_begin) + row) * p.o_row_stride + w.head * p.o_head_stride;
    copy_rows_out<64, T::kDimV, kBoxCols, 128>(cute::cast_smem_ptr_to_uint(box), box_step * 2, out, p.o_row_stride,
                                               rows, thread % 128);
  } else if (leader && row >= 0 && (!T::kPacked || rows > 0)) {  // (a dense map clips rows past the end)
    CUTE_UNROLL
    for (int c = 0; c < T::kDimV / kBoxCols; ++c) {
      cute::SM90_TMA_STORE_4D::copy(&p.tma_o, box + c * box_step, c * kBoxCols, w.q_begin + row, w.head,
                                    w.entry);
    }
    cute::tma_store_arrive();
    if (!T::kOwnO) {
      cute::tma_store_wait<0>();  // the stores have read the stage (or Q's buffer)
    }
  }
  if constexpr (!T::kOwnO) {
    // Every thread releases the buffer itself once the leader's stores (or every thread's copies)
    // are done with it: the producer may refill it.
    named_barrier_sync(1 + warpgroup, 128);
    if (in_stage) {
      Barrier::arrive(&ss.k_empty[last_stage]);
      Barrier::arrive(&ss.v_empty[last_stage]);
    } else {
      Barrier::arrive(&ss.q_empty[q_slot]);  // (and the tile record it read)
    }
  }

  // The thread holding column 0 of a row writes that row's LSE.
  Tensor tOcO = rowcol(cO);
  if (get<1>(tOcO(0, 0)) == 0) {
    float* lse_rows =
        reinterpret_cast<float*>(p.lse) + (int64_t(w.entry) * p.heads_q + w.head) * p.total_q + w.q_begin;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = w.row0 + get<0>(tOcO(r, 0));
      if (row >= 0 && row < seqlen_q) {
        lse_rows[row] = lse[r];
      }
    }
  }
}

}  // namespace flashkiln::hopper
