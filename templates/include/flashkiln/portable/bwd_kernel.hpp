// Portable attention backward, main kernel (FlashAttention-2 style): one CTA per (key tile, head,
// batch) keeps its K and V tiles and its dK, dV accumulators on chip and walks the query tiles:
// recompute P from Q, K and the forward's LSE; dV += P^T dO; dP = dO V^T; dS = P (dP - delta);
// dK += dS^T Q; dQ += dS K into an fp32 accumulator in global memory (atomics, or in key-tile
// order when deterministic). Softmax scale: applied to dK here and to dQ by the postprocess.
// Deterministic variants have a second route, chosen at launch by a non-null p.ds_workspace: they
// store each dS tile there instead, and bwd_dq_kernel.hpp computes dQ = dS K afterwards.
#pragma once

#include <cuda/atomic>
#include <cute/tensor.hpp>

#include <flashkiln/common/fragment.hpp>
#include <flashkiln/common/global_reduce.hpp>
#include <flashkiln/common/masking.hpp>
#include <flashkiln/common/math.hpp>
#include <flashkiln/common/sequence.hpp>
#include <flashkiln/common/softcap.hpp>
#include <flashkiln/common/visibility.hpp>
#include <flashkiln/params.hpp>
#include <flashkiln/portable/bias.hpp>
#include <flashkiln/portable/bwd_tiles.hpp>
#include <flashkiln/portable/bwd_traits.hpp>
#include <flashkiln/portable/tile_ops.hpp>

namespace flashkiln::portable {

using namespace cute;

// dst += acc with fp32 reductions in global memory. Accumulator fragments hold column pairs
// (2c, 2c+1) at indices (2i, 2i+1), adjacent in memory: on Hopper reduce_add_pair adds both at
// once (profiled: with scalar reductions the LSU queue throttled issue, the top stall reason).
template <class Dst, class Acc>
__device__ __forceinline__ void atomic_add_fragment(Dst&& dst, Acc const& acc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(decltype(size<0, 0>(acc))::value == 2, "accumulator fragments start with a column pair");
  static_assert(decltype(stride<0, 0>(dst.layout()))::value == 1, "the column pair must be contiguous");
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    reduce_add_pair(&dst(i), acc(i), acc(i + 1));
  }
#else
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    atomicAdd(&dst(i), acc(i));
  }
#endif
}

template <class T>
__device__ __forceinline__ void bwd_kernel(BwdParams const& p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM;
  constexpr int kBlockN = T::kBlockN;
  constexpr int kDimQK = T::kDimQK;
  constexpr int kDimV = T::kDimV;

  extern __shared__ __align__(128) char smem[];
  const int tidx = threadIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const Sequence seq = sequence_of(p, batch);
  const int n_tiles = ceil_div(seq.seqlen_k, kBlockN);  // gridDim.x, unless a packed batch's is shorter
  // This CTA holds every key of its rows, and out and lse are of those keys: exact deltas (below).
  const bool whole_rows = n_tiles == 1 && p.keys_complete;
  // Ordered dQ route: key tiles add into each query tile from the last one down (see below), and
  // each CTA may only wait for CTAs launched before it, so tile n_tiles - 1 gets the first CTA.
  // Otherwise tile 0 goes first: under a causal mask it visits the most query tiles.
  const bool ordered_dq = T::kDeterministic && p.ds_workspace == 0;
  const int n_block = ordered_dq ? n_tiles - 1 - int(blockIdx.x) : int(blockIdx.x);
  if (n_block < 0 || n_block >= n_tiles) {
    return;
  }
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const auto vis = visibility<T::kCausal, T::kWindow>(seq.seqlen_q, seq.seqlen_k, reach_of(p));
  const int k_rows = min(kBlockN, seq.seqlen_k - n_block * kBlockN);
  // The query tiles that see this key tile.
  const TileRange queries = visiting_query_tiles<kBlockM, kBlockN>(vis, n_block, ceil_div(seq.seqlen_q, kBlockM));
  const int m_begin = queries.first;
  const int m_blocks = queries.end;
  const int64_t bh = int64_t(batch) * p.heads_q + head;

  // ---- global tensors ---------------------------------------------------------------------------
  auto q_base = reinterpret_cast<Element const*>(p.q) + seq.q_offset(p.q_batch_stride, p.q_row_stride) +
                head * p.q_head_stride;
  auto do_base = reinterpret_cast<Element const*>(p.dout) + seq.q_offset(p.do_batch_stride, p.do_row_stride) +
                 head * p.do_head_stride;
  auto k_base = reinterpret_cast<Element const*>(p.k) + seq.k_offset(p.k_batch_stride, p.k_row_stride) +
                head_kv * p.k_head_stride;
  auto v_base = reinterpret_cast<Element const*>(p.v) + seq.k_offset(p.v_batch_stride, p.v_row_stride) +
                head_kv * p.v_head_stride;
  float const* lse = reinterpret_cast<float const*>(p.lse) + seq.q_row(p, head);
  float const* delta = reinterpret_cast<float const*>(p.delta) + seq.q_row(p, head);
  Tensor gQ = gmem_tiles<kBlockM, kDimQK>(q_base, seq.seqlen_q, p.q_row_stride, _);     // (M, dqk, m)
  Tensor gdO = gmem_tiles<kBlockM, kDimV>(do_base, seq.seqlen_q, p.do_row_stride, _);   // (M, dv, m)
  Tensor gK = gmem_tiles<kBlockN, kDimQK>(k_base, seq.seqlen_k, p.k_row_stride, n_block);  // (N, dqk)
  Tensor gV = gmem_tiles<kBlockN, kDimV>(v_base, seq.seqlen_k, p.v_row_stride, n_block);   // (N, dv)
  // The dQ accumulator has whole tiles of rows per sequence, so tiles are added unguarded.
  static_assert(kDqAccumRowAlign % kBlockM == 0, "the dQ accumulator rounds sequences to whole tiles");
  Tensor gdQacc = gmem_tiles<kBlockM, kDimQK>(reinterpret_cast<float*>(p.dq_accum) + seq.dq_accum_row(p, head) * kDimQK,
                                              seq.dq_accum_rows(), kDimQK, _);  // (M, dqk, m)

  // ---- shared tensors ---------------------------------------------------------------------------
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_do = smem_q + T::kStages * T::kElemsQ;
  Element* smem_k = smem_do + T::kStages * T::kElemsdO;
  Element* smem_v = smem_k + kBlockN * kDimQK;
  Element* smem_p = smem_v + kBlockN * kDimV;
  Element* smem_ds = smem_p + T::kElemsPdS;
  Element* smem_bias = smem_ds + T::kElemsPdS;  // kStages bias tiles (kBias)
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename T::SmemLayoutQ{});  // stage 0
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename T::SmemLayoutQt{});
  Tensor sQtPlain = make_tensor(make_smem_ptr(smem_q), typename T::SmemLayoutQtPlain{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename T::SmemLayoutdO{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename T::SmemLayoutdOt{});
  Tensor sdOtPlain = make_tensor(make_smem_ptr(smem_do), typename T::SmemLayoutdOtPlain{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutKt{});
  Tensor sKtPlain = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutKtPlain{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename T::SmemLayoutV{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename T::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename T::SmemLayoutPdSt{});
  Tensor sPtPlain = make_tensor(make_smem_ptr(smem_p), typename T::SmemLayoutPdStPlain{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename T::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename T::SmemLayoutPdSt{});
  Tensor sdStPlain = make_tensor(make_smem_ptr(smem_ds), typename T::SmemLayoutPdStPlain{});

  // ---- global -> shared copies ------------------------------------------------------------------
  typename T::GmemCopyQK::AsyncLoad load_qk;
  typename T::GmemCopyVO::AsyncLoad load_vo;
  auto thr_load_qk = load_qk.get_thread_slice(tidx);
  auto thr_load_vo = load_vo.get_thread_slice(tidx);
  Tensor tQgQ = thr_load_qk.partition_S(gQ);  // (CPY, CPY_M, CPY_D, m)
  Tensor tQsQ = thr_load_qk.partition_D(sQ);
  Tensor tQcQ = thr_load_qk.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kDimQK>>{}));
  Tensor tdOgdO = thr_load_vo.partition_S(gdO);
  Tensor tdOsdO = thr_load_vo.partition_D(sdO);
  Tensor tdOcdO = thr_load_vo.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kDimV>>{}));

  Tensor sBias = make_tensor(make_smem_ptr(smem_bias), typename T::SmemLayoutPdS{});  // stage 0
  typename T::GmemCopydS::AsyncLoad load_bias;
  auto thr_load_bias = load_bias.get_thread_slice(tidx);
  Tensor tBsB = thr_load_bias.partition_D(sBias);
  Tensor tBcB = thr_load_bias.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

  auto load_query_tile = [&](int m_block, int stage) {
    const int rows = seq.seqlen_q - m_block * kBlockM;
    copy_rows<true>(load_qk, tQgQ(_, _, _, m_block), at_offset(tQsQ, stage * T::kElemsQ), tQcQ, rows);
    copy_rows<true>(load_vo, tdOgdO(_, _, _, m_block), at_offset(tdOsdO, stage * T::kElemsdO), tdOcdO, rows);
    if constexpr (T::kBias) {
      Tensor gBias = gmem_bias_tiles<kBlockM, kBlockN, Element>(p, batch, head)(_, _, m_block, n_block);
      copy_rows_cols<true>(load_bias, thr_load_bias.partition_S(gBias), at_offset(tBsB, stage * T::kElemsBias),
                           tBcB, rows, seq.seqlen_k - n_block * kBlockN);
    }
  };

  // ---- MMA partitions ---------------------------------------------------------------------------
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmaKV mma_kv;
  typename T::TiledMmaQ mma_q;
  auto thr_sdp = mma_sdp.get_slice(tidx);
  auto thr_kv = mma_kv.get_slice(tidx);
  auto thr_q = mma_q.get_slice(tidx);

  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  Tensor tdVrPt = thr_kv.partition_fragment_A(sPtPlain);
  Tensor tdVrdOt = thr_kv.partition_fragment_B(sdOtPlain);
  Tensor tdKrdSt = thr_kv.partition_fragment_A(sdStPlain);
  Tensor tdKrQt = thr_kv.partition_fragment_B(sQtPlain);
  Tensor tdQrdS = thr_q.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_q.partition_fragment_B(sKtPlain);

  auto copy_a_sdp = make_tiled_copy_A(typename T::SmemLoad{}, mma_sdp);
  auto copy_b_sdp = make_tiled_copy_B(typename T::SmemLoad{}, mma_sdp);
  auto copy_a_kv = make_tiled_copy_A(typename T::SmemLoadTransposed{}, mma_kv);
  auto copy_b_kv = make_tiled_copy_B(typename T::SmemLoadTransposed{}, mma_kv);
  auto copy_a_q = make_tiled_copy_A(typename T::SmemLoad{}, mma_q);
  auto copy_b_q = make_tiled_copy_B(typename T::SmemLoadTransposed{}, mma_q);
  auto thr_copy_a_sdp = copy_a_sdp.get_thread_slice(tidx);
  auto thr_copy_b_sdp = copy_b_sdp.get_thread_slice(tidx);
  auto thr_copy_a_kv = copy_a_kv.get_thread_slice(tidx);
  auto thr_copy_b_kv = copy_b_kv.get_thread_slice(tidx);
  auto thr_copy_a_q = copy_a_q.get_thread_slice(tidx);
  auto thr_copy_b_q = copy_b_q.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_a_sdp.partition_S(sQ);
  Tensor tSsK = thr_copy_b_sdp.partition_S(sK);
  Tensor tdPsdO = thr_copy_a_sdp.partition_S(sdO);
  Tensor tdPsV = thr_copy_b_sdp.partition_S(sV);
  Tensor tdVsPt = thr_copy_a_kv.partition_S(sPt);
  Tensor tdVsdOt = thr_copy_b_kv.partition_S(sdOt);
  Tensor tdKsdSt = thr_copy_a_kv.partition_S(sdSt);
  Tensor tdKsQt = thr_copy_b_kv.partition_S(sQt);
  Tensor tdQsdS = thr_copy_a_q.partition_S(sdS);
  Tensor tdQsKt = thr_copy_b_q.partition_S(sKt);

  auto store_sdp = make_tiled_copy_C(typename T::SmemStore{}, mma_sdp);
  auto thr_store_sdp = store_sdp.get_thread_slice(tidx);
  Tensor tPsP = thr_store_sdp.partition_D(sP);
  Tensor tdSsdS = thr_store_sdp.partition_D(sdS);

  Tensor tScS = rowcol(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  Tensor tSsBias = thr_sdp.partition_C(sBias);
  const float inv_scale = 1.f / p.scale;
  [[maybe_unused]] const float inv_scale_log2 = 1.f / p.scale_log2;  // softcap_slope's
  Tensor tdQgdQacc = thr_q.partition_C(gdQacc);  // (MMA, MMA_M, MMA_DQK, m)

  // This key tile's contribution dS K to the current query tile's dQ.
  auto dq_contribution = [&]() {
    Tensor acc_dq = partition_fragment_C(mma_q, Shape<Int<kBlockM>, Int<kDimQK>>{});
    clear(acc_dq);
    gemm_smem_smem(mma_q, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_a_q, copy_b_q, thr_copy_a_q, thr_copy_b_q);
    return acc_dq;
  };
  // Key tiles add into a query tile's dQ in a fixed order, from its last visiting key tile down
  // to its first: the key tiles that visit it are visible_key_tiles of its whole rows (the dual of
  // visiting_query_tiles), one unbroken range, so waiting for n_last - n_block earlier additions
  // is exact. Under a causal mask tile n + 1 starts n's query tiles' sweep earlier, so
  // in steady state nobody waits; without a mask the CTAs of a head fall into a one-step lag
  // behind each other.
  auto add_dq_in_order = [&](int m_block, auto const& acc_dq) {
    const int n_last = visible_key_tiles<kBlockN>(vis, m_block * kBlockM, (m_block + 1) * kBlockM, n_tiles).end - 1;
    cuda::atomic_ref<int, cuda::thread_scope_device> turn(
        reinterpret_cast<int*>(p.dq_semaphore)[bh * (p.seqlen_q_rounded / kBlockM) + m_block]);
    if (tidx == 0) {
      while (turn.load(cuda::memory_order_acquire) != n_last - n_block) {
      }
    }
    __syncthreads();
    atomic_add_fragment(tdQgdQacc(_, _, _, m_block), acc_dq);
    // The barrier orders every thread's additions before thread 0's gpu-scope release (PTX
    // release is cumulative over what the barrier made it observe), so only thread 0's warp
    // waits for the additions to land; the other warps go on to the dK GEMM.
    __syncthreads();
    if (tidx == 0) {
      turn.fetch_add(1, cuda::memory_order_release);
    }
  };
  // delta of this thread's rows as rowsum(P * dP) - dLSE, from each thread's partial row sums of a
  // tile that holds every key (a fixed-order sum: the quad's lanes, then the warps along N). The
  // partials pass through P's shared buffer, free until this step's P is stored.
  auto whole_row_deltas = [&](auto const& partial, auto& row_delta, int m_block) {
    constexpr int kWarpsN = T::kWarps / T::kWarpsSdP;
    const int warp_n = tidx / 32 / T::kWarpsSdP;  // a TiledMMA's warps run along M first
    float* row_sums = reinterpret_cast<float*>(smem_p);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(tScS); ++r) {
      float x = partial[r];
      x += __shfl_xor_sync(0xffffffff, x, 1);  // the four lanes of a quad hold one row's columns
      x += __shfl_xor_sync(0xffffffff, x, 2);
      if (tidx % 4 == 0) {
        row_sums[get<0>(tScS(r, 0)) * kWarpsN + warp_n] = x;
      }
    }
    __syncthreads();
    CUTE_UNROLL
    for (int r = 0; r < size<0>(tScS); ++r) {
      const int local = get<0>(tScS(r, 0));
      float total = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        total += row_sums[local * kWarpsN + w];
      }
      const int row = m_block * kBlockM + local;
      const bool has_dlse = p.dlse != 0 && row < seq.seqlen_q;
      const float dlse = has_dlse ? reinterpret_cast<float const*>(p.dlse)[seq.q_row(p, head) + row] : 0.f;
      row_delta[r] = total - dlse;
    }
    __syncthreads();  // every thread has read its sums before P overwrites them
  };
  typename T::GmemCopydS::Move store_ds;
  auto thr_store_ds = store_ds.get_thread_slice(tidx);
  Tensor tDScDS = thr_store_ds.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

  // dSink's exact share (BwdParams::dsink_parts): delta = rowsum(dO * O) uses the rounded O, but
  // rowsum(P * dP) over every key is the same quantity from unrounded P and dP. Each warp's lane 0
  // adds its warp's share of each step into the warp's slot here (in step order: deterministic),
  // which keeps the running sum out of the main loop's registers.
  __shared__ float warp_sink_sums[T::kWarps];
  if (tidx % 32 == 0) {
    warp_sink_sums[tidx / 32] = 0.f;
  }

  Tensor acc_dk = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kDimQK>>{});
  Tensor acc_dv = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kDimV>>{});
  clear(acc_dk);
  clear(acc_dv);

  if (m_begin < m_blocks) {
    // ---- prologue: K and V of this tile, and the first query tile(s) -----------------------------
    {
      Tensor tKgK = thr_load_qk.partition_S(gK);
      Tensor tKcK = thr_load_qk.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kDimQK>>{}));
      Tensor tVgV = thr_load_vo.partition_S(gV);
      Tensor tVcV = thr_load_vo.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kDimV>>{}));
      copy_rows<true>(load_qk, tKgK, thr_load_qk.partition_D(sK), tKcK, k_rows);
      copy_rows<true>(load_vo, tVgV, thr_load_vo.partition_D(sV), tVcV, k_rows);
    }
    load_query_tile(m_begin, 0);
    cp_async_fence();
    if constexpr (T::kStages == 2) {
      if (m_begin + 1 < m_blocks) {
        load_query_tile(m_begin + 1, 1);
      }
      cp_async_fence();
    }

    constexpr int kRows = decltype(size<0>(tScS))::value;
    for (int m_block = m_begin, step = 0; m_block < m_blocks; ++m_block, ++step) {
      const int stage = T::kStages == 2 ? (step & 1) : 0;
      // This thread's rows of the (M, N) tile: LSE (base 2; +inf for rows that see no key or lie
      // past the end, so their P is 0) and delta (rowsum(dO * O) - dLSE, from the preprocess).
      float lse_log2[kRows], row_delta[kRows];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = m_block * kBlockM + get<0>(tScS(r, 0));
        const float l = row < seq.seqlen_q ? lse[row] : -kInfinity;
        lse_log2[r] = l == -kInfinity ? kInfinity : l * kLog2e;
        row_delta[r] = row < seq.seqlen_q ? delta[row] : 0.f;
      }

      cp_async_wait<T::kStages - 1>();
      __syncthreads();  // this step's Q and dO (and K, V) have landed

      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      clear(acc_dp);
      gemm_smem_smem(mma_sdp, acc_s, tSrQ, tSrK, at_offset(tSsQ, stage * T::kElemsQ), tSsK, copy_a_sdp,
                     copy_b_sdp, thr_copy_a_sdp, thr_copy_b_sdp);
      if constexpr (T::kSoftcap) {
        cap_scores(acc_s, p.softcap_scale);
      }
      if constexpr (T::kBias) {
        add_bias(acc_s, at_offset(tSsBias, stage * T::kElemsBias), inv_scale);
      }
      gemm_smem_smem(mma_sdp, acc_dp, tdPrdO, tdPrV, at_offset(tdPsdO, stage * T::kElemsdO), tdPsV, copy_a_sdp,
                     copy_b_sdp, thr_copy_a_sdp, thr_copy_b_sdp);

      Tensor s = rowcol(acc_s);
      Tensor dp = rowcol(acc_dp);
      if (needs_mask<kBlockM, kBlockN>(vis, m_block * kBlockM, n_block * kBlockN)) {
        mask_scores(s, tScS, vis, m_block * kBlockM, n_block * kBlockN);
      }
      // P = exp(scale * s - lse) and dS = P (dP - delta), in place of the accumulators; with
      // dSink asked for, also this thread's share of sum p_sink * P * dP. When the CTA holds every
      // key of its rows (one key tile, and out and lse of those keys alone: p.keys_complete), delta
      // is their rowsum(P * dP) itself, from unrounded P and
      // dP: the preprocess's rowsum(dO * O) carries the rounding of the forward's O, which
      // dominates dS = P (dP - delta) where P sits on few keys (there dP ~ delta). A softcap
      // scales dS by its slope (common/softcap.hpp).
      auto ds_of = [&](float prob, float dp_minus_delta, int r) {
        if constexpr (T::kSoftcap) {
          return prob * dp_minus_delta * softcap_slope(prob, lse_log2[r], inv_scale_log2, p.softcap_scale);
        }
        return prob * dp_minus_delta;
      };
      auto probabilities_and_ds = [&](auto exact_sums) {
        if constexpr (!decltype(exact_sums)::value) {
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(s); ++c) {
              const float prob = exp2f(fmaf(s(r, c), p.scale_log2, -lse_log2[r]));
              s(r, c) = prob;
              dp(r, c) = ds_of(prob, dp(r, c) - row_delta[r], r);
            }
          }
        } else {
          // The rarer path (one instantiation, so that the common one keeps its registers): this
          // thread's row sums of P * dP first, then dSink's share and the whole rows' delta.
          float row_pdp[kRows];
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            row_pdp[r] = 0.f;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(s); ++c) {
              s(r, c) = exp2f(fmaf(s(r, c), p.scale_log2, -lse_log2[r]));
              row_pdp[r] = fmaf(s(r, c), dp(r, c), row_pdp[r]);
            }
          }
          if (p.dsink_parts != 0) {
            const float sink_log2 = reinterpret_cast<float const*>(p.sink)[head] * kLog2e;
            float share = 0.f;
            CUTE_UNROLL
            for (int r = 0; r < kRows; ++r) {
              share = fmaf(exp2f(sink_log2 - lse_log2[r]), row_pdp[r], share);
            }
            CUTE_UNROLL
            for (int offset = 16; offset > 0; offset /= 2) {
              share += __shfl_xor_sync(0xffffffff, share, offset);
            }
            if (tidx % 32 == 0) {
              warp_sink_sums[tidx / 32] += share;
            }
          }
          if (whole_rows) {
            whole_row_deltas(row_pdp, row_delta, m_block);
          }
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(s); ++c) {
              dp(r, c) = ds_of(s(r, c), dp(r, c) - row_delta[r], r);
            }
          }
        }
      };
      if (p.dsink_parts != 0 || whole_rows) {
        probabilities_and_ds(cute::true_type{});
      } else {
        probabilities_and_ds(cute::false_type{});
      }
      Tensor rP = convert_fragment<Element>(acc_s);
      Tensor rdS = convert_fragment<Element>(acc_dp);
      copy(store_sdp, thr_store_sdp.retile_S(rP), tPsP);
      copy(store_sdp, thr_store_sdp.retile_S(rdS), tdSsdS);
      __syncthreads();  // P and dS are in shared memory for their transposed reads

      gemm_smem_smem(mma_kv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, at_offset(tdVsdOt, stage * T::kElemsdO), copy_a_kv,
                     copy_b_kv, thr_copy_a_kv, thr_copy_b_kv);

      if constexpr (T::kDeterministic) {
        if (ordered_dq) {
          add_dq_in_order(m_block, dq_contribution());
        } else {
          // Workspace route: dS leaves as is (the pieces inside the sequences; masked entries
          // are zeros); the dQ kernel sums dS K in key-tile order.
          copy_rows_cols<false>(store_ds, thr_store_ds.partition_S(sdS),
                                thr_store_ds.partition_D(ds_workspace_tiles<Element, kBlockM, kBlockN>(p, bh)(
                                    _, _, m_block, n_block)),
                                tDScDS, seq.seqlen_q - m_block * kBlockM, seq.seqlen_k - n_block * kBlockN);
        }
      } else {
        atomic_add_fragment(tdQgdQacc(_, _, _, m_block), dq_contribution());
      }

      gemm_smem_smem(mma_kv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, at_offset(tdKsQt, stage * T::kElemsQ), copy_a_kv,
                     copy_b_kv, thr_copy_a_kv, thr_copy_b_kv);

      __syncthreads();  // every warp is done with this stage's Q, dO and with P, dS
      if (m_block + T::kStages < m_blocks) {
        load_query_tile(m_block + T::kStages, stage);
      }
      cp_async_fence();  // possibly empty: one group per step keeps the wait above uniform
    }
  }

  // ---- epilogue: the dSink share (a fixed-order CTA sum), dK (scaled) and dV -----------------------
  if (p.dsink_parts != 0) {
    __syncthreads();
    if (tidx == 0) {
      float total = 0.f;
      for (int w = 0; w < T::kWarps; ++w) {
        total += warp_sink_sums[w];
      }
      reinterpret_cast<float*>(p.dsink_parts)[bh * gridDim.x + blockIdx.x] = total;
    }
  }

  Tensor cK = thr_kv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kDimQK>>{}));
  Tensor cV = thr_kv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kDimV>>{}));
  if (p.heads_q == p.heads_kv) {
    auto dk_base = reinterpret_cast<Element*>(p.dk) + seq.k_offset(p.dk_batch_stride, p.dk_row_stride) +
                   head * p.dk_head_stride;
    auto dv_base = reinterpret_cast<Element*>(p.dv) + seq.k_offset(p.dv_batch_stride, p.dv_row_stride) +
                   head * p.dv_head_stride;
    store_accumulator(acc_dk, thr_kv.partition_C(gmem_tiles<kBlockN, kDimQK>(dk_base, seq.seqlen_k, p.dk_row_stride,
                                                                             n_block)), cK, p.scale, k_rows);
    store_accumulator(acc_dv, thr_kv.partition_C(gmem_tiles<kBlockN, kDimV>(dv_base, seq.seqlen_k, p.dv_row_stride,
                                                                            n_block)), cV, 1.f, k_rows);
  } else {
    // Per query head in fp32; the host sums each group in a fixed order.
    auto dk_base = reinterpret_cast<float*>(p.dk_accum) + seq.k_row(p, head) * kDimQK;
    auto dv_base = reinterpret_cast<float*>(p.dv_accum) + seq.k_row(p, head) * kDimV;
    store_accumulator(acc_dk, thr_kv.partition_C(gmem_tiles<kBlockN, kDimQK>(dk_base, seq.seqlen_k, kDimQK,
                                                                             n_block)), cK, p.scale, k_rows);
    store_accumulator(acc_dv, thr_kv.partition_C(gmem_tiles<kBlockN, kDimV>(dv_base, seq.seqlen_k, kDimV,
                                                                            n_block)), cV, 1.f, k_rows);
  }
}

}  // namespace flashkiln::portable
