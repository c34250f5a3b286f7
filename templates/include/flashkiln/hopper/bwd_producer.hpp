// The Hopper backward's producer (bwd_kernel.hpp): one thread of warpgroup 0 loads K and V once,
// then Q, dO (and a bias tile) of every query tile of the sweep through the ring of kStages
// buffers, and stores the dS tiles that are a full bias's dBias.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/sequence.hpp>
#include <flashkiln/hopper/bwd_params.hpp>
#include <flashkiln/hopper/bwd_schedule.hpp>
#include <flashkiln/hopper/bwd_traits.hpp>
#include <flashkiln/hopper/pipeline.hpp>
#include <flashkiln/hopper/timeline.hpp>

namespace flashkiln::hopper {

using namespace cute;

// Query tile m's dS, which the consumers left in the bias tile of `stage`, to the dBias of a full
// bias (HopperBwdParams::tma_dbias: a sequence's plane, clipped at its rows and keys), with its reads
// of the stage done on return.
template <class T>
__device__ __forceinline__ void store_ds_tile(HopperBwdParams const& p, typename T::SharedStorage& ss,
                                              Sequence const& s, int stage, int m, int n_block, int head) {
  CUTE_UNROLL
  for (int c = 0; c < T::kBlockN / T::kBoxCols; ++c) {
    cute::SM90_TMA_STORE_4D::copy(&p.tma_dbias, ss.bias.tiles + stage * T::kElemsBias + c * T::kBlockM * T::kBoxCols,
                                  n_block * T::kBlockN + c * T::kBoxCols, m * T::kBlockM, head, s.batch);
  }
  cute::tma_store_arrive();
  cute::tma_store_wait<0>();
}

// Token coordinates fit in int (runtime/varlen.py).
template <class T>
__device__ __forceinline__ void produce(HopperBwdParams const& p, typename T::SharedStorage& ss, Sequence const& s,
                                        int n_block, int head) {
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_q));
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_k));
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_v));
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_do));
  if constexpr (T::kBias) {
    cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_bias));
  }
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const int entry = int(s.layout_batch());
  const int key_row = int(s.k_begin) + n_block * T::kBlockN;
  TxBarrier::arrive_and_expect_tx(&ss.kv_full, T::kBytesK + T::kBytesV);
  CUTE_UNROLL
  for (int c = 0; c < T::kQKBoxes; ++c) {
    tma_load(&p.tma_k, &ss.kv_full, ss.k + c * T::kBlockN * T::kQKBoxCols, c * T::kQKBoxCols, key_row, head_kv,
             entry);
  }
  CUTE_UNROLL
  for (int c = 0; c < T::kVBoxes; ++c) {
    tma_load(&p.tma_v, &ss.kv_full, ss.v + c * T::kBlockN * T::kVBoxCols, c * T::kVBoxCols, key_row, head_kv, entry);
  }
  const QuerySweep sweep = query_sweep<T>(p, s, n_block);
  // A full bias's dBias: the consumers leave each tile's dS in its stage's bias tile, which this
  // thread stores once they release the stage, before the stage's next load or after the last.
  const int drain = T::kBiasGrad && p.ds_workspace != 0 ? T::kStages : 0;
  PipelineState<T::kStages> st;
  for (int i = 0; i < sweep.count + drain; ++i, st.advance()) {
    const int held = i - T::kStages;  // the sweep's tile that this stage last held
    if (i < sweep.count || held >= 0) {
      Barrier::wait(&ss.q_empty[st.stage], st.phase ^ 1);
    }
    if constexpr (T::kBiasGrad) {
      if (drain != 0 && held >= 0) {
        const TimelineSpan store = timeline_span();
        store_ds_tile<T>(p, ss, s, st.stage, sweep.tile(held), n_block, head);
        timeline_add_span(kDsStoreClocks, store);
      }
    }
    if (i >= sweep.count) {
      continue;
    }
    const int m = sweep.tile(i);
    const uint32_t bias_bytes = !T::kBias ? 0 : p.bias_row_step ? T::kBytesBias : T::kBytesBiasRow;
    TxBarrier::arrive_and_expect_tx(&ss.q_full[st.stage], T::kBytesQ + T::kBytesDo + bias_bytes);
    const int row = int(s.q_begin) + m * T::kBlockM;
    CUTE_UNROLL
    for (int c = 0; c < T::kQKBoxes; ++c) {
      tma_load(&p.tma_q, &ss.q_full[st.stage], ss.q + st.stage * T::kElemsQ + c * T::kBlockM * T::kQKBoxCols,
               c * T::kQKBoxCols, row, head, entry);
    }
    CUTE_UNROLL
    for (int c = 0; c < T::kVBoxes; ++c) {
      tma_load(&p.tma_do, &ss.q_full[st.stage], ss.dout + st.stage * T::kElemsDo + c * T::kBlockM * T::kVBoxCols,
               c * T::kVBoxCols, row, head, entry);
    }
    if constexpr (T::kBias) {
      // The bias is (batch, heads, seqlen_q, seqlen_k) per sequence (a packed batch's too); one
      // row of it where it is broadcast over the rows.
      CUTE_UNROLL
      for (int c = 0; c < T::kBlockN / T::kBoxCols; ++c) {
        tma_load(&p.tma_bias, &ss.q_full[st.stage],
                 ss.bias.tiles + st.stage * T::kElemsBias + c * T::kBlockM * T::kBoxCols,
                 n_block * T::kBlockN + c * T::kBoxCols, m * T::kBlockM * p.bias_row_step,
                 head * p.bias_head_step, s.batch * p.bias_batch_step);
      }
    }
  }
  if (drain != 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

}  // namespace flashkiln::hopper
