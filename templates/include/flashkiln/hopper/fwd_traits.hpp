// Compile-time shape of one Hopper forward variant: warp roles, shared-memory layouts (swizzled
// as TMA writes them and wgmma reads them: head dims by hopper/head_boxes.hpp, the bias by 128 bytes), the two warpgroup MMAs and the byte counts
// the pipeline expects per TMA load. With kBias, a (tile_m, tile_n) tile of the additive bias
// rides in every K/V stage, with barriers of its own. With kPacked, the kernel runs packed
// variable-length batches (common/sequence.hpp) and only those; without, dense ones only.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <flashkiln/common/score_mods.hpp>
#include <flashkiln/hopper/head_boxes.hpp>

namespace flashkiln::hopper {

using namespace cute;

template <class Element_, int kDimQK_, int kDimV_, int kBlockM_, int kBlockN_, int kStages_, Causal kCausal_,
          bool kBias_, bool kPacked_, bool kWindow_, bool kSoftcap_>
struct FwdTraits : ScoreMods<kCausal_, kBias_, kWindow_, kSoftcap_> {
  using Element = Element_;
  static constexpr int kDimQK = kDimQK_;
  static constexpr int kDimV = kDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kPacked = kPacked_;
  static constexpr int kRecordInts = (kPacked ? 7 : 4) + (kWindow_ ? 1 : 0);  // fwd_mainloop.hpp, TileRecord

  // One producer warpgroup (a single thread issues the TMA loads), then one consumer warpgroup
  // per 64 query rows of the tile.
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  // setmaxnreg budgets: the producer hands registers to the consumers. The CTA keeps what it was
  // launched with (65536 / kThreads each, rounded down to 8: 168 for 384 threads, 128 for 512),
  // so the sum must not exceed that. At 24 the producer spills some schedule state to local
  // memory, which measured cheaper than taking 8 registers from ping-ponging consumers (which
  // hold S, P and O at once): 24/240 beat 40/232 by up to 10% at d = 256 (docs/perf/).
  static constexpr int kProducerRegisters = kConsumerWarpgroups == 3 ? 32 : 24;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 3 ? 160 : 240;
  // Two consumer warpgroups take turns issuing their GEMMs (pipeline.hpp, WarpgroupTurns); three
  // (d = 64) measured 0-2% slower with turns than without.
  static constexpr bool kPingPong = kConsumerWarpgroups == 2;
  static constexpr int kTurns = kPingPong ? kConsumerWarpgroups : 1;  // 1: no turns
  // Under a causal mask each consumer warpgroup may skip the key tiles its own 64 rows cannot see
  // (the tile's last, which run first), though the tile's lower rows need them; it only releases
  // their stages and passes their turns (fwd_mainloop.hpp). It does where the top warpgroup skips a
  // key tile in most work tiles, (kBlockM - 64) / kBlockN > 1/2: 192 x 128 (d 64: +3% at S 1k)
  // and 128 x 80 (d 256: +1.5-2.5% at S 1-2k). At d 128 (128 x 160: 2 tiles in 5; 128 x 128:
  // every tile or none, by the rows' alignment) it measured 1% slower at S 1-2k (docs/perf.md,
  // v13). A warpgroup's last row is at most kBlockM - 64 above the tile's.
  static constexpr bool kSkipHidden = kCausal_ != Causal::none && 2 * (kBlockM - 64) > kBlockN;
  static constexpr int kMaxSkipped = kSkipHidden ? (kBlockM - 64 + kBlockN - 1) / kBlockN : 0;
  // The online softmax rescales O only when a row maximum outgrows its reference by 2^8
  // (common/online_softmax.hpp): +1-2.5% at d_v 128 and 256; at d_v 64, with 32 accumulators
  // of O per thread, the warp vote costs more than the multiplications it skips (-4-7%).
  static constexpr bool kLazyRescale = kDimV >= 128;
  // Where the bias joins the scores: as S's initial value, written before the S GEMM is issued
  // (kBiasFirst), or added once S has landed. Against the add, the initial value measured +1%
  // (full bias) and +3-6% (shared) with three consumer warpgroups (d 64), which take no turns;
  // with two, whose S waits for its turn, 0% at d 128 and -6% at d 256 (docs/perf.md, v15).
  static constexpr bool kBiasFirst = kBias_ && !kPingPong;
  static_assert(!(kSoftcap_ && kBiasFirst), "the softcap comes before the bias, which kBiasFirst adds before S");
  static_assert(128 * (kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters) <=
                    kThreads * (65536 / kThreads / 8 * 8),
                "setmaxnreg budgets exceed the CTA's registers");
  // TMA boxes are one swizzle atom wide: the bias's 64 keys (128 bytes); Q and K's, V and O's
  // columns by their head dims (head_boxes.hpp: 64, or 32 at d 96).
  static constexpr int kBoxCols = 64;
  static constexpr int kQKBoxCols = head_box_cols(kDimQK);
  static constexpr int kVBoxCols = head_box_cols(kDimV);

  static_assert(kBlockM % 64 == 0 && kConsumerWarpgroups <= 3, "64 query rows per consumer warpgroup");
  static_assert(kDimQK % kQKBoxCols == 0 && kDimV % kVBoxCols == 0, "head dims in whole swizzle atoms");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key tile: wgmma N and the P V GEMM's k16 steps");
  static_assert(kStages >= 2, "at least a double-buffered K/V pipeline");
  static_assert(!kBias_ || kBlockN % kBoxCols == 0, "bias tiles load in whole 64-key boxes");

  using SmemAtomQK = BoxSmemAtom<Element, kQKBoxCols>;  // 8 rows x one box
  using SmemAtomV = BoxSmemAtom<Element, kVBoxCols>;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomQK{}, Shape<Int<kBlockN>, Int<kDimQK>, Int<kStages>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockN>, Int<kDimV>, Int<kStages>>{}));
  // V read as the B operand of P V: (d_v, keys, stage), d_v contiguous (MN-major).
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kDimV>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  // S = Q K^T: both operands in shared memory. O += P V: P from registers.
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kDimQK>>>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kDimV>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));

  static constexpr int kElemsQ = kBlockM * kDimQK;
  static constexpr int kElemsO = kBlockM * kDimV;
  static constexpr int kElemsK = kBlockN * kDimQK;  // per stage
  static constexpr int kElemsV = kBlockN * kDimV;   // per stage
  static constexpr uint32_t kBytesQ = kElemsQ * sizeof(Element);
  static constexpr uint32_t kBytesK = kElemsK * sizeof(Element);
  static constexpr uint32_t kBytesV = kElemsV * sizeof(Element);
  static constexpr int kElemsBias = kBlockM * kBlockN;  // per stage
  static constexpr uint32_t kBytesBias = kElemsBias * sizeof(Element);
  static constexpr uint32_t kBytesBiasRow = kBlockN * sizeof(Element);  // one row for every query

  struct NoBias {};
  struct BiasRing {
    // Per stage (query rows, keys) in 64-key boxes, laid out like Q's (rows, head dim).
    alignas(1024) Element tiles[kStages * kElemsBias];
    uint64_t full[kStages];   // the stage's bias tile landed
    uint64_t empty[kStages];  // the consumers added it to their scores
  };

  // Swizzled buffers start on 1024-byte boundaries (the 128-byte swizzle repeats every 8 rows).
  // A Q slot is free once its tile's last S = Q K^T has run. With one slot, the next tile's Q
  // loads during this tile's last steps and epilogue; with two (where they fit beside O's own
  // buffer), a tile ahead, so that the consumers can issue the next tile's first S before this
  // tile's epilogue (fwd_kernel.hpp). O is staged for its TMA stores in a buffer of its own
  // wherever one fits, else in the K/V stage of the tile's last key tile (64 rows per consumer
  // warpgroup: the first's in the K buffer, the second's in the V buffer), which the producer
  // then refills once the stores have read it; a tile without keys stages its zeros in its Q slot.
  template <int kQSlots_>
  struct StorageQKV {
    static constexpr int kQSlots = kQSlots_;
    alignas(1024) Element q[kQSlots * kElemsQ];  // Q (and, without an O buffer, a keyless tile's zero O)
    alignas(1024) Element k[kStages * kElemsK];
    alignas(1024) Element v[kStages * kElemsV];
    uint64_t q_full[kQSlots];     // Q landed (TMA transaction count)
    uint64_t q_empty[kQSlots];    // the consumers are done with the slot
    uint64_t k_full[kStages];
    uint64_t v_full[kStages];
    uint64_t k_empty[kStages];    // the consumers finished reading the stage's K
    uint64_t v_empty[kStages];    // ... and its V
    uint64_t stage_read;          // every consumer finished its tile's last GEMMs (O staged in that stage)
    // The work tile of the slot's Q (fwd_mainloop.hpp, TileRecord), decoded by the producer (valid
    // once the slot's q_full completes).
    int tile[kQSlots][kRecordInts];
    cute::conditional_t<kBias_, BiasRing, NoBias> bias;
  };
  template <int kQSlots_>
  struct StorageQKVO : StorageQKV<kQSlots_> {
    alignas(1024) Element o[kElemsO];
  };
  // The dynamic allocation starts 16-byte aligned at worst: room to round up to 1024.
  static constexpr int kAlignSlack = 1024 - 16;
  static constexpr int kMaxSmemBytes = 232448;  // sm_90a's opt-in limit per block
  static constexpr bool kOwnO = int(sizeof(StorageQKVO<1>)) + kAlignSlack <= kMaxSmemBytes;
  static constexpr int kQSlots =
      kConsumerWarpgroups == 3 && kOwnO && int(sizeof(StorageQKVO<2>)) + kAlignSlack <= kMaxSmemBytes ? 2 : 1;
  static_assert(kOwnO || (kConsumerWarpgroups == 2 && 64 * kDimV <= kElemsK && 64 * kDimV <= kElemsV),
                "without its own buffer, O is staged in a K/V stage");
  static_assert(kOwnO || kElemsO <= kElemsQ, "a tile without keys stages O in its Q slot");
  using SharedStorage = cute::conditional_t<kOwnO, StorageQKVO<kQSlots>, StorageQKV<kQSlots>>;
  // Q as (rows, head dim, slot), like K's stages: a slot's wgmma descriptors are computed from
  // its index. A choice between two descriptor sets became a local-memory array in the d 64
  // kernels, read before every S.
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQK{}, Shape<Int<kBlockM>, Int<kDimQK>, Int<kQSlots>>{}));
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + kAlignSlack;
};

}  // namespace flashkiln::hopper
