// The Hopper backward's consumers (bwd_kernel.hpp): two warpgroups that keep the key tile's dK
// and dV in registers over the sweep, split by keys or by columns (bwd_traits.hpp), and per query
// tile compute S^T and dP^T from shared memory, P^T and dS^T in registers, dV and dK from them,
// and dQ = dS K, which they stage for their dQ writer (bwd_writers.hpp); after the sweep they
// write dK and dV.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <flashkiln/common/fragment.hpp>
#include <flashkiln/common/global_reduce.hpp>
#include <flashkiln/common/math.hpp>
#include <flashkiln/common/sequence.hpp>
#include <flashkiln/common/softcap.hpp>
#include <flashkiln/common/visibility.hpp>
#include <flashkiln/hopper/bwd_params.hpp>
#include <flashkiln/hopper/bwd_schedule.hpp>
#include <flashkiln/hopper/bwd_traits.hpp>
#include <flashkiln/hopper/mma.hpp>
#include <flashkiln/hopper/pipeline.hpp>
#include <flashkiln/hopper/swizzled_tile.hpp>
#include <flashkiln/hopper/timeline.hpp>
#include <flashkiln/hopper/transposed_tile.hpp>

namespace flashkiln::hopper {

using namespace cute;

// Named barriers (0 is __syncthreads'): every consumer thread, then one per consumer warpgroup.
inline constexpr int kConsumersBarrier = 1;
inline constexpr int kFirstWarpgroupBarrier = 2;

// Entry `entry` of query tile m's RowStats: [0, kBlockM) the LSE (base 2) of one row each, the
// next kBlockM its delta, the next its sink weight (with kSinkGrad), beyond them nothing. Consumer
// thread t loads entries t + j kConsumerThreads, j < kStatSlots, a tile ahead. A sink weight is
// loaded as its row's LSE and finished (finish_row_stat) when stored: its exponential would
// otherwise wait on the load at the tile's start.
template <class T, bool kSinkGrad>
__device__ __forceinline__ float row_stat(HopperBwdParams const& p, Sequence const& s, int entry, int m, int head) {
  const int row = m * T::kBlockM + entry % T::kBlockM;
  const int kind = entry / T::kBlockM;  // 0: LSE, 1: delta, 2: sink weight
  if (kind > (kSinkGrad ? 2 : 1)) {
    return 0.f;
  }
  if (row >= s.seqlen_q) {
    return kind == 1 ? 0.f : kInfinity;  // P = 0 for rows past the sequence (a sink weight's exp2(-inf))
  }
  const int64_t index = s.q_row(p, head) + row;
  if (kind == 1) {
    return reinterpret_cast<float const*>(p.delta)[index];
  }
  const float lse = reinterpret_cast<float const*>(p.lse)[index];
  if (kind == 2) {
    return lse;  // with a sink the LSE includes it, so it is finite
  }
  // A row that sees no key (a bias or mask can hide all of them) has LSE = -inf: P = 0 then.
  return lse == -kInfinity ? kInfinity : lse * kLog2e;
}

// A loaded entry as RowStats holds it: a sink weight exp2(sink - LSE) in base 2 (`sink_log2`: the
// head's sink logit in base 2, read with kSinkGrad only); every other entry as loaded.
template <class T, bool kSinkGrad>
__device__ __forceinline__ float finish_row_stat(float value, int entry, float sink_log2) {
  return kSinkGrad && entry / T::kBlockM == 2 ? exp2f(sink_log2 - value * kLog2e) : value;
}

template <class T>
__device__ __forceinline__ void store_row_stat(typename T::RowStats& stats, int entry, float value) {
  const int row = entry % T::kBlockM;
  switch (entry / T::kBlockM) {
    case 0: stats.lse_log2[row] = value; break;
    case 1: stats.delta[row] = value; break;
    case 2: stats.sink_weight[row] = value; break;
    default: break;
  }
}

// How a bias_grad kernel's consumers give dBias of a key-varying bias: dS stored (a full bias:
// p.ds_workspace), summed over rows (a bias broadcast over rows: p.dbias_columns), or added into a
// plane that several (batch entry, head) pairs share (p.dbias_sum). The runtime sets exactly one
// of the three for such a kernel (hopper_family.plan_backward). kNone without bias_grad; kAny: one
// loop for every route, which reads the call's from those pointers (BwdTraits::kRouteLoops).
enum class DbiasRoute { kNone, kStore, kColumns, kSum, kAny };

// Whether consumers instantiated for kRoute hold `route`'s code, and whether they take it on this call.
template <DbiasRoute kRoute>
__host__ __device__ constexpr bool may_take(DbiasRoute route) {
  return kRoute == route || kRoute == DbiasRoute::kAny;
}

template <DbiasRoute kRoute>
__device__ __forceinline__ bool takes(DbiasRoute route, HopperBwdParams const& p) {
  if constexpr (kRoute == DbiasRoute::kAny) {
    switch (route) {
      case DbiasRoute::kStore: return p.ds_workspace != 0;
      case DbiasRoute::kColumns: return p.dbias_columns != 0;
      default: return p.dbias_sum != 0;
    }
  }
  return kRoute == route;
}

// kSinkGrad: the call wants dSink's sums (p.dsink_parts); kRoute: its dBias route. Template
// parameters, chosen once per CTA (bwd_kernel), not branches in the loop: each combination's
// registers are allocated for its own work (docs/perf.md, v19 and v59), where that is faster.
template <class T, bool kSinkGrad, DbiasRoute kRoute>
__device__ __forceinline__ void consume(HopperBwdParams const& p, typename T::SharedStorage& ss, Sequence const& s,
                                        int thread, int n_block, int head) {
  using Element = typename T::Element;
  // The warpgroup through a shuffle, which the compiler knows to be one value per warp: the wgmma
  // descriptors that depend on it can then live in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffff, thread / 128, 0);
  const int mma_thread = warpgroup * 128 + thread % 128;  // == thread
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmaDk mma_dk;
  typename T::TiledMmaDv mma_dv;
  typename T::TiledMmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(mma_thread);
  auto thr_dk = mma_dk.get_thread_slice(mma_thread);
  auto thr_dv = mma_dv.get_thread_slice(mma_thread);
  auto thr_dq = mma_dq.get_thread_slice(T::kDqAlternate ? thread % 128 : mma_thread);

  // Shared-memory operands as (MMA, M or N, K[, stage]).
  Tensor tSrK = thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(ss.k), typename T::SmemLayoutK{}));
  Tensor tSrQ = thr_sdp.partition_fragment_B(make_tensor(make_smem_ptr(ss.q), typename T::SmemLayoutQ{}));
  Tensor tdPrV = thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(ss.v), typename T::SmemLayoutV{}));
  Tensor tdPrdO = thr_sdp.partition_fragment_B(make_tensor(make_smem_ptr(ss.dout), typename T::SmemLayoutDo{}));
  Tensor tdVrdO = thr_dv.partition_fragment_B(make_tensor(make_smem_ptr(ss.dout), typename T::SmemLayoutDot{}));
  Tensor tdKrQ = thr_dk.partition_fragment_B(make_tensor(make_smem_ptr(ss.q), typename T::SmemLayoutQt{}));

  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, Int<T::kBlockM>>{}));  // (key, row)
  Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<T::kBlockN>, Int<T::kBlockM>>{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<T::kBlockN>, Int<T::kBlockM>>{});
  Tensor acc_dk = partition_fragment_C(mma_dk, Shape<Int<T::kBlockN>, Int<T::kDimQK>>{});
  Tensor acc_dv = partition_fragment_C(mma_dv, Shape<Int<T::kBlockN>, Int<T::kDimV>>{});
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<T::kBlockM>, Int<T::kDimQK>>{});
  // P^T and dS^T in the element type, as the A operands of dV and dK (through shared memory where
  // the warpgroups split columns: the P^T buffer follows the two dS buffers).
  Tensor p_regs = make_fragment_like<Element>(acc_s);
  Tensor ds_regs = make_fragment_like<Element>(acc_dp);
  Tensor tdVrP = make_tensor(p_regs.data(), acc_as_operand_a(p_regs.layout()));
  Tensor tdKrdS = make_tensor(ds_regs.data(), acc_as_operand_a(ds_regs.layout()));

  const auto vis = visibility_of<T>(p, s);
  const QuerySweep sweep = query_sweep<T>(p, s, n_block);
  const int key0 = n_block * T::kBlockN;
  [[maybe_unused]] const float inv_scale = 1.f / p.scale;  // the bias joins the unscaled scores
  // A packed batch's tiles at a sequence's end hold other tokens (the next sequence's, or any value
  // past the last one) where a dense batch's TMA loads zero-fill. Their P and dS are zero, but
  // wgmma would still multiply their values by those zeros (NaN stays NaN), so each warpgroup
  // zeroes those rows of K and V, and of the last query tile's Q and dO, before its GEMMs read
  // them. Both write the same zeros, so neither can see a value the other has not also written.
  // `qk`: K's or Q's rows, of d_qk columns; `v`: V's or dO's, of d_v.
  const int wg_barrier = kFirstWarpgroupBarrier + warpgroup;
  auto zero_past_end = [&](Element* qk, Element* v, int first, auto rows) {
    zero_rows<decltype(rows)::value, T::kDimQK, T::kQKBoxCols>(qk, first, thread % 128);
    zero_rows<decltype(rows)::value, T::kDimV, T::kVBoxCols>(v, first, thread % 128);
    cutlass::arch::fence_view_async_shared();  // generic writes that wgmma reads next
    named_barrier_sync(wg_barrier, 128);
  };
  float* const dq_stage = ss.dq + warpgroup * T::DqLayout::kPartFloats;

  constexpr int kStatSlots = T::template kStatSlots<kSinkGrad>;
  auto load_stats = [&](float (&values)[kStatSlots], int m) {
    CUTE_UNROLL
    for (int j = 0; j < kStatSlots; ++j) {
      values[j] = row_stat<T, kSinkGrad>(p, s, thread + j * T::kConsumerThreads, m, head);
    }
  };
  const float sink_log2 = kSinkGrad ? reinterpret_cast<float const*>(p.sink)[head] * kLog2e : 0.f;
  auto store_stats = [&](typename T::RowStats& stats, float const (&values)[kStatSlots]) {
    CUTE_UNROLL
    for (int j = 0; j < kStatSlots; ++j) {
      const int entry = thread + j * T::kConsumerThreads;
      store_row_stat<T>(stats, entry, finish_row_stat<T, kSinkGrad>(values[j], entry, sink_log2));
    }
  };

  clear(acc_dk);
  clear(acc_dv);
  float sink_share = 0.f;  // dSink: this thread's share of the CTA's sum of p_sink * P * dP
  if (sweep.count > 0) {
    float first_stats[kStatSlots];
    load_stats(first_stats, sweep.tile(0));
    store_stats(ss.stats[0], first_stats);
  }
  named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
  Barrier::wait(&ss.kv_full, 0);
  if (thread == 0) {
    timeline_clock(kKvClock);
    timeline_record(kSweepTiles, sweep.count);
  }
  if (s.packed && key0 + T::kBlockN > s.seqlen_k) {
    zero_past_end(ss.k, ss.v, s.seqlen_k - key0, Int<T::kBlockN>{});
  }

  // dQ of a query tile, in acc_dq: staged in this warpgroup's buffer once the writer's last bulk add
  // has read it, then handed to the writer (write_dq).
  uint32_t dq_phase = 0;
  auto stage_dq = [&]() {
    const TimelineSpan dq_wait = timeline_span();
    Barrier::wait(&ss.dq_empty[warpgroup], dq_phase ^ 1);
    if (thread == 0) {
      timeline_add_span(kDqWaitClocks, dq_wait);
    }
    CUTE_UNROLL
    for (int v = 0; v < size(acc_dq); v += 2) {
      reinterpret_cast<float2*>(dq_stage)[(v / 2) * 128 + thread % 128] = make_float2(acc_dq(v), acc_dq(v + 1));
    }
    cutlass::arch::fence_view_async_shared();  // generic writes, read by the bulk copy
    Barrier::arrive(&ss.dq_full[warpgroup]);
    dq_phase ^= 1;
  };

  // With one key tile for the whole sequence every row's keys are in this CTA (unless out and lse
  // come from more keys than the call has: p.keys_complete): delta is then
  // rowsum(P * dP) - dLSE from the unrounded P and dP, not the preprocess's rowsum(dO * O) from the
  // rounded O, whose rounding is all of dS where P sits on a few keys (as the portable family
  // does, docs/design.md). A fixed-order sum: the lanes of a warp that share rows, then the warps
  // through the tile's dS buffer (free until its dS is stored), into the tile's stats and into
  // delta, which dBias's closed form reads.
  const bool whole_rows = ceil_div(s.seqlen_k, T::kBlockN) == 1 && p.keys_complete;
  // The rows of S^T that a warpgroup computes, and the warps that hold a row's keys.
  constexpr int kWarpgroupRows = T::kBlockM / T::kSdPWarpgroupsN;
  constexpr int kWarpsPerRow = T::kConsumerThreads / 32 / T::kSdPWarpgroupsN;
  auto exact_deltas = [&](int row0, int buffer) {
    // A thread's rows in an m64 accumulator: r0 + dr, dr = 8 j + e; a row at a time, so that one
    // partial sum is live beside the accumulators.
    const int r0 = get<1>(cS(0));
    float* sums;  // (warp, row)
    if constexpr (T::kDsInBiasTile) {
      sums = ss.ds.sums;
    } else {
      sums = reinterpret_cast<float*>(ss.ds.tiles + buffer * T::kElemsdS);
    }
    CUTE_UNROLL
    for (int dr = 0; dr < kWarpgroupRows; dr += dr % 2 == 0 ? 1 : 7) {
      float part = 0.f;
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) {
        if (get<1>(cS(i)) - r0 == dr) {  // compile-time once unrolled
          part = fmaf(acc_s(i), acc_dp(i), part);
        }
      }
      CUTE_UNROLL
      for (int lanes = 4; lanes < 32; lanes *= 2) {  // the lanes of a row's keys
        part += __shfl_xor_sync(0xffffffff, part, lanes);
      }
      if (thread % 32 < 4) {
        sums[thread / 32 * T::kBlockM + r0 + dr] = part;
      }
    }
    named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
    if (thread < T::kBlockM) {
      float total = 0.f;
      // The warps of warpgroup n of S^T's rows (every warp where the warpgroups split keys).
      const int first_warp = T::kSdPWarpgroupsN == 1 ? 0 : thread / kWarpgroupRows * kWarpsPerRow;
      CUTE_UNROLL
      for (int w = first_warp; w < first_warp + kWarpsPerRow; ++w) {
        total += sums[w * T::kBlockM + thread];
      }
      const bool inside = row0 + thread < s.seqlen_q;
      const int64_t index = s.q_row(p, head) + row0 + thread;
      const float delta = total - (inside && p.dlse != 0 ? reinterpret_cast<float const*>(p.dlse)[index] : 0.f);
      ss.stats[buffer].delta[thread] = delta;
      if (inside) {
        reinterpret_cast<float*>(p.delta)[index] = delta;
      }
    }
    named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);  // the sums are read before dS is stored
  };

  // dBias of a key-varying bias (HopperBwdParams::ds_workspace, dbias_columns, dbias_sum): planes of
  // seqlen_q rows by ds_ld keys. Their offsets are recomputed where they are used, from values the
  // loop keeps anyway: the consumers have no registers to spare across it.
  [[maybe_unused]] auto ds_ld = [&] { return ceil_div(p.seqlen_k, 8) * 8; };
  [[maybe_unused]] auto ds_plane = [&] { return (int64_t(s.batch) * p.heads_q + head) * p.seqlen_q * ds_ld(); };

  PipelineState<T::kStages> st;
  for (int i = 0, buffer = 0; i < sweep.count; ++i, buffer ^= 1) {
    const int m = sweep.tile(i);
    const bool has_next = i + 1 < sweep.count;
    // This thread's share of the next tile's stats, stored once this tile's are read (before the barrier).
    float next_stats[kStatSlots];
    if (has_next) {
      load_stats(next_stats, sweep.tile(i + 1));
    }
    typename T::RowStats const& stats = ss.stats[buffer];
    const int row0 = m * T::kBlockM;

    const TimelineSpan stage_wait = timeline_span();
    Barrier::wait(&ss.q_full[st.stage], st.phase);
    if (thread == 0) {
      timeline_add_span(kStageWaitClocks, stage_wait);
      if (i == 0) {
        timeline_clock(kFirstStageClock);
      }
    }
    if (s.packed && row0 + T::kBlockM > s.seqlen_q) {
      zero_past_end(ss.q + st.stage * T::kElemsQ, ss.dout + st.stage * T::kElemsDo, s.seqlen_q - row0,
                    Int<T::kBlockM>{});
    }
    // S^T, dP^T and dQ are overwritten per tile: discarded first, they hold no registers from their
    // last read to their next GEMM, registers the other accumulators need (docs/perf.md, v29).
    discard_operand(acc_s);
    discard_operand(acc_dp);
    wgmma_gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, st.stage), acc_s);
    wgmma_gemm<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, st.stage), acc_dp);
    // The LSEs of this thread's first kEarlyRows rows (row_first + 8 j + e, e < 2), read while S^T
    // is computed, so that the first exponentials after its wait do not wait on them; the other
    // rows' reads overlap those exponentials (each early row holds a register across the GEMM).
    constexpr int kEarlyRows = 4;
    const int row_first = get<1>(cS(0));
    auto slot_of = [&](int row) { return (row - row_first) / 8 * 2 + (row - row_first) % 2; };
    float early_lse[kEarlyRows];
    CUTE_UNROLL
    for (int j = 0; j < kEarlyRows; ++j) {
      early_lse[j] = stats.lse_log2[row_first + j / 2 * 8 + j % 2];
    }
    warpgroup_wait<1>();  // S^T
    // A softcap's slope per score, for dS (common/softcap.hpp); unused, it holds no registers.
    auto slopes = make_fragment_like<cutlass::half_t>(acc_s);
    if constexpr (T::kSoftcap) {
      cap_scores(acc_s, p.softcap_scale);
      softcap_slopes(acc_s, slopes);
    }
    if constexpr (T::kBias) {
      const uint32_t tile = cute::cast_smem_ptr_to_uint(ss.bias.tiles + st.stage * T::kElemsBias);
      if (p.bias_row_step) {
        bias_transposed_into<T::kBlockM, kWarpgroupRows, false, Element>(acc_s, cS, tile, inv_scale);
      } else {
        bias_transposed_into<T::kBlockM, kWarpgroupRows, true, Element>(acc_s, cS, tile, inv_scale);
      }
    }

    // P^T, with the first rows' LSEs from registers.
    auto lse_log2 = [&](int row) {
      const int slot = slot_of(row);
      return slot < kEarlyRows ? early_lse[slot] : stats.lse_log2[row];
    };
    if (row0 + T::kBlockM > s.seqlen_q || needs_mask<T::kBlockM, T::kBlockN>(vis, row0, key0)) {
      exponentiate_transposed<true>(acc_s, cS, vis, row0, key0, s.seqlen_q, p.scale_log2, lse_log2);
    } else {
      exponentiate_transposed<false>(acc_s, cS, vis, row0, key0, s.seqlen_q, p.scale_log2, lse_log2);
    }
    p_regs = convert_fragment<Element>(acc_s);
    if constexpr (T::kSplitColumns) {
      // dV needs both warpgroups' rows of P^T (in the buffer after the two dS buffers): stored,
      // then dV runs under dS's arithmetic.
      Element* const p_tile = ss.ds.tiles + 2 * T::kElemsdS;
      store_fragment<T::kBlockN>(p_regs, cS, cute::cast_smem_ptr_to_uint(p_tile));
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
      Tensor tdVsP = thr_dv.partition_fragment_A(make_tensor(make_smem_ptr(p_tile), typename T::SmemLayoutPt{}));
      wgmma_gemm<false>(mma_dv, tdVsP, tdVrdO(_, _, _, st.stage), acc_dv);
    } else {
      wgmma_gemm<false>(mma_dv, tdVrP, tdVrdO(_, _, _, st.stage), acc_dv);
    }
    warpgroup_wait<1>();  // dP^T (dV's GEMM runs on)

    if constexpr (kSinkGrad) {
      // dSink's exact share: rowsum(P * dP) from unrounded P and dP (delta uses the rounded O).
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dp); ++i) {
        sink_share = fmaf(acc_s(i) * stats.sink_weight[get<1>(cS(i))], acc_dp(i), sink_share);
      }
    }
    if (whole_rows) {
      exact_deltas(row0, buffer);
    }
    // dS^T = P^T (dP^T - delta), times a softcap's slope (common/softcap.hpp).
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dp); ++i) {
      const int row = get<1>(cS(i));
      acc_dp(i) = acc_s(i) * (acc_dp(i) - stats.delta[row]);
      if constexpr (T::kSoftcap) {
        acc_dp(i) *= float(slopes(i)) * p.softcap_scale;
      }
    }
    if constexpr (may_take<kRoute>(DbiasRoute::kColumns)) {
      if (takes<kRoute>(DbiasRoute::kColumns, p)) {
        // The tile's sums over its rows of this thread's two keys, then over the lanes that hold
        // the same keys (lane / 4), added by one of them: the adds of an address come from one
        // thread in tile order, so the sums are deterministic. Where the warpgroups split the
        // rows, both hold every key: the second's sums join the first's through the tile's dS
        // buffer (free until its dS is stored), and the first adds them.
        float sums[2] = {0.f, 0.f};
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dp); ++i) {
          sums[(get<0>(cS(i)) - get<0>(cS(0))) / 8] += acc_dp(i);  // compile-time index once unrolled
        }
        CUTE_UNROLL
        for (int g = 0; g < 2; ++g) {
          sums[g] += __shfl_xor_sync(0xffffffff, sums[g], 1);
          sums[g] += __shfl_xor_sync(0xffffffff, sums[g], 2);
        }
        const bool adder = thread % 4 == 0 && (!T::kSplitColumns || warpgroup == 0);
        if constexpr (T::kSplitColumns) {
          float* const key_sums = reinterpret_cast<float*>(ss.ds.tiles + buffer * T::kElemsdS);  // per key of the tile
          if (warpgroup == 1 && thread % 4 == 0) {
            key_sums[get<0>(cS(0))] = sums[0];
            key_sums[get<0>(cS(0)) + 8] = sums[1];
          }
          named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
          if (adder) {
            sums[0] += key_sums[get<0>(cS(0))];
            sums[1] += key_sums[get<0>(cS(0)) + 8];
          }
          named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);  // read before dS is stored there
        }
        CUTE_UNROLL
        for (int g = 0; g < 2; ++g) {
          const int key = key0 + get<0>(cS(0)) + 8 * g;  // this thread's keys: its first and 8 on
          if (adder && key < s.seqlen_k) {
            const int64_t row = (int64_t(s.batch) * p.heads_q + head) * p.seqlen_k;
            atomicAdd(reinterpret_cast<float*>(p.dbias_columns) + row + key, sums[g]);
          }
        }
      }
    }
    ds_regs = convert_fragment<Element>(acc_dp);
    if constexpr (may_take<kRoute>(DbiasRoute::kSum)) {
      if (takes<kRoute>(DbiasRoute::kSum, p)) {
        const int ld = ds_ld();
        float* const plane = reinterpret_cast<float*>(p.dbias_sum) +
                             int64_t(dbias_share(p, s.batch, head).slice) * p.seqlen_q * ld;
        cutlass::NumericArrayConverter<float, Element, 2> convert;
        const bool turns = p.dbias_semaphore != 0;  // deterministic: a turn per tile (pass_dbias_turns)
        if (turns) {
          Barrier::wait(&ss.dbias_turn, i % 2);
        }
        // One 16-byte reduction per four keys (ld is a multiple of 8, so all four lie inside).
        for_quads_of_transposed(ds_regs, cS, [&](int row, int key, uint32_t low, uint32_t high) {
          row += row0;
          key += key0;
          if (row < s.seqlen_q && key < ld) {
            const auto a = convert(reinterpret_cast<cutlass::Array<Element, 2> const&>(low));
            const auto b = convert(reinterpret_cast<cutlass::Array<Element, 2> const&>(high));
            reduce_add_quad(plane + int64_t(row) * ld + key, a[0], a[1], b[0], b[1]);
          }
        });
        if (turns) {
          Barrier::arrive(&ss.dbias_done);
        }
      }
    }
    // dS into the stage's bias tile (dQ's operand with kDsInBiasTile; a full bias's dBias, which
    // the producer stores from there, store_ds_tile): a warp writes the entries it read of it
    // (bias_transposed_into), so no other warp's reads are pending there, but other lanes' are
    // (ldmatrix reads for the whole warp): __syncwarp orders them first. Else into a dS buffer.
    auto store_in_bias_tile = [&](Element* tile) {
      __syncwarp();
      store_rows_of_transposed<T::kBlockM, kWarpgroupRows>(ds_regs, cS, cute::cast_smem_ptr_to_uint(tile));
    };
    Element* ds;
    if constexpr (T::kDsInBiasTile) {
      ds = ss.bias.tiles + st.stage * T::kElemsBias;
      store_in_bias_tile(ds);
    } else {
      if constexpr (may_take<kRoute>(DbiasRoute::kStore)) {
        if (takes<kRoute>(DbiasRoute::kStore, p)) {
          store_in_bias_tile(ss.bias.tiles + st.stage * T::kElemsBias);
        }
      }
      ds = ss.ds.tiles + buffer * T::kElemsdS;
      store_fragment<T::kBlockN>(ds_regs, cS, cute::cast_smem_ptr_to_uint(ds));
    }
    if (has_next) {
      store_stats(ss.stats[buffer ^ 1], next_stats);
    }
    cutlass::arch::fence_view_async_shared();  // dS, written by threads, is read by wgmma next
    // Both warpgroups' dS are in (dQ reads both), and every read of this tile's stats is done.
    named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
    if constexpr (T::kSplitColumns) {
      // Both warpgroups' rows of dS^T, against this warpgroup's columns of Q.
      Tensor tdKsdS = thr_dk.partition_fragment_A(make_tensor(make_smem_ptr(ds), typename T::SmemLayoutPt{}));
      wgmma_gemm<false>(mma_dk, tdKsdS, tdKrQ(_, _, _, st.stage), acc_dk);
    }

    // This warpgroup's dQ of the tile (taking turns: every other tile's). Each branch waits for
    // its own GEMMs: accumulators of a GEMM in flight must not meet at a join.
    const bool own_dq = !T::kDqAlternate || i % 2 == warpgroup;
    if (own_dq) {
      Tensor tdQrdS = thr_dq.partition_fragment_A(make_tensor(make_smem_ptr(ds), typename T::SmemLayoutdS{}));
      // Kᵀ's descriptors are made per tile from an opaque copy of K's address: hoisted out of the
      // loop, one per k-block, they held two registers each across it (docs/perf.md, v29).
      Element* k_smem = ss.k;
      asm volatile("" : "+l"(k_smem));
      Tensor tdQrK = thr_dq.partition_fragment_B(make_tensor(make_smem_ptr(k_smem), typename T::SmemLayoutKt{}));
      discard_operand(acc_dq);
      wgmma_gemm<true>(mma_dq, tdQrdS, tdQrK, acc_dq);
      if constexpr (T::kSplitColumns) {
        // dV and dK have read Q and dO: the next tile's load starts under dQ's GEMM.
        warpgroup_wait<1>();
        Barrier::arrive(&ss.q_empty[st.stage]);
        warpgroup_wait<0>();
        stage_dq();
      } else {
        // dK after dQ, so that dQ is staged while dK's GEMM runs.
        wgmma_gemm<false>(mma_dk, tdKrdS, tdKrQ(_, _, _, st.stage), acc_dk);
        warpgroup_wait<1>();
        stage_dq();
        warpgroup_wait<0>();
      }
    } else {
      if constexpr (!T::kSplitColumns) {
        wgmma_gemm<false>(mma_dk, tdKrdS, tdKrQ(_, _, _, st.stage), acc_dk);
      }
      warpgroup_wait<0>();
    }
    if constexpr (!T::kSplitColumns) {
      Barrier::arrive(&ss.q_empty[st.stage]);  // Q and dO of this stage are read
    }
    st.advance();
  }
  if (thread == 0) {
    timeline_clock(kSweepEndClock);
  }

  if constexpr (may_take<kRoute>(DbiasRoute::kStore)) {
    if (takes<kRoute>(DbiasRoute::kStore, p)) {
      // The rows of the query tiles that do not see this key tile: dS = 0, in 16-byte pieces.
      Element* const plane = reinterpret_cast<Element*>(p.ds_workspace) + ds_plane();
      const int ld = ds_ld();
      constexpr int kPieces = T::kBlockN / 8;
      const int skipped_before = min(sweep.first * T::kBlockM, s.seqlen_q);
      const int visited_end = max(skipped_before, min((sweep.first + sweep.count) * T::kBlockM, s.seqlen_q));
      const int skipped = skipped_before + s.seqlen_q - visited_end;
      for (int i = thread; i < skipped * kPieces; i += T::kConsumerThreads) {
        const int n = i / kPieces;
        const int row = n < skipped_before ? n : visited_end + n - skipped_before;
        const int key = key0 + i % kPieces * 8;
        if (key < ld) {
          *reinterpret_cast<uint4*>(plane + int64_t(row) * ld + key) = make_uint4(0, 0, 0, 0);
        }
      }
    }
  }

  if constexpr (kSinkGrad) {
    // The CTA's dSink sum, in a fixed order (deterministic): warps, then their sums by thread 0.
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) {
      sink_share += __shfl_xor_sync(0xffffffff, sink_share, offset);
    }
    if (thread % 32 == 0) {
      ss.sink_sums[thread / 32] = sink_share;
    }
    named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
    if (thread == 0) {
      float total = 0.f;
      for (int w = 0; w < T::kConsumerThreads / 32; ++w) {
        total += ss.sink_sums[w];
      }
      reinterpret_cast<float*>(p.dsink_parts)[(int64_t(s.batch) * p.heads_q + head) * gridDim.x + n_block] = total;
    }
  }

  // dK (scaled) and dV of the key tile: in the element type by the output strides, or (GQA) in
  // fp32, added into sums per KV head (p.dkv_sums), or stored per query head, which the runtime
  // sums over each group in a fixed order (a deterministic call).
  Tensor cK = thr_dk.partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, Int<T::kDimQK>>{}));
  Tensor cV = thr_dv.partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, Int<T::kDimV>>{}));
  if (p.dk_accum != 0) {
    const bool sums = p.dkv_sums != 0;
    const int accum_heads = sums ? p.heads_kv : p.heads_q;
    const int accum_head = sums ? head / (p.heads_q / p.heads_kv) : head;
    const int64_t first_row = (s.layout_batch() * accum_heads + accum_head) * p.total_k + s.k_begin;
    float* const dk_rows = reinterpret_cast<float*>(p.dk_accum) + first_row * T::kDimQK;
    float* const dv_rows = reinterpret_cast<float*>(p.dv_accum) + first_row * T::kDimV;
    const auto write_pair = [sums](float* dst, float a, float b) {
      if (sums) {
        reduce_add_pair(dst, a, b);
      } else {
        *reinterpret_cast<float2*>(dst) = make_float2(a, b);
      }
    };
    // Entry i of either fragment holds the same key (m64 accumulators over the warpgroup's keys);
    // where d_qk and d_v differ, one fragment has fewer entries.
    constexpr int kEntriesK = decltype(size(acc_dk))::value;
    constexpr int kEntriesV = decltype(size(acc_dv))::value;
    CUTE_UNROLL
    for (int i = 0; i < (kEntriesK > kEntriesV ? kEntriesK : kEntriesV); i += 2) {
      const bool has_dk = i < kEntriesK, has_dv = i < kEntriesV;  // compile-time once unrolled
      const int key = key0 + (has_dk ? get<0>(cK(i)) : get<0>(cV(i)));
      if (key < s.seqlen_k) {
        if (has_dk) {
          write_pair(dk_rows + int64_t(key) * T::kDimQK + get<1>(cK(i)), acc_dk(i) * p.scale,
                     acc_dk(i + 1) * p.scale);
        }
        if (has_dv) {
          write_pair(dv_rows + int64_t(key) * T::kDimV + get<1>(cV(i)), acc_dv(i), acc_dv(i + 1));
        }
      }
    }
    return;
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) {
    acc_dk(i) *= p.scale;
  }
  // Through the K and V tiles' buffers (every consumer's GEMMs have read them once all have left
  // the loop), so that a warp writes whole rows in 16-byte pieces: from the fragments directly,
  // a warp's store covers 8 rows in 16-byte halves of 32-byte sectors.
  const uint32_t k_tile = cute::cast_smem_ptr_to_uint(ss.k), v_tile = cute::cast_smem_ptr_to_uint(ss.v);
  named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
  store_fragment<T::kBlockN, T::kQKBoxCols>(convert_fragment<Element>(acc_dk), cK, k_tile);
  store_fragment<T::kBlockN, T::kVBoxCols>(convert_fragment<Element>(acc_dv), cV, v_tile);
  named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const int rows = min(s.seqlen_k - key0, T::kBlockN);
  // (dK and dV come in a kernel layout: 16-byte aligned rows, inputs.is_kernel_layout.)
  copy_rows_out<T::kBlockN, T::kDimQK, T::kQKBoxCols, T::kConsumerThreads>(
      k_tile, T::kBlockN * T::kQKBoxCols * 2,
      reinterpret_cast<Element*>(p.dk) + s.k_offset(p.dk_batch_stride, p.dk_row_stride) + head_kv * p.dk_head_stride +
          int64_t(key0) * p.dk_row_stride,
      p.dk_row_stride, rows, thread);
  copy_rows_out<T::kBlockN, T::kDimV, T::kVBoxCols, T::kConsumerThreads>(
      v_tile, T::kBlockN * T::kVBoxCols * 2,
      reinterpret_cast<Element*>(p.dv) + s.k_offset(p.dv_batch_stride, p.dv_row_stride) + head_kv * p.dv_head_stride +
          int64_t(key0) * p.dv_row_stride,
      p.dv_row_stride, rows, thread);
}

// consume with the call's dBias route.
template <class T, bool kSinkGrad>
__device__ __forceinline__ void consume_routed(HopperBwdParams const& p, typename T::SharedStorage& ss,
                                               Sequence const& s, int thread, int n_block, int head) {
  if constexpr (!T::kBiasGrad) {
    consume<T, kSinkGrad, DbiasRoute::kNone>(p, ss, s, thread, n_block, head);
  } else if constexpr (!T::kRouteLoops) {
    consume<T, kSinkGrad, DbiasRoute::kAny>(p, ss, s, thread, n_block, head);
  } else if (p.ds_workspace != 0) {
    consume<T, kSinkGrad, DbiasRoute::kStore>(p, ss, s, thread, n_block, head);
  } else if (p.dbias_columns != 0) {
    consume<T, kSinkGrad, DbiasRoute::kColumns>(p, ss, s, thread, n_block, head);
  } else {
    consume<T, kSinkGrad, DbiasRoute::kSum>(p, ss, s, thread, n_block, head);
  }
}

}  // namespace flashkiln::hopper
