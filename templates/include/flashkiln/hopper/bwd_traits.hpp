// Compile-time shape of one Hopper backward variant. A CTA owns one key tile of kBlockN keys and
// loops over the query tiles of kBlockM rows that see it, with two consumer warpgroups. Layouts
// are swizzled as TMA writes them and wgmma reads them: the head dims' tiles by head_boxes.hpp
// (128 bytes, or 64 at d 96 and at d_qk 192 split in two), the (rows, keys) tiles of dS, P^T and
// the bias by 128 bytes. d_qk (Q, K, dQ, dK) and d_v (V, dO, dV) may differ (192 / 128).
//
// The five GEMMs per query tile:
//   S^T  = K Q^T     and   dP^T = V dO^T      shared-memory operands;
//   dV  += P^T dO    and   dK  += dS^T Q
//   dQ   = dS K      dS through shared memory (both warpgroups' keys), split between the
//                    warpgroups by dQ's columns (each whole boxes), by its 64-row
//                    halves (tiles of 128 rows), or else by query tiles (each warpgroup every
//                    other tile's).
// The warpgroups share a key tile in one of two ways:
//   by keys (kBlockN = 128): each owns 64 keys, computes their S^T and dP^T for every row, and
//     keeps their dK and dV of every column in registers; P^T and dS^T feed dV and dK from
//     registers (accumulator layout);
//   by columns (kBlockN = 64, d 256 and 192 / 128, where 64 keys' dK and dV of all their columns
//     exceed a warpgroup's registers): each computes S^T and dP^T of the 64 keys for half the
//     rows, P^T and dS^T go through shared memory, and each keeps half of dK's and of dV's
//     columns.
// With kBias, a (kBlockM, kBlockN) tile of the additive bias rides in every Q/dO stage (split
// columns: each warpgroup reads its rows of it). Split by keys, the consumers then store dS over
// their stage's bias tile once they have read it, where dQ's GEMM reads it (K-major) and the
// producer stores a full bias's dBias from: such a kernel has no dS buffers, so that 128-row tiles
// and their bias tiles fit shared memory at d 64.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <flashkiln/common/score_mods.hpp>
#include <flashkiln/hopper/bwd_dq_tiles.hpp>
#include <flashkiln/hopper/head_boxes.hpp>

namespace flashkiln::hopper {

using namespace cute;

template <class Element_, int kDimQK_, int kDimV_, int kBlockM_, int kBlockN_, int kStages_, Causal kCausal_,
          bool kBias_, bool kWindow_, bool kSoftcap_, bool kBiasGrad_>
struct BwdTraits : ScoreMods<kCausal_, kBias_, kWindow_, kSoftcap_> {
  using Element = Element_;
  // dBias of a key-varying bias from dS (bwd_mainloop.hpp): its own entry point, so that the code
  // that writes or reduces dS leaves the registers of the kernel without it alone.
  static constexpr bool kBiasGrad = kBiasGrad_;
  static_assert(!kBiasGrad || kBias_, "dBias needs a bias");
  static constexpr int kDimQK = kDimQK_;  // Q, K, dQ, dK
  static constexpr int kDimV = kDimV_;    // V, dO, dV
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;

  static constexpr int kConsumerWarpgroups = kBwdConsumerWarpgroups;
  static constexpr bool kSplitColumns = kBlockN == 64;
  static constexpr bool kDsInBiasTile = kBias_ && !kSplitColumns;
  // dBias kernels: a consumer loop per dBias route (bwd_mainloop.hpp, consume_routed) where that
  // measured faster, the 128-row tiles of d 64 (7.9-9.5% on the full bias's row); else one loop
  // for every route, as the route loops ran 17-43% slower at d 128 (docs/perf.md v59, v60).
  static constexpr bool kRouteLoops = kBlockM == 128;
  static_assert(kBlockN == 64 * kConsumerWarpgroups || kSplitColumns, "keys split 64 per warpgroup, or columns");
  // The warpgroups' grid over S^T (keys, rows): by keys, or by rows where they split columns.
  static constexpr int kSdPWarpgroupsN = kSplitColumns ? kConsumerWarpgroups : 1;
  static constexpr int kSdPWarpgroupsM = kConsumerWarpgroups / kSdPWarpgroupsN;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  // The producer warpgroup (one thread issues every TMA load, one more per consumer warpgroup
  // adds its dQ to the accumulator) hands its registers to the consumers, which hold dK and dV
  // for the whole loop beside S, dP and dQ.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(128 * (kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters) <=
                    kThreads * (65536 / kThreads / 8 * 8),
                "setmaxnreg budgets exceed the CTA's registers");
  // A softcap's slopes stay in registers from the cap to dS (common/softcap.hpp), beside dK and dV
  // of at most 128 registers per thread (every head dim here: d 64-128 split by keys, 192/128 and
  // 256 by columns); with more they spilled (docs/perf.md, v31, v36-v37).
  static constexpr int kDkDvRegisters = (kBlockN / kSdPWarpgroupsM) * ((kDimQK + kDimV) / kSdPWarpgroupsN) / 128;
  static_assert(!kSoftcap_ || kDkDvRegisters <= 128, "a softcap's slopes beside dK and dV in registers");
  static constexpr int kBoxCols = 64;  // TMA boxes of the bias and dBias: one 128-byte swizzle atom wide
  // TMA boxes of Q and K, of V and dO: whole ones per warpgroup where they split the columns.
  static constexpr int kColumnParts = kSplitColumns ? kConsumerWarpgroups : 1;
  static constexpr int kQKBoxCols = head_box_cols(kDimQK, kColumnParts);
  static constexpr int kVBoxCols = head_box_cols(kDimV, kColumnParts);

  static_assert(kDimQK % (kColumnParts * kQKBoxCols) == 0 && kDimV % (kColumnParts * kVBoxCols) == 0,
                "head dims in whole swizzle atoms (per warpgroup where they split the columns)");
  static_assert(kSplitColumns || kDimQK == kDimV, "split by keys: equal head dims");
  // Boxes per row of a Q or K tile, of a V or dO tile.
  static constexpr int kQKBoxes = kDimQK / kQKBoxCols;
  static constexpr int kVBoxes = kDimV / kVBoxCols;
  static_assert(kSplitColumns || kStages >= 2, "at least a double-buffered Q/dO pipeline");
  // The P^T buffer is rewritten once the next tile's Q lands, which a single stage orders after
  // both warpgroups' dV GEMMs have read it (they release the stage).
  static_assert(!kSplitColumns || kStages == 1, "split columns: one Q/dO stage (shared memory)");
  static_assert(!kSplitColumns || kBlockM == 64, "split columns: 64-row query tiles");
  static_assert(kBlockM <= kConsumerThreads, "a consumer thread per row of a tile's row stats");

  // A query tile's dQ in the accumulator's 64-row tiles, of kDqParts column parts each: a
  // warpgroup computes and adds one (row tile, part) piece, or where a query tile has one piece
  // the warpgroups take turns, a whole tile's dQ each. (Splitting its keys instead, each warpgroup
  // adding its 64 keys' share to every column, doubled the bulk adds' L2 traffic.)
  static constexpr int kDqParts = dq_tile_parts(kDimQK);
  static constexpr int kDqRowTiles = kBlockM / kDqTileRows;
  static_assert(kBlockM % kDqTileRows == 0, "query tiles of whole 64-row dQ tiles");
  static constexpr bool kDqAlternate = kDqParts * kDqRowTiles == 1;
  static_assert(kDqAlternate || kDqParts * kDqRowTiles == kConsumerWarpgroups,
                "a dQ piece per consumer warpgroup (128-row tiles need head dims of one 64-column part)");
  static_assert(!kSplitColumns || !kDqAlternate, "split columns: a dQ part per warpgroup");
  static constexpr int kDqCols = kDimQK / kDqParts;  // per warpgroup
  using DqLayout = DqTileLayout<kDimQK, kDqParts>;

  using SmemAtomQK = BoxSmemAtom<Element, kQKBoxCols>;  // 8 rows x one box
  using SmemAtomV = BoxSmemAtom<Element, kVBoxCols>;
  // Q and dO: (rows, d, stage); K and V: (keys, d).
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQK{}, Shape<Int<kBlockM>, Int<kDimQK>, Int<kStages>>{}));
  using SmemLayoutDo = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockM>, Int<kDimV>, Int<kStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomQK{}, Shape<Int<kBlockN>, Int<kDimQK>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockN>, Int<kDimV>>{}));
  // Q and dO as the B operands of dK and dV: (d, rows, stage), d contiguous (MN-major).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kDimQK>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutDot = decltype(composition(
      SmemLayoutDo{}, make_ordered_layout(Shape<Int<kDimV>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // K as dQ's B operand: (d, keys).
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<Int<kDimQK>, Int<kBlockN>>{},
                                                                               Step<_2, _1>{})));
  // dS as dQ's A operand: (query rows, keys), rows contiguous (MN-major), in boxes of 64 rows;
  // byte (key k, row r) at (r / 64) * kBlockN * 128 + k * 128 + ((r % 64 / 8) ^ (k % 8)) * 16 +
  // (r % 8) * 2, which is how a warpgroup stores its dS^T fragment (swizzled_tile.hpp,
  // store_fragment, as a (keys, rows) tile). Or, in a bias tile (kDsInBiasTile), keys contiguous
  // (K-major) in boxes of 64 keys, as TMA lays out the bias (transposed_tile.hpp,
  // store_rows_of_transposed).
  static constexpr GMMA::Major kMajorDs = kDsInBiasTile ? GMMA::Major::K : GMMA::Major::MN;
  using SmemLayoutdS = cute::conditional_t<
      kDsInBiasTile,
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>>{})),
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>>{},
                             Step<_2, _1>{}))>;

  // P^T and dS^T as the A operands of dV and dK where they go through shared memory: (keys, rows),
  // rows contiguous (K-major); the same bytes as SmemLayoutdS.
  using SmemLayoutPt =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockN>, Int<kBlockM>>{}));

  // S^T and dP^T (one MMA: its atom depends on their M and N alone; K, d_qk or d_v, comes with
  // the operands).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockN / kSdPWarpgroupsM>, Int<kBlockM / kSdPWarpgroupsN>, Int<kDimV>>>(),
      Layout<Shape<Int<kSdPWarpgroupsM>, Int<kSdPWarpgroupsN>, _1>>{}));
  // dK (N = d_qk) and dV (N = d_v): A from registers, or from shared memory where the warpgroups
  // split the columns.
  template <int kDim>
  using TiledMmaGrad = decltype(make_tiled_mma(
      cute::conditional_t<
          kSplitColumns,
          decltype(GMMA::ss_op_selector<Element, Element, float,
                                        Shape<Int<kBlockN / kSdPWarpgroupsM>, Int<kDim / kSdPWarpgroupsN>, Int<kBlockM>>,
                                        GMMA::Major::K, GMMA::Major::MN>()),
          decltype(GMMA::rs_op_selector<Element, Element, float,
                                        Shape<Int<kBlockN / kSdPWarpgroupsM>, Int<kDim / kSdPWarpgroupsN>, Int<kBlockM>>,
                                        GMMA::Major::K, GMMA::Major::MN>())>{},
      Layout<Shape<Int<kSdPWarpgroupsM>, Int<kSdPWarpgroupsN>, _1>>{}));
  using TiledMmaDk = TiledMmaGrad<kDimQK>;
  using TiledMmaDv = TiledMmaGrad<kDimV>;
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kDqTileRows>, Int<kDqCols>, Int<kBlockN>>,
                           kMajorDs, GMMA::Major::MN>(),
      Layout<Shape<Int<kDqRowTiles>, Int<kDqParts>, _1>>{}));

  static constexpr int kElemsQ = kBlockM * kDimQK;  // per stage
  static constexpr int kElemsDo = kBlockM * kDimV;   // per stage
  static constexpr int kElemsK = kBlockN * kDimQK;
  static constexpr int kElemsV = kBlockN * kDimV;
  static constexpr int kElemsdS = kBlockM * kBlockN;
  static constexpr uint32_t kBytesQ = kElemsQ * sizeof(Element);
  static constexpr uint32_t kBytesDo = kElemsDo * sizeof(Element);
  static constexpr uint32_t kBytesK = kElemsK * sizeof(Element);
  static constexpr uint32_t kBytesV = kElemsV * sizeof(Element);
  static constexpr uint32_t kBytesDqPart = DqLayout::kPartFloats * sizeof(float);
  static constexpr int kElemsBias = kBlockM * kBlockN;  // per stage
  static constexpr uint32_t kBytesBias = kElemsBias * sizeof(Element);
  static constexpr uint32_t kBytesBiasRow = kBlockN * sizeof(Element);  // one row for every query

  // Per query tile: LSE (in base 2; +inf for rows past the sequence, whose P is then 0), delta, and
  // with a sink its weight in the row's softmax, exp(sink - LSE) (dSink's factor; 0 past the end);
  // each consumer thread loads kStatSlots of them (bwd_mainloop.hpp, row_stat).
  template <bool kSinkGrad>
  static constexpr int kStatSlots = ((kSinkGrad ? 3 : 2) * kBlockM + kConsumerThreads - 1) / kConsumerThreads;
  struct RowStats {
    float lse_log2[kBlockM];
    float delta[kBlockM];
    float sink_weight[kBlockM];
  };
  struct NoBias {};
  // Two dS buffers (a query tile's dS while the last one's dQ runs), then P^T's where the
  // warpgroups split columns; between a tile's dS, scratch of its exact deltas (exact_deltas) and
  // of its dBias key sums.
  struct DsBuffers {
    alignas(1024) Element tiles[(kSplitColumns ? 3 : 2) * kElemsdS];
  };
  // With dS in the bias tiles: the exact deltas' scratch alone, a partial sum per (warp, row).
  struct RowSums {
    float sums[kConsumerThreads / 32 * kBlockM];
  };
  struct BiasTiles {
    // Per stage (query rows, keys) in 64-key boxes, as TMA writes them; a bias broadcast over the
    // rows fills each box's first row.
    alignas(1024) Element tiles[kStages * kElemsBias];
  };
  struct SharedStorage {
    alignas(1024) Element k[kElemsK];
    alignas(1024) Element v[kElemsV];
    alignas(1024) Element q[kStages * kElemsQ];
    alignas(1024) Element dout[kStages * kElemsDo];
    cute::conditional_t<kDsInBiasTile, RowSums, DsBuffers> ds;
    alignas(1024) float dq[kConsumerWarpgroups * DqLayout::kPartFloats];  // each warpgroup's dQ for its bulk add
    RowStats stats[2];
    uint64_t kv_full;           // K and V landed
    uint64_t q_full[kStages];   // Q and dO of the stage landed
    uint64_t q_empty[kStages];  // every consumer finished the stage's GEMMs
    uint64_t dq_full[kConsumerWarpgroups];   // the warpgroup's dQ part is staged in dq
    uint64_t dq_empty[kConsumerWarpgroups];  // its writer's bulk add has read it
    uint64_t dbias_turn;  // this CTA's turn to add its dS tile to the shared dBias (pass_dbias_turns)
    uint64_t dbias_done;  // every consumer has issued its adds of the tile
    float sink_sums[kConsumerThreads / 32];  // dSink: each consumer warp's share of the CTA's sum
    cute::conditional_t<kBias_, BiasTiles, NoBias> bias;
  };
  static constexpr int kAlignSlack = 1024 - 16;  // the dynamic allocation starts 16-byte aligned
  static constexpr int kMaxSmemBytes = 232448;   // sm_90a's opt-in limit per block
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + kAlignSlack;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory of the tiles");
};

}  // namespace flashkiln::hopper
