// The deterministic workspace route's dQ kernel: one CTA per (query tile, head, batch) sums
// dS K over the key tiles that visited its query tile, from the first to the last (a fixed
// order, so dQ is bitwise reproducible), then writes dQ scaled and converted. dS comes from the
// main kernel's workspace (see bwd_tiles.hpp); its hidden entries are already zero, and pieces
// past the sequence ends are zero-filled on load.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/math.hpp>
#include <flashkiln/common/sequence.hpp>
#include <flashkiln/common/visibility.hpp>
#include <flashkiln/params.hpp>
#include <flashkiln/portable/bwd_tiles.hpp>
#include <flashkiln/portable/bwd_traits.hpp>
#include <flashkiln/portable/tile_ops.hpp>

namespace flashkiln::portable {

using namespace cute;

template <class T>
__device__ __forceinline__ void bwd_dq_kernel(BwdParams const& p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM;
  constexpr int kBlockN = T::kBlockN;
  constexpr int kDimQK = T::kDimQK;

  extern __shared__ __align__(128) char smem[];
  const int tidx = threadIdx.x;
  // Under a causal mask later query tiles sum more key tiles: start those first.
  const int m_block = T::kCausal != Causal::none ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const Sequence seq = sequence_of(p, batch);
  if (m_block * kBlockM >= seq.seqlen_q) {
    return;  // a packed batch's grid covers its longest sequence
  }
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const int64_t bh = int64_t(batch) * p.heads_q + head;
  // The key tiles that visited this query tile: those its whole rows see (the dual of the main
  // kernel's visiting_query_tiles).
  const auto vis = visibility<T::kCausal, T::kWindow>(seq.seqlen_q, seq.seqlen_k, reach_of(p));
  const TileRange keys = visible_key_tiles<kBlockN>(vis, m_block * kBlockM, (m_block + 1) * kBlockM,
                                                    ceil_div(seq.seqlen_k, kBlockN));
  const int n_first = keys.first, n_end = keys.end;

  auto k_base = reinterpret_cast<Element const*>(p.k) + seq.k_offset(p.k_batch_stride, p.k_row_stride) +
                head_kv * p.k_head_stride;
  auto dq_base = reinterpret_cast<Element*>(p.dq) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride) +
                 head * p.dq_head_stride;
  Tensor gK = gmem_tiles<kBlockN, kDimQK>(k_base, seq.seqlen_k, p.k_row_stride, _);  // (N, dqk, n)
  Tensor gdQ = gmem_tiles<kBlockM, kDimQK>(dq_base, seq.seqlen_q, p.dq_row_stride, m_block);  // (M, dqk)

  Element* smem_ds = reinterpret_cast<Element*>(smem);
  Element* smem_k = smem_ds + T::kStages * T::kElemsdS;
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename T::SmemLayoutdS{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutKt{});
  Tensor sKtPlain = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutKtPlain{});

  // ---- global -> shared: whole dS tiles, and K tiles zero-filled past the sequence end ---------
  typename T::GmemCopydS::AsyncLoad load_ds;
  typename T::GmemCopyQK::AsyncLoad load_k;
  auto thr_load_ds = load_ds.get_thread_slice(tidx);
  auto thr_load_k = load_k.get_thread_slice(tidx);
  Tensor tKgK = thr_load_k.partition_S(gK);
  Tensor tKsK = thr_load_k.partition_D(sK);
  Tensor tKcK = thr_load_k.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kDimQK>>{}));
  Tensor tdSsdS = thr_load_ds.partition_D(sdS);
  Tensor tdScdS = thr_load_ds.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor gdS = ds_workspace_tiles<Element, kBlockM, kBlockN>(p, bh);  // (M, N, m, n)
  auto load_tiles = [&](int n_block, int stage) {
    copy_rows_cols<true>(load_ds, thr_load_ds.partition_S(gdS(_, _, m_block, n_block)),
                         at_offset(tdSsdS, stage * T::kElemsdS), tdScdS, seq.seqlen_q - m_block * kBlockM,
                         seq.seqlen_k - n_block * kBlockN);
    copy_rows<true>(load_k, tKgK(_, _, _, n_block), at_offset(tKsK, stage * T::kElemsK), tKcK,
                    seq.seqlen_k - n_block * kBlockN);
  };

  // ---- dQ = sum over n of dS_n K_n ---------------------------------------------------------------
  typename T::TiledMmaQ mma;
  auto thr_mma = mma.get_slice(tidx);
  Tensor rdS = thr_mma.partition_fragment_A(sdS);
  Tensor rKt = thr_mma.partition_fragment_B(sKtPlain);
  auto copy_a = make_tiled_copy_A(typename T::SmemLoad{}, mma);
  auto copy_b = make_tiled_copy_B(typename T::SmemLoadTransposed{}, mma);
  auto thr_copy_a = copy_a.get_thread_slice(tidx);
  auto thr_copy_b = copy_b.get_thread_slice(tidx);
  Tensor tsdS = thr_copy_a.partition_S(sdS);
  Tensor tsKt = thr_copy_b.partition_S(sKt);
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kDimQK>>{});
  clear(acc);

  if (n_end > n_first) {
    load_tiles(n_first, 0);
    cp_async_fence();
    if constexpr (T::kStages == 2) {
      if (n_end > n_first + 1) {
        load_tiles(n_first + 1, 1);
      }
      cp_async_fence();
    }
  }
  for (int n_block = n_first; n_block < n_end; ++n_block) {
    const int stage = T::kStages == 2 ? ((n_block - n_first) & 1) : 0;
    cp_async_wait<T::kStages - 1>();
    __syncthreads();  // this step's dS and K tiles have landed
    gemm_smem_smem(mma, acc, rdS, rKt, at_offset(tsdS, stage * T::kElemsdS), at_offset(tsKt, stage * T::kElemsK),
                   copy_a, copy_b, thr_copy_a, thr_copy_b);
    __syncthreads();  // every warp is done with this stage's buffers
    if (n_block + T::kStages < n_end) {
      load_tiles(n_block + T::kStages, stage);
    }
    cp_async_fence();  // possibly empty: one group per step keeps the wait above uniform
  }

  // Rows that no key tile visits (they see no key) get zeros, as the convention asks.
  store_accumulator(acc, thr_mma.partition_C(gdQ),
                    thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kDimQK>>{})), p.scale,
                    seq.seqlen_q - m_block * kBlockM);
}

}  // namespace flashkiln::portable
