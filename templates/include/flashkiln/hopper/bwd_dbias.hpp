// Hopper dBias of a bias shared by several (batch entry, head) pairs (sm_90a), the kernel
// bwd_dbias: a bias broadcast over heads or batch entries (not rows nor keys) has as its dBias tile
// (m, n) the sum of every sharing pair's dS tile. One CTA sums such a tile of one bias slice over
// the pairs (its members): per member it recomputes S^T = K Q^T and dP^T = V dO^T
// (two of the backward's five GEMMs), forms dS^T = P^T (dP^T - delta) and sums it in registers,
// then stores the tile once in the bias's type. No member adds into memory another one reads,
// so the sum is deterministic and needs no fp32 plane, where the main kernel's in-place sums
// (dbias_sum) cost one fp32 reduction per member and element (docs/perf.md, v47). The main kernel
// runs alongside without dBias; this kernel reads its delta (exact where a row's keys are one tile).
//
// A CTA walks every gridDim.x-th dBias tile (DbiasSchedule). Where tiles have few members the grid
// is persistent (at most one CTA per SM, runtime/hopper_family.py's dbias_ctas), so that one
// tile's loads, its first row stats and the previous tile's store run while another is summed;
// with few members a tile alone is mostly latency (docs/perf.md, v48-v49). Roles: warpgroup 0's
// thread 0 loads each tile's bias tile into one of two buffers, then K, V, Q and dO of each member
// through a ring of kStages buffers that runs on across tiles; two consumer warpgroups own 64 keys
// each (the main kernel's split by keys, bwd_traits.hpp) and store the tile through its bias
// buffer. Dense batches only (a packed batch's tiles at a sequence end hold other sequences'
// tokens, which the main kernel zeroes in shared memory).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <flashkiln/common/fragment.hpp>
#include <flashkiln/common/math.hpp>
#include <flashkiln/common/visibility.hpp>
#include <flashkiln/hopper/bwd_dq_tiles.hpp>
#include <flashkiln/hopper/bwd_params.hpp>
#include <flashkiln/hopper/head_boxes.hpp>
#include <flashkiln/hopper/mma.hpp>
#include <flashkiln/hopper/pipeline.hpp>
#include <flashkiln/hopper/shared_storage.hpp>
#include <flashkiln/hopper/swizzled_tile.hpp>
#include <flashkiln/hopper/transposed_tile.hpp>

namespace flashkiln::hopper {

using namespace cute;

inline constexpr int kMembersBarrier = 1;  // named barrier of every consumer thread (0 is __syncthreads')

template <class Element_, int kDim_, int kBlockM_, int kBlockN_, int kStages_, Causal kCausal_, bool kWindow_>
struct DbiasTraits {
  using Element = Element_;
  static constexpr int kDim = kDim_;  // d_qk = d_v
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr Causal kCausal = kCausal_;
  static constexpr bool kWindow = kWindow_;

  static constexpr int kConsumerWarpgroups = kBwdConsumerWarpgroups;
  static_assert(kBlockN == 64 * kConsumerWarpgroups, "64 keys per consumer warpgroup");
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kBlockM <= kConsumerThreads / 2, "a consumer thread per row's LSE and per row's delta");
  static_assert(kStages >= 2, "a double-buffered member pipeline");
  static constexpr int kBoxCols = 64;  // the bias's and dBias's TMA boxes: one 128-byte swizzle atom
  static constexpr int kHeadBoxCols = head_box_cols(kDim, 1);
  static constexpr int kHeadBoxes = kDim / kHeadBoxCols;

  using SmemAtom = BoxSmemAtom<Element, kHeadBoxCols>;
  // Per stage: Q and dO (rows, d), K and V (keys, d).
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kDim>, Int<kStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kDim>, Int<kStages>>{}));
  // S^T and dP^T, each consumer warpgroup its 64 keys of every row.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<64>, Int<kBlockM>, Int<kDim>>>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));

  static constexpr int kElemsQ = kBlockM * kDim;
  static constexpr int kElemsK = kBlockN * kDim;
  static constexpr int kElemsBias = kBlockM * kBlockN;
  static constexpr uint32_t kBytesMember = 2 * (kElemsQ + kElemsK) * sizeof(Element);  // Q, dO, K, V

  struct RowStats {
    float lse_log2[kBlockM];
    float delta[kBlockM];
  };
  struct SharedStorage {
    alignas(1024) Element q[kStages * kElemsQ];
    alignas(1024) Element dout[kStages * kElemsQ];
    alignas(1024) Element k[kStages * kElemsK];
    alignas(1024) Element v[kStages * kElemsK];
    // Two tiles' bias tiles (rows, keys) in 64-key boxes, as TMA writes them; a tile's dBias once
    // its members are summed, until its store has read it (bias_empty).
    alignas(1024) Element bias[2][kElemsBias];
    RowStats stats[2];
    uint64_t bias_full[2];
    uint64_t bias_empty[2];
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };
  static constexpr int kAlignSlack = 1024 - 16;  // the dynamic allocation starts 16-byte aligned
  static constexpr int kMaxSmemBytes = 232448;   // sm_90a's opt-in limit per block
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + kAlignSlack;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory of the tiles");
};

// The members of bias slice `slice` (blockIdx.z): the pairs that read it, heads inner.
struct DbiasMembers {
  int count;
  int first_head, head_step;    // member j's head: first_head + (j % heads_per) * head_step
  int first_entry, entry_step;  // its batch entry: first_entry + (j / heads_per) * entry_step
  int heads_per;
  int bias_head, bias_entry;  // the slice's coordinates in the bias

  __device__ __forceinline__ int head(int j) const { return first_head + (j % heads_per) * head_step; }
  __device__ __forceinline__ int entry(int j) const { return first_entry + (j / heads_per) * entry_step; }
};

__device__ __forceinline__ DbiasMembers dbias_members(HopperBwdParams const& p, int slice) {
  const bool over_heads = p.bias_head_step == 0, over_entries = p.bias_batch_step == 0;
  const int heads_per = over_heads ? p.heads_q : 1;
  const int count = heads_per * (over_entries ? p.batch : 1);
  // A slice along the dim the bias does not broadcast: a head (over entries) or an entry (over heads).
  const int head = over_heads ? 0 : slice;
  const int entry = over_entries ? 0 : slice;
  return {count, head, over_heads ? 1 : 0, entry, over_entries ? 1 : 0, heads_per, head, entry};
}

// A CTA's dBias tiles: key tile fastest, then query tile, then bias slice (the CTAs in flight share
// their members' Q and dO rows in L2), every gridDim.x-th one from the block index on. `seen`: how
// many members the CTA sums, computed once per tile and carried: all of them, since every member
// sees the same tiles (a dense batch), or none where no row sees the tile (its dBias is 0) and in
// the empty tile that DbiasSchedule::tile gives past the last one.
struct DbiasTile {
  int n_block, m_block;
  DbiasMembers members;
  int seen;
};

template <class T>
struct DbiasSchedule {
  Visibility<T::kCausal, T::kWindow> vis;  // the call's, built once per CTA
  int tiles_n, tiles_m, total;

  __device__ __forceinline__ explicit DbiasSchedule(HopperBwdParams const& p)
      : vis(visibility<T::kCausal, T::kWindow>(p.seqlen_q, p.seqlen_k, reach_of(p))),
        tiles_n(ceil_div(p.seqlen_k, T::kBlockN)),
        tiles_m(ceil_div(p.seqlen_q, T::kBlockM)) {
    const int slices = (p.bias_head_step == 0 ? 1 : p.heads_q) * (p.bias_batch_step == 0 ? 1 : p.batch);
    total = tiles_n * tiles_m * slices;
  }
  __device__ __forceinline__ DbiasTile tile(HopperBwdParams const& p, int index) const {
    if (index >= total) {
      return DbiasTile{};
    }
    const int n_block = index % tiles_n, m_block = index / tiles_n % tiles_m;
    const TileRange visiting = visiting_query_tiles<T::kBlockM, T::kBlockN>(vis, n_block, tiles_m);
    const DbiasMembers members = dbias_members(p, index / tiles_n / tiles_m);
    return {n_block, m_block, members, m_block >= visiting.first && m_block < visiting.end ? members.count : 0};
  }
};

template <class T>
__device__ __forceinline__ void produce_tiles(HopperBwdParams const& p, typename T::SharedStorage& ss) {
  using Element = typename T::Element;
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_q));
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_k));
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_v));
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_do));
  const int group = p.heads_q / p.heads_kv;
  const DbiasSchedule<T> schedule(p);
  PipelineState<T::kStages> st;
  PipelineState<2> bias_st;
  for (int index = blockIdx.x; index < schedule.total; index += gridDim.x, bias_st.advance()) {
    const DbiasTile tile = schedule.tile(p, index);
    const int row = tile.m_block * T::kBlockM, key = tile.n_block * T::kBlockN;
    const int count = tile.seen;
    uint64_t* const bias_full = &ss.bias_full[bias_st.stage];
    Barrier::wait(&ss.bias_empty[bias_st.stage], bias_st.phase ^ 1);
    if (count == 0) {  // a tile no row sees: its dBias is 0 and its bias unread
      Barrier::arrive(bias_full);
    } else {
      TxBarrier::arrive_and_expect_tx(bias_full, T::kElemsBias * sizeof(Element));
      CUTE_UNROLL
      for (int c = 0; c < T::kBlockN / T::kBoxCols; ++c) {
        tma_load(&p.tma_bias, bias_full, ss.bias[bias_st.stage] + c * T::kBlockM * T::kBoxCols, key + c * T::kBoxCols,
                 row, tile.members.bias_head, tile.members.bias_entry);
      }
    }
    for (int j = 0; j < count; ++j, st.advance()) {
      Barrier::wait(&ss.empty[st.stage], st.phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&ss.full[st.stage], T::kBytesMember);
      const int head = tile.members.head(j), entry = tile.members.entry(j), head_kv = head / group;
      CUTE_UNROLL
      for (int c = 0; c < T::kHeadBoxes; ++c) {
        const int col = c * T::kHeadBoxCols;
        tma_load(&p.tma_q, &ss.full[st.stage], ss.q + st.stage * T::kElemsQ + c * T::kBlockM * T::kHeadBoxCols, col,
                 row, head, entry);
        tma_load(&p.tma_do, &ss.full[st.stage], ss.dout + st.stage * T::kElemsQ + c * T::kBlockM * T::kHeadBoxCols,
                 col, row, head, entry);
        tma_load(&p.tma_k, &ss.full[st.stage], ss.k + st.stage * T::kElemsK + c * T::kBlockN * T::kHeadBoxCols, col,
                 key, head_kv, entry);
        tma_load(&p.tma_v, &ss.full[st.stage], ss.v + st.stage * T::kElemsK + c * T::kBlockN * T::kHeadBoxCols, col,
                 key, head_kv, entry);
      }
    }
  }
}

// A consumer thread's share of member j's row stats: entry `thread` of (LSE in base 2 of every
// row, then delta of every row); rows past the sequence get LSE +inf (P = 0) and delta 0.
template <class T>
__device__ __forceinline__ float member_stat(HopperBwdParams const& p, DbiasMembers const& members, int j, int row0,
                                             int thread) {
  const int row = row0 + thread % T::kBlockM;
  const bool is_delta = thread >= T::kBlockM;
  if (thread >= 2 * T::kBlockM || row >= p.seqlen_q) {
    return is_delta ? 0.f : kInfinity;
  }
  const int64_t index = (int64_t(members.entry(j)) * p.heads_q + members.head(j)) * p.total_q + row;
  if (is_delta) {
    return reinterpret_cast<float const*>(p.delta)[index];
  }
  const float lse = reinterpret_cast<float const*>(p.lse)[index];
  return lse == -kInfinity ? kInfinity : lse * kLog2e;  // a row that sees no key: P = 0
}

template <class T>
__device__ __forceinline__ void store_member_stat(typename T::RowStats& stats, int thread, float value) {
  if (thread < T::kBlockM) {
    stats.lse_log2[thread] = value;
  } else if (thread < 2 * T::kBlockM) {
    stats.delta[thread - T::kBlockM] = value;
  }
}

// Stage j's row stats: member j of this tile, or past its last one the next tile's first (whose
// stats the last member stores, so that the next tile starts without a load's latency).
template <class T>
__device__ __forceinline__ float next_member_stat(HopperBwdParams const& p, DbiasTile const& tile,
                                                  DbiasTile const& next, int j, int thread) {
  if (j < tile.seen) {
    return member_stat<T>(p, tile.members, j, tile.m_block * T::kBlockM, thread);
  }
  return next.seen > 0 ? member_stat<T>(p, next.members, 0, next.m_block * T::kBlockM, thread) : 0.f;
}

// One dBias tile: its members' dS^T summed, then stored through the tile's bias buffer `bias_st`.
// `st`: the member ring, across tiles. `buffer`: the row stats' buffer that holds this tile's first
// member's (stored by the previous tile), then the next tile's. `next`: the CTA's next tile (none
// seen past the last). The previous tile's store is waited for (and its bias buffer released to
// the producer) once this tile's first GEMMs are issued, or before this tile's own store.
template <class T>
__device__ __forceinline__ void sum_members(HopperBwdParams const& p, typename T::SharedStorage& ss,
                                            Visibility<T::kCausal, T::kWindow> const& vis, DbiasTile const& tile,
                                            DbiasTile const& next, int thread,
                                            PipelineState<T::kStages>& st, PipelineState<2> const& bias_st,
                                            int& buffer, bool store_pending) {
  using Element = typename T::Element;
  DbiasMembers const& members = tile.members;
  const int m_block = tile.m_block, n_block = tile.n_block;
  auto release_previous = [&] {
    if (thread == 0 && store_pending) {
      cute::tma_store_wait<0>();  // its reads of the buffer; the writes complete on their own
      Barrier::arrive(&ss.bias_empty[bias_st.stage ^ 1]);
      store_pending = false;
    }
  };
  const int warpgroup = __shfl_sync(0xffffffff, thread / 128, 0);  // warp-uniform (bwd_mainloop.hpp's consume)
  typename T::TiledMmaSdP mma;
  auto thr = mma.get_thread_slice(warpgroup * 128 + thread % 128);
  Tensor tSrK = thr.partition_fragment_A(make_tensor(make_smem_ptr(ss.k), typename T::SmemLayoutK{}));
  Tensor tSrQ = thr.partition_fragment_B(make_tensor(make_smem_ptr(ss.q), typename T::SmemLayoutQ{}));
  Tensor tdPrV = thr.partition_fragment_A(make_tensor(make_smem_ptr(ss.v), typename T::SmemLayoutK{}));
  Tensor tdPrdO = thr.partition_fragment_B(make_tensor(make_smem_ptr(ss.dout), typename T::SmemLayoutQ{}));
  Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, Int<T::kBlockM>>{}));  // (key, row)
  Tensor acc_s = partition_fragment_C(mma, Shape<Int<T::kBlockN>, Int<T::kBlockM>>{});
  Tensor acc_dp = partition_fragment_C(mma, Shape<Int<T::kBlockN>, Int<T::kBlockM>>{});
  Tensor acc_dbias = partition_fragment_C(mma, Shape<Int<T::kBlockN>, Int<T::kBlockM>>{});
  clear(acc_dbias);

  const int row0 = m_block * T::kBlockM, key0 = n_block * T::kBlockN;
  const int count = tile.seen;
  const bool next_seen = next.seen > 0;
  const bool masked = row0 + T::kBlockM > p.seqlen_q || needs_mask<T::kBlockM, T::kBlockN>(vis, row0, key0);
  const float inv_scale = 1.f / p.scale;  // the bias joins the unscaled scores
  Element* const bias = ss.bias[bias_st.stage];
  const uint32_t bias_tile = cute::cast_smem_ptr_to_uint(bias);

  if (count == 0 && next_seen) {  // the next tile's first stats, into the buffer this one leaves free
    store_member_stat<T>(ss.stats[buffer], thread, next_member_stat<T>(p, tile, next, 0, thread));
  }
  Barrier::wait(&ss.bias_full[bias_st.stage], bias_st.phase);
  for (int j = 0; j < count; ++j, buffer ^= 1, st.advance()) {
    const float stat = next_member_stat<T>(p, tile, next, j + 1, thread);
    typename T::RowStats const& stats = ss.stats[buffer];
    Barrier::wait(&ss.full[st.stage], st.phase);
    discard_operand(acc_s);
    discard_operand(acc_dp);
    wgmma_gemm<true>(mma, tSrK(_, _, _, st.stage), tSrQ(_, _, _, st.stage), acc_s);
    wgmma_gemm<true>(mma, tdPrV(_, _, _, st.stage), tdPrdO(_, _, _, st.stage), acc_dp);
    release_previous();
    warpgroup_wait<1>();  // S^T
    bias_transposed_into<T::kBlockM, T::kBlockM, false, Element>(acc_s, cS, bias_tile, inv_scale);
    // The mask's bounds per row are the same for every member: kept in registers across the
    // members they spill (d 64's window), so they are recomputed per member (an opaque row0).
    int first_row = row0;
    asm volatile("" : "+r"(first_row));
    auto lse_log2 = [&](int row) { return stats.lse_log2[row]; };
    if (masked) {
      exponentiate_transposed<true>(acc_s, cS, vis, first_row, key0, p.seqlen_q, p.scale_log2, lse_log2);
    } else {
      exponentiate_transposed<false>(acc_s, cS, vis, first_row, key0, p.seqlen_q, p.scale_log2, lse_log2);
    }
    warpgroup_wait<0>();  // dP^T
    Barrier::arrive(&ss.empty[st.stage]);  // K, V, Q and dO of the stage are read
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dp); ++i) {
      acc_dbias(i) = fmaf(acc_s(i), acc_dp(i) - stats.delta[get<1>(cS(i))], acc_dbias(i));
    }
    if (j + 1 < count || next_seen) {
      store_member_stat<T>(ss.stats[buffer ^ 1], thread, stat);
    }
    named_barrier_sync(kMembersBarrier, T::kConsumerThreads);  // the next stats in, these read
  }

  // The tile, in the bias's type, through its bias buffer (every read of it is done: the last
  // member's barrier, or none began) to one TMA store per 64-key box, clipped at the plane's rows
  // and keys; the barrier also makes the next tile's first stats visible.
  store_rows_of_transposed<T::kBlockM, T::kBlockM>(convert_fragment<Element>(acc_dbias), cS, bias_tile);
  cutlass::arch::fence_view_async_shared();
  named_barrier_sync(kMembersBarrier, T::kConsumerThreads);
  release_previous();
  if (thread == 0) {
    CUTE_UNROLL
    for (int c = 0; c < T::kBlockN / T::kBoxCols; ++c) {
      cute::SM90_TMA_STORE_4D::copy(&p.tma_dbias, bias + c * T::kBlockM * T::kBoxCols, key0 + c * T::kBoxCols, row0,
                                    members.bias_head, members.bias_entry);
    }
    cute::tma_store_arrive();
  }
  __syncwarp();
}

// Grid: a CTA per tile, or fewer that walk them (DbiasSchedule).
template <class T>
__device__ __forceinline__ void bwd_dbias_kernel(HopperBwdParams const& p) {
  auto& ss = aligned_shared_storage<typename T::SharedStorage>();
  if (threadIdx.x == 0) {
    CUTE_UNROLL
    for (int b = 0; b < 2; ++b) {
      Barrier::init(&ss.bias_full[b], 1);
      Barrier::init(&ss.bias_empty[b], 1);
    }
    CUTE_UNROLL
    for (int s = 0; s < T::kStages; ++s) {
      Barrier::init(&ss.full[s], 1);
      Barrier::init(&ss.empty[s], T::kConsumerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    if (threadIdx.x == 0) {
      produce_tiles<T>(p, ss);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    const int thread = threadIdx.x - 128;
    const DbiasSchedule<T> schedule(p);
    PipelineState<T::kStages> st;
    PipelineState<2> bias_st;
    int buffer = 0;
    // The first tile's first stats; each tile then stores its next one's. A tile is computed
    // once, as the next tile, then carried.
    DbiasTile tile = schedule.tile(p, blockIdx.x);
    if (tile.seen > 0) {
      const float stat = member_stat<T>(p, tile.members, 0, tile.m_block * T::kBlockM, thread);
      store_member_stat<T>(ss.stats[0], thread, stat);
    }
    named_barrier_sync(kMembersBarrier, T::kConsumerThreads);
    for (int index = blockIdx.x; index < schedule.total; index += gridDim.x, bias_st.advance()) {
      const DbiasTile next = schedule.tile(p, index + gridDim.x);
      sum_members<T>(p, ss, schedule.vis, tile, next, thread, st, bias_st, buffer, index != blockIdx.x);
      tile = next;
    }
    if (thread == 0) {
      cute::tma_store_wait<0>();  // the last tile's store has read its buffer before the CTA exits
    }
  }
}

}  // namespace flashkiln::hopper
