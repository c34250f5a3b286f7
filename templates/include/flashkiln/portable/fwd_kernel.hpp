// Portable attention forward (FlashAttention-2 style): one CTA per (query tile, head, batch),
// K/V tiles streamed through shared memory with cp.async, Q K^T and P V on mma.sync, an online
// softmax in fp32 between them, and O and LSE written once at the end.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/fragment.hpp>
#include <flashkiln/common/masking.hpp>
#include <flashkiln/common/math.hpp>
#include <flashkiln/common/online_softmax.hpp>
#include <flashkiln/common/sequence.hpp>
#include <flashkiln/common/softcap.hpp>
#include <flashkiln/common/visibility.hpp>
#include <flashkiln/params.hpp>
#include <flashkiln/portable/bias.hpp>
#include <flashkiln/portable/fwd_traits.hpp>
#include <flashkiln/portable/tile_ops.hpp>

namespace flashkiln::portable {

using namespace cute;

template <class T>
__device__ __forceinline__ void fwd_kernel(FwdParams const& p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM;
  constexpr int kBlockN = T::kBlockN;
  constexpr bool kIsCausal = T::kCausal != Causal::none;

  extern __shared__ __align__(128) char smem[];
  const int tidx = threadIdx.x;
  // Under a causal mask later query tiles see more keys: start those first so that the grid's
  // tail holds the short tiles.
  const int m_block = kIsCausal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const Sequence seq = sequence_of(p, batch);
  if (m_block * kBlockM >= seq.seqlen_q) {
    return;  // a packed batch's grid covers its longest sequence
  }
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const auto vis = visibility<T::kCausal, T::kWindow>(seq.seqlen_q, seq.seqlen_k, reach_of(p));
  const int q_rows = min(kBlockM, seq.seqlen_q - m_block * kBlockM);

  // The key tiles this query tile's rows see.
  const int n_tiles = ceil_div(seq.seqlen_k, kBlockN);
  const TileRange keys = visible_key_tiles<kBlockN>(vis, m_block * kBlockM, m_block * kBlockM + q_rows, n_tiles);

  // ---- global tensors for this (sequence, head) --------------------------------------------
  auto q_base = reinterpret_cast<Element const*>(p.q) + seq.q_offset(p.q_batch_stride, p.q_row_stride) +
                head * p.q_head_stride;
  auto k_base = reinterpret_cast<Element const*>(p.k) + seq.k_offset(p.k_batch_stride, p.k_row_stride) +
                head_kv * p.k_head_stride;
  auto v_base = reinterpret_cast<Element const*>(p.v) + seq.k_offset(p.v_batch_stride, p.v_row_stride) +
                head_kv * p.v_head_stride;
  Tensor gQ = gmem_tiles<kBlockM, T::kDimQK>(q_base, seq.seqlen_q, p.q_row_stride, m_block);  // (M, dqk)
  Tensor gK = gmem_tiles<kBlockN, T::kDimQK>(k_base, seq.seqlen_k, p.k_row_stride, _);        // (N, dqk, n)
  Tensor gV = gmem_tiles<kBlockN, T::kDimV>(v_base, seq.seqlen_k, p.v_row_stride, _);         // (N, dv, n)

  // ---- shared tensors: Q (then O), and kStages buffers of K and V ----------------------------
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_k = smem_q + T::kElemsQO;
  Element* smem_v = smem_k + T::kStages * T::kElemsK;
  Element* smem_bias = smem_v + T::kStages * T::kElemsV;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename T::SmemLayoutQ{});
  Tensor sO = make_tensor(make_smem_ptr(smem_q), typename T::SmemLayoutO{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutK{});  // stage 0
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename T::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename T::SmemLayoutVt{});
  Tensor sVtPlain = make_tensor(make_smem_ptr(smem_v), typename T::SmemLayoutVtPlain{});

  // ---- global -> shared copies, with identity tensors for row predicates -----------------------
  typename T::GmemCopyQK::AsyncLoad load_qk;
  typename T::GmemCopyVO::AsyncLoad load_v;
  auto thr_load_qk = load_qk.get_thread_slice(tidx);
  auto thr_load_v = load_v.get_thread_slice(tidx);
  Tensor tQgQ = thr_load_qk.partition_S(gQ);
  Tensor tQsQ = thr_load_qk.partition_D(sQ);
  Tensor tKgK = thr_load_qk.partition_S(gK);  // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = thr_load_qk.partition_D(sK);
  Tensor tVgV = thr_load_v.partition_S(gV);
  Tensor tVsV = thr_load_v.partition_D(sV);
  Tensor tQcQ = thr_load_qk.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<T::kDimQK>>{}));
  Tensor tKcK = thr_load_qk.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<T::kDimQK>>{}));
  Tensor tVcV = thr_load_v.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<T::kDimV>>{}));

  auto load_k = [&](int n_block, int stage) {
    copy_rows<true>(load_qk, tKgK(_, _, _, n_block), at_offset(tKsK, stage * T::kElemsK), tKcK,
                    seq.seqlen_k - n_block * kBlockN);
  };
  auto load_v_tile = [&](int n_block, int stage) {
    copy_rows<true>(load_v, tVgV(_, _, _, n_block), at_offset(tVsV, stage * T::kElemsV), tVcV,
                    seq.seqlen_k - n_block * kBlockN);
  };
  // The bias tile of this query tile and key tile n_block (one buffer; see the main loop).
  using Bias = BiasTile<Element, T::kThreads, kBlockM, kBlockN>;
  auto load_bias_tile = [&](int n_block) {
    if constexpr (T::kBias) {
      typename Bias::GmemCopy::AsyncLoad load_bias;
      auto thr_load_bias = load_bias.get_thread_slice(tidx);
      Tensor sBias = make_tensor(make_smem_ptr(smem_bias), typename Bias::SmemLayout{});
      Tensor gBias = gmem_bias_tiles<kBlockM, kBlockN, Element>(p, batch, head)(_, _, m_block, n_block);
      copy_rows_cols<true>(load_bias, thr_load_bias.partition_S(gBias), thr_load_bias.partition_D(sBias),
                           thr_load_bias.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})),
                           q_rows, seq.seqlen_k - n_block * kBlockN);
    }
  };

  // ---- MMA partitions and shared -> register copies --------------------------------------------
  typename T::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);         // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);         // (MMA, MMA_N, MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtPlain);  // (MMA, MMA_DV, MMA_N)
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<T::kDimV>>{});
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename T::SmemLoad{}, tiled_mma);
  auto thr_copy_q = smem_copy_q.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename T::SmemLoad{}, tiled_mma);
  auto thr_copy_k = smem_copy_k.get_thread_slice(tidx);
  Tensor tSsK = thr_copy_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename T::SmemLoadTransposed{}, tiled_mma);
  auto thr_copy_v = smem_copy_v.get_thread_slice(tidx);
  Tensor tOsVt = thr_copy_v.partition_S(sVt);

  // (row, col) of every score this thread holds, for masking.
  Tensor tScS = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  const float inv_scale = 1.f / p.scale;

  constexpr int kRows = decltype(size<0>(rowcol(acc_o)))::value;
  OnlineSoftmax<kRows> softmax;

  if (keys.end > keys.first) {
    // ---- prologue: Q and the first key tile (both tiles' K and V with two stages) -------------
    int n_block = keys.end - 1;
    copy_rows<true>(load_qk, tQgQ, tQsQ, tQcQ, q_rows);
    load_k(n_block, 0);
    load_bias_tile(n_block);
    if constexpr (T::kStages == 2) {
      load_v_tile(n_block, 0);
      cp_async_fence();
      if (n_block > keys.first) {
        load_k(n_block - 1, 1);
        load_v_tile(n_block - 1, 1);
      }
    }
    cp_async_fence();

    // ---- main loop over key tiles, last to first (the partial and masked tiles come first) --
    for (int step = 0; n_block >= keys.first; ++step, --n_block) {
      const int stage = T::kStages == 2 ? (step & 1) : 0;
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);

      if constexpr (T::kStages == 1) {
        cp_async_wait<0>();
        __syncthreads();  // K(n) has landed, and every warp is done reading V(n + 1)
        load_v_tile(n_block, 0);
        cp_async_fence();
      } else {
        cp_async_wait<1>();
        __syncthreads();  // K(n) and V(n) have landed
      }

      gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, at_offset(tSsK, stage * T::kElemsK), smem_copy_q,
                     smem_copy_k, thr_copy_q, thr_copy_k);
      if constexpr (T::kSoftcap) {
        cap_scores(acc_s, p.softcap_scale);
      }
      if constexpr (T::kBias) {
        add_bias(acc_s, thr_mma.partition_C(make_tensor(make_smem_ptr(smem_bias), typename Bias::SmemLayout{})),
                 inv_scale);
        if constexpr (T::kStages == 2) {
          // One bias buffer: once every warp has read this tile, the next one streams in during
          // the softmax and P V (the wait at the top of the next step covers it).
          __syncthreads();
          if (n_block > keys.first) {
            load_bias_tile(n_block - 1);
          }
          cp_async_fence();
        }
      }

      if (needs_mask<kBlockM, kBlockN>(vis, m_block * kBlockM, n_block * kBlockN)) {
        mask_scores(rowcol(acc_s), tScS, vis, m_block * kBlockM, n_block * kBlockN);
      }

      if constexpr (T::kStages == 1) {
        cp_async_wait<0>();
        __syncthreads();  // V(n) has landed, and every warp is done reading K(n)
        if (n_block > keys.first) {
          load_k(n_block - 1, 0);
          load_bias_tile(n_block - 1);  // this step's bias was read before the barrier above
          cp_async_fence();
        }
      }

      if (step == 0) {
        softmax.template update<true>(rowcol(acc_s), rowcol(acc_o), p.scale_log2);
      } else {
        softmax.template update<false>(rowcol(acc_s), rowcol(acc_o), p.scale_log2);
      }

      Tensor rP = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
      gemm_regs_smem(tiled_mma, acc_o, tOrP, tOrVt, at_offset(tOsVt, stage * T::kElemsV), smem_copy_v,
                     thr_copy_v);

      if constexpr (T::kStages == 2) {
        __syncthreads();  // every warp is done reading this stage's K and V
        if (n_block - 2 >= keys.first) {
          load_k(n_block - 2, stage);
          load_v_tile(n_block - 2, stage);
        }
        cp_async_fence();  // possibly empty: keeps one group per step for the wait above
      }
    }
  }

  // ---- epilogue: normalize, O through shared memory to 16-byte global stores, then LSE ---------
  // The sequence's offsets are read again here rather than kept in registers through the loop.
  const Sequence out_seq = sequence_of(p, batch);
  auto o_base = reinterpret_cast<Element*>(p.o) + out_seq.q_offset(p.o_batch_stride, p.o_row_stride) +
                head * p.o_head_stride;
  Tensor gO = gmem_tiles<kBlockM, T::kDimV>(o_base, out_seq.seqlen_q, p.o_row_stride, m_block);  // (M, dv)
  float lse[kRows];
  const float sink = p.sink != 0 ? reinterpret_cast<float const*>(p.sink)[head] : -kInfinity;
  softmax.finalize(rowcol(acc_o), p.scale, sink, lse);
  Tensor rO = convert_fragment<Element>(acc_o);

  __syncthreads();  // O reuses Q's shared memory
  auto smem_store_o = make_tiled_copy_C(typename T::SmemStore{}, tiled_mma);
  auto thr_store_o = smem_store_o.get_thread_slice(tidx);
  copy(smem_store_o, thr_store_o.retile_S(rO), thr_store_o.partition_D(sO));
  __syncthreads();

  typename T::GmemCopyVO::Move move_o;
  auto thr_move_o = move_o.get_thread_slice(tidx);
  Tensor tOsO = thr_move_o.partition_S(sO);
  Tensor tOgO = thr_move_o.partition_D(gO);
  Tensor tOcO = thr_move_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<T::kDimV>>{}));
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(move_o, tOsO, tOrO);
  copy_rows<false>(move_o, tOrO, tOgO, tOcO, q_rows);

  // The thread holding column 0 of a row writes that row's LSE.
  Tensor tOcAcc = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<T::kDimV>>{})));
  if (get<1>(tOcAcc(0, 0)) == 0) {
    float* lse_row = reinterpret_cast<float*>(p.lse) + out_seq.q_row(p, head) + m_block * kBlockM;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(tOcAcc(r, 0));
      if (row < q_rows) {
        lse_row[row] = lse[r];
      }
    }
  }
}

}  // namespace flashkiln::portable
