// The forward's main loop, both roles: the producer thread streams Q once per work tile and
// K/V tiles through the stage ring with TMA; the consumer warpgroups compute S = Q K^T, the
// online softmax and O += P V on wgmma. Key tiles run last to first, so the partial tile at the
// sequence end and the tiles on a causal diagonal come first and are the only ones masked.
#pragma once

#include <cute/tensor.hpp>

#include <flashkiln/common/fragment.hpp>
#include <flashkiln/common/math.hpp>
#include <flashkiln/common/online_softmax.hpp>
#include <flashkiln/common/sequence.hpp>
#include <flashkiln/common/softcap.hpp>
#include <flashkiln/common/visibility.hpp>
#include <flashkiln/hopper/fwd_epilogue.hpp>
#include <flashkiln/hopper/fwd_params.hpp>
#include <flashkiln/hopper/fwd_score_mask.hpp>
#include <flashkiln/hopper/mma.hpp>
#include <flashkiln/hopper/pipeline.hpp>
#include <flashkiln/hopper/swizzled_tile.hpp>
#include <flashkiln/hopper/tile_scheduler.hpp>

namespace flashkiln::hopper {

using namespace cute;

// The work tiles. Under a causal mask the grid of query tiles starts above row 0 by the padding
// rounded down to whole warpgroups (64 rows; the runtime computes it, p.row_shift), so that a
// partial tile (seqlen_q not a multiple of tile_m) comes first, where it sees the fewest keys,
// rather than last, where it sees them all. A warpgroup's 64 rows then either all lie above row 0
// (its O stores are skipped) or start at row 0 or later: no TMA store starts at a negative row
// (one that did died with an illegal instruction; loads may).
template <class T>
__device__ __forceinline__ TileScheduler<T::kCausal != Causal::none> make_scheduler(HopperFwdParams const& p) {
  return {p.num_m_blocks, p.heads_q, p.batch, p.tile_counter, T::kBlockM,
          T::kCausal != Causal::none ? p.row_shift : 0, T::kBias ? p.tile_order : int(kQueryTilesInner)};
}

// The tile's sequence: its lengths and where its tokens lie (common/sequence.hpp).
template <class T>
__device__ __forceinline__ WorkTile in_sequence(HopperFwdParams const& p, WorkTile w) {
  if constexpr (T::kPacked) {
    const Sequence s = sequence_of(p, w.batch);
    w.seqlen_q = s.seqlen_q;
    w.seqlen_k = s.seqlen_k;
    w.q_begin = int(s.q_begin);  // token counts fit in int (runtime/varlen.py)
    w.k_begin = int(s.k_begin);
    w.entry = 0;
  } else {
    w.entry = w.batch;  // and tokens from 0; the lengths are the parameters' (seqlens)
  }
  return w;
}

// A work tile as the producer names it to the consumers, beside its Q slot: what they need of it
// (of a packed batch's sequence, too), the key tiles it has (-1: no tiles are left) and, with a
// window, the first of them.
template <class T>
struct TileRecord {
  __device__ __forceinline__ static void write(volatile int* r, WorkTile const& w, int n_blocks, int first) {
    r[0] = w.row0;
    r[1] = w.head;
    r[2] = w.batch;
    r[3] = n_blocks;
    if constexpr (T::kPacked) {
      r[4] = w.seqlen_q;
      r[5] = w.seqlen_k;
      r[6] = w.q_begin;
    }
    if constexpr (T::kWindow) {
      r[T::kRecordInts - 1] = first;
    }
  }
  __device__ __forceinline__ static int key_tiles(volatile int const* r) { return r[3]; }
  __device__ __forceinline__ static int first_key_tile(volatile int const* r) {
    if constexpr (T::kWindow) {
      return r[T::kRecordInts - 1];
    }
    return 0;
  }
  // The consumers' copy (k_begin, which only the producer reads, is left 0).
  __device__ __forceinline__ static WorkTile read(HopperFwdParams const& p, volatile int const* r) {
    const int batch = r[2];  // (each read of a volatile is a load of its own)
    WorkTile w{r[0], r[1], batch, 0, 0, 0, 0, batch};
    if constexpr (T::kPacked) {
      w.seqlen_q = r[4];
      w.seqlen_k = r[5];
      w.q_begin = r[6];
      w.entry = 0;
    }
    return w;
  }
};

// The visibility rule of the tile's sequence (common/visibility.hpp).
template <class T>
__device__ __forceinline__ Visibility<T::kCausal, T::kWindow> visibility_of(HopperFwdParams const& p,
                                                                          WorkTile const& w) {
  const int2 len = seqlens<T::kPacked>(p, w);
  return visibility<T::kCausal, T::kWindow>(len.x, len.y, reach_of(p));
}

// The key tiles the `rows` query rows from row0 of the tile's sequence see (the tile's own, by
// default), rows past the sequence end left out (visible_key_tiles).
template <class T>
__device__ __forceinline__ TileRange key_tiles(HopperFwdParams const& p, WorkTile const& w, int row0,
                                               int rows = T::kBlockM) {
  const int2 len = seqlens<T::kPacked>(p, w);
  const int n_tiles = ceil_div(len.y, T::kBlockN);
  return visible_key_tiles<T::kBlockN>(visibility_of<T>(p, w), row0, min(len.x, row0 + rows), n_tiles);
}

// Key tiles consumer warpgroup `warpgroup` computes of work tile w, whose first is `first`
// (fwd_traits.hpp, kSkipHidden): up to the last its own 64 rows see, but at least the tile's
// first, which holds the tile's O stage and Q release (a warpgroup whose rows see no key
// computes it fully masked).
template <class T>
__device__ __forceinline__ int warpgroup_key_tiles(HopperFwdParams const& p, WorkTile const& w, int warpgroup,
                                                   int first) {
  return max(1, key_tiles<T>(p, w, w.row0 + 64 * warpgroup, 64).end - first);
}

// In a packed batch the key tile at a sequence's end holds the next sequence's tokens (or tokens
// past the last sequence, of any value) where a dense batch's TMA loads zero-fill: its scores are
// masked, but P V would still multiply their values by zero (NaN stays NaN). So each consumer
// warpgroup zeroes the V rows from `first` before its P V reads the stage. Both warpgroups write
// the same zeros, so neither can see a value the other has not also written; whole box rows,
// which the swizzle only permutes within.
template <class T>
__device__ __forceinline__ void zero_v_rows(typename T::Element* stage, int first, int thread) {
  zero_rows<T::kBlockN, T::kDimV, T::kVBoxCols>(stage, first, thread % 128);
  cutlass::arch::fence_view_async_shared();  // generic writes that wgmma reads next
  named_barrier_sync(1 + thread / 128, 128);
}

// One thread of the producer warpgroup: every load of every work tile of this CTA.
template <class T>
__device__ __forceinline__ void produce(HopperFwdParams const& p, typename T::SharedStorage& ss) {
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_q));
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_k));
  cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_v));
  if constexpr (T::kBias) {
    cute::prefetch_tma_descriptor(reinterpret_cast<cute::TmaDescriptor const*>(&p.tma_bias));
  }
  const int group = p.heads_q / p.heads_kv;
  const auto sched = make_scheduler<T>(p);
  PipelineState<T::kStages> kv;
  PipelineState<T::kQSlots> q_slot;  // the slot of the next tile's Q, in tile order

  struct Claimed {
    int tile;
    bool valid;  // false: the schedule's end
    WorkTile w;
    int n_blocks;  // key tiles, from `first`
    int first;
  };
  auto claimed = [&](int tile, bool valid, WorkTile const& w) {
    const TileRange keys = valid ? key_tiles<T>(p, w, w.row0) : TileRange{0, 0};
    return Claimed{tile, valid, w, T::kWindow ? max(keys.end - keys.first, 0) : keys.end, keys.first};
  };
  auto claim = [&](int tile) {
    if constexpr (T::kPacked) {
      // The first tile from `tile` on with query rows: the query tiles of the longest sequence
      // past a shorter one's end hold none.
      for (; sched.valid(tile); tile = sched.next(tile)) {
        const WorkTile w = in_sequence<T>(p, sched.decode(tile));
        if (w.row0 < w.seqlen_q) {
          return claimed(tile, true, w);
        }
      }
      return Claimed{tile, false, WorkTile{}, 0, 0};
    } else {
      const bool valid = sched.valid(tile);
      return claimed(tile, valid, valid ? in_sequence<T>(p, sched.decode(tile)) : WorkTile{});
    }
  };
  // Whether the consumers have released the next Q slot (and its tile record), waiting for it
  // if `block`; a slot's first use finds it free.
  auto q_free = [&](bool block) {
    if (block) {
      Barrier::wait(&ss.q_empty[q_slot.stage], q_slot.phase ^ 1);
      return true;
    }
    return Barrier::try_wait(&ss.q_empty[q_slot.stage], q_slot.phase ^ 1);
  };
  // Name a tile to the consumers (the end, or no keys: O = 0) and load its Q, into the free
  // slot. The q_full arrival releases the store of the tile's coordinates, which the producer
  // decodes so that the consumers' integer divisions stay off their tile boundary.
  auto publish = [&](Claimed const& t) {
    const int slot = q_slot.stage;
    q_slot.advance();
    TileRecord<T>::write(ss.tile[slot], t.w, t.valid ? t.n_blocks : -1, t.first);
    if (t.n_blocks == 0) {
      Barrier::arrive(&ss.q_full[slot]);
      return;
    }
    TxBarrier::arrive_and_expect_tx(&ss.q_full[slot], T::kBytesQ);
    CUTE_UNROLL
    for (int c = 0; c < T::kDimQK / T::kQKBoxCols; ++c) {
      tma_load(&p.tma_q, &ss.q_full[slot], ss.q + slot * T::kElemsQ + c * T::kBlockM * T::kQKBoxCols,
               c * T::kQKBoxCols, t.w.q_begin + t.w.row0, t.w.head, t.w.entry);
    }
  };
  // With two Q slots a tile is claimed and named during the last key tile of the one before:
  // its Q goes to the slot that the tile before that released, so it loads a tile ahead and the
  // claim's atomic is off the tile boundary. With one slot, the tile's Q waits for its own slot
  // (after the previous tile's last S), so a tile is claimed after the previous one's loads.
  constexpr bool kNameAhead = T::kQSlots > 1;
  Claimed cur = claim(sched.first());
  if (kNameAhead) {
    publish(cur);
  }
  for (;;) {
    if (cur.n_blocks == 0) {
      if (!kNameAhead) {
        q_free(true);
        publish(cur);
      }
      if (!cur.valid) {
        return;
      }
      cur = claim(sched.next(cur.tile));
      if (kNameAhead) {
        q_free(true);
        publish(cur);
      }
      continue;
    }
    const WorkTile w = cur.w;
    const int n_blocks = cur.n_blocks;
    const int key0 = T::kWindow ? cur.first : 0;  // n_block counts key tiles from this one
    const int head_kv = w.head / group;
    Claimed next;
    int ahead = 0;  // the next tile, claimed at the start of this tile's last key tile
    for (int n_block = n_blocks - 1; n_block >= 0; --n_block) {
      if (kNameAhead && n_block == 0) {
        ahead = sched.next(cur.tile);  // its atomic's latency passes under the waits below
      }
      Barrier::wait(&ss.k_empty[kv.stage], kv.phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&ss.k_full[kv.stage], T::kBytesK);
      CUTE_UNROLL
      for (int c = 0; c < T::kDimQK / T::kQKBoxCols; ++c) {
        tma_load(&p.tma_k, &ss.k_full[kv.stage], ss.k + kv.stage * T::kElemsK + c * T::kBlockN * T::kQKBoxCols,
                 c * T::kQKBoxCols, w.k_begin + (key0 + n_block) * T::kBlockN, head_kv, w.entry);
      }
      if constexpr (T::kBias) {
        // A bias broadcast over query rows loads one row per box, into the box's first row.
        Barrier::wait(&ss.bias.empty[kv.stage], kv.phase ^ 1);
        TxBarrier::arrive_and_expect_tx(&ss.bias.full[kv.stage], p.bias_row_step ? T::kBytesBias : T::kBytesBiasRow);
        CUTE_UNROLL
        for (int c = 0; c < T::kBlockN / T::kBoxCols; ++c) {
          tma_load(&p.tma_bias, &ss.bias.full[kv.stage],
                   ss.bias.tiles + kv.stage * T::kElemsBias + c * T::kBlockM * T::kBoxCols,
                   (key0 + n_block) * T::kBlockN + c * T::kBoxCols, w.row0 * p.bias_row_step,
                   w.head * p.bias_head_step, w.batch * p.bias_batch_step);
        }
      }
      auto load_v = [&] {
        TxBarrier::arrive_and_expect_tx(&ss.v_full[kv.stage], T::kBytesV);
        CUTE_UNROLL
        for (int c = 0; c < T::kDimV / T::kVBoxCols; ++c) {
          tma_load(&p.tma_v, &ss.v_full[kv.stage], ss.v + kv.stage * T::kElemsV + c * T::kBlockN * T::kVBoxCols,
                   c * T::kVBoxCols, w.k_begin + (key0 + n_block) * T::kBlockN, head_kv, w.entry);
        }
      };
      if (!kNameAhead && n_block == n_blocks - 1) {
        // The tile's first K (and bias) tiles load while the consumers still finish the previous
        // work tile; then its Q and its first V, whichever buffer frees up first. Q's slot frees
        // with the previous tile's last S (after its epilogue if that tile had no keys), the V
        // stage kStages - 2 key tiles before the previous tile's end; the tile's first S needs Q,
        // its first P V comes a softmax later. Q after V cost up to 5% at S <= 2k (docs/perf.md, v9).
        bool q_pending = true;
        bool v_pending = true;
        while (q_pending || v_pending) {
          if (q_pending && q_free(false)) {
            publish(cur);
            q_pending = false;
          }
          if (v_pending && Barrier::try_wait(&ss.v_empty[kv.stage], kv.phase ^ 1)) {
            load_v();
            v_pending = false;
          }
        }
      } else {
        Barrier::wait(&ss.v_empty[kv.stage], kv.phase ^ 1);
        load_v();
      }
      kv.advance();
      if (kNameAhead && n_block == 0) {
        // Right after this tile's last loads, before the next tile's first K: the Q slot is free
        // by now (released with the last S of the tile before this one).
        next = claim(ahead);
        q_free(true);
        publish(next);
      }
    }
    cur = kNameAhead ? next : claim(sched.next(cur.tile));
  }
}

// A consumer warpgroup: every work tile of this CTA, as the producer names them. Per tile: S of
// its first key tile (unless the previous tile's last turn issued it), then per key tile S of the
// next key tile and O += P V of this one, issued together in one turn of the ping-pong where
// there are turns; the next key tile's softmax runs while this warpgroup's P V and the other
// warpgroups' GEMMs keep the tensor cores busy. With two Q slots the next tile's Q has landed
// before this tile's last P V: that turn issues the next tile's first S first, and the next
// tile's first softmax runs under this tile's last P V, before its epilogue. Under a causal mask
// a warpgroup starts a tile at the first key tile its own rows see (kSkipHidden).
template <class T>
__device__ __forceinline__ void consume(HopperFwdParams const& p, typename T::SharedStorage& ss, int thread) {
  typename T::TiledMmaS mma_s;
  typename T::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(thread);
  auto thr_o = mma_o.get_thread_slice(thread);
  // Shared-memory descriptors as (MMA, M or N, K, slot or stage).
  Tensor tSrQ = thr_s.partition_fragment_A(make_tensor(make_smem_ptr(ss.q), typename T::SmemLayoutQ{}));
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v), typename T::SmemLayoutVt{});
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tOrV = thr_o.partition_fragment_B(sVt);
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
  Tensor tScS = rowcol(cS);
  const float inv_scale = 1.f / p.scale;  // the bias joins the unscaled scores (portable/bias.hpp)
  Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<T::kBlockM>, Int<T::kBlockN>>{});
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<T::kBlockM>, Int<T::kDimV>>{});
  constexpr int kRows = decltype(size<0>(rowcol(acc_o)))::value;
  // P of the key tile whose P V is issued next: it stays unchanged until that GEMM has completed,
  // while the softmax of the following key tile runs beside it.
  Tensor p_regs = make_fragment_like<typename T::Element>(acc_s);
  Tensor tOrP = make_tensor(p_regs.data(), acc_as_operand_a(p_regs.layout()));
  PipelineState<T::kStages> kv;
  PipelineState<T::kQSlots> q_slot;  // the slot of the next tile's Q, in tile order
  const WarpgroupTurns<T::kTurns> turns(thread / 128);
  uint32_t stage_read_phase = 0;

  struct Tile {
    WorkTile w;
    int n_blocks;  // key tiles this warpgroup computes (0: the tile has none), from `first`
    int first;
    int q_slot;
    bool valid;    // false: no tiles are left
    // The column of the tile's key tile n_block (counted from `first`).
    __device__ __forceinline__ int col0(int n_block) const {
      return ((T::kWindow ? first : 0) + n_block) * T::kBlockN;
    }
  };
  // The next tile, once the producer names it (its Q has landed with the name), past the key
  // tiles this warpgroup skips.
  auto next_tile = [&] {
    Tile t;
    t.q_slot = q_slot.stage;
    Barrier::wait(&ss.q_full[q_slot.stage], q_slot.phase);
    q_slot.advance();
    volatile int const* named = ss.tile[t.q_slot];
    t.w = TileRecord<T>::read(p, named);
    // Two loads of the count: with one, ptxas spilled in the d 64 consumers.
    t.valid = TileRecord<T>::key_tiles(named) >= 0;
    t.n_blocks = max(TileRecord<T>::key_tiles(named), 0);
    t.first = TileRecord<T>::first_key_tile(named);
    if constexpr (T::kSkipHidden) {
      // The warpgroup broadcast, so that the compiler knows it is warp-uniform: the pipeline
      // state that depends on it stays in uniform registers.
      const int own = warpgroup_key_tiles<T>(p, t.w, __shfl_sync(0xffffffff, thread / 128, 0), t.first);
      CUTE_UNROLL
      for (int i = 0; i < T::kMaxSkipped; ++i) {
        if (t.n_blocks > own) {
          // Released once landed: an arrival before that could count toward the stage's
          // previous use, which other warpgroups may still be reading.
          Barrier::wait(&ss.k_full[kv.stage], kv.phase);
          Barrier::arrive(&ss.k_empty[kv.stage]);
          if constexpr (T::kBias) {
            Barrier::wait(&ss.bias.full[kv.stage], kv.phase);
            Barrier::arrive(&ss.bias.empty[kv.stage]);
          }
          Barrier::wait(&ss.v_full[kv.stage], kv.phase);
          Barrier::arrive(&ss.v_empty[kv.stage]);
          kv.advance();
          --t.n_blocks;
          turns.wait();  // the turn of the key tile's S: every warpgroup takes the same count
          turns.pass();
        }
      }
    }
    return t;
  };
  // The bias tile of the current key tile's stage into acc_s (bias_tile_into), and its buffer
  // released.
  auto take_bias = [&](auto add) {
    if constexpr (T::kBias) {
      const uint32_t tile = cute::cast_smem_ptr_to_uint(ss.bias.tiles + kv.stage * T::kElemsBias);
      Barrier::wait(&ss.bias.full[kv.stage], kv.phase);
      if (p.bias_row_step) {
        bias_tile_into<T::kBlockM, false, decltype(add)::value, typename T::Element>(acc_s, cS, tile, inv_scale);
      } else {
        bias_tile_into<T::kBlockM, true, decltype(add)::value, typename T::Element>(acc_s, cS, tile, inv_scale);
      }
      Barrier::arrive(&ss.bias.empty[kv.stage]);
    }
  };
  // S of the current key tile (kv.stage, once landed) from the Q in `slot`, as one wgmma group.
  auto issue_s = [&](int slot) {
    if constexpr (T::kBiasFirst) {
      take_bias(cute::false_type{});
    }
    Barrier::wait(&ss.k_full[kv.stage], kv.phase);
    turns.wait();
    wgmma_gemm<!T::kBiasFirst>(mma_s, tSrQ(_, _, _, slot), tSrK(_, _, _, kv.stage), acc_s);
  };
  // O rescaled to the row maxima of the P about to join it, where the softmax asked for it.
  float rescale[kRows];
  auto rescale_o = [&](bool must_rescale, auto& softmax) {
    if (must_rescale) {
      softmax.rescale_output(rowcol(acc_o), rescale);
    }
  };
  // One turn: S of the current key tile, then O += P V of the V stage v_stage; returns once S
  // has landed (waiting for all but the last group), with P V still running. A lazy rescale (a
  // warp vote, rarely a rescale) sits between the two GEMMs, off the path to S: +0.5-1% at d 128
  // and 256. At d 64, which rescales every step, that measured 1% slower at S 1k than the head
  // of the step (docs/perf.md, v12), where it stays.
  auto issue_s_and_pv = [&](int slot, int v_stage, bool must_rescale, auto& softmax) {
    issue_s(slot);
    if constexpr (T::kLazyRescale) {
      rescale_o(must_rescale, softmax);
    }
    wgmma_gemm<false>(mma_o, tOrP, tOrV(_, _, _, v_stage), acc_o);
    turns.pass();
    warpgroup_wait<1>();
  };
  // Once S of key tile n_block is in acc_s, its K stage is free (but for the last key tile's where
  // O is staged there) and the Q slot after the last; a softcap caps the scores, then the stage's
  // bias tile joins them unless it was S's initial value.
  auto s_done = [&](Tile const& t, int n_block) {
    if (T::kOwnO || n_block > 0) {
      Barrier::arrive(&ss.k_empty[kv.stage]);
    }
    if (n_block == 0) {
      Barrier::arrive(&ss.q_empty[t.q_slot]);
    }
    if constexpr (T::kSoftcap) {
      cap_scores(acc_s, p.softcap_scale);
    }
    if constexpr (T::kBias && !T::kBiasFirst) {
      take_bias(cute::true_type{});
    }
  };
  // Scores of key tile n_block to probabilities; O is rescaled (rescale_o) where `exponentiate`
  // asks for it, once no GEMM accumulates into it.
  auto to_probabilities = [&](auto first, Tile const& t, int n_block, auto& softmax) {
    const auto vis = visibility_of<T>(p, t.w);
    if (needs_mask<T::kBlockM, T::kBlockN>(vis, t.w.row0, t.col0(n_block))) {
      hopper::mask_scores(rowcol(acc_s), tScS, vis, t.w.row0, t.col0(n_block));
    }
    return softmax.template exponentiate<decltype(first)::value>(rowcol(acc_s), p.scale_log2, rescale);
  };

  Tile tile = next_tile();
  // Whether the previous tile's last turn already turned this tile's first key tile into
  // probabilities (in acc_s and softmax).
  bool started = false;
  using Softmax = OnlineSoftmax<kRows, T::kLazyRescale>;
  Softmax softmax;
  while (tile.valid) {
    if (!started) {
      softmax = Softmax{};
    }
    clear(acc_o);
    if (tile.n_blocks == 0) {
      if (T::kOwnO) {
        Barrier::arrive(&ss.q_empty[tile.q_slot]);  // a tile without keys reads no Q
      }
      store_tile<T>(p, ss, thread, tile.w, tile.q_slot, -1, stage_read_phase, acc_o, softmax);
      tile = next_tile();
      continue;
    }
    bool must_rescale = false;
    if (!started) {
      issue_s(tile.q_slot);
      turns.pass();
      warpgroup_wait<0>();
      s_done(tile, tile.n_blocks - 1);
      must_rescale = to_probabilities(cute::true_type{}, tile, tile.n_blocks - 1, softmax);
    }
    // Each step starts with acc_s holding the probabilities of key tile n_block and O += P V of
    // the tile before possibly in flight. It waits for that GEMM, turns acc_s into P, issues S of
    // the next key tile and P V of this one, and runs the new S's softmax while they run.
    int v_stage = -1;  // the V stage of the P V GEMM in flight (-1: none)
    for (int n_block = tile.n_blocks - 1;; --n_block) {
      // The wait heads the step rather than ending the previous one: ptxas schedules a wgmma wait
      // early in its basic block, which would put it before the softmax (docs/perf.md, v9).
      warpgroup_wait<0>();
      if (v_stage >= 0) {
        Barrier::arrive(&ss.v_empty[v_stage]);
      }
      if constexpr (!T::kLazyRescale) {
        rescale_o(must_rescale, softmax);
      }
      p_regs = convert_fragment<typename T::Element>(acc_s);
      v_stage = kv.stage;
      Barrier::wait(&ss.v_full[v_stage], kv.phase);
      if (T::kPacked && tile.col0(n_block) + T::kBlockN > tile.w.seqlen_k) {
        zero_v_rows<T>(ss.v + v_stage * T::kElemsV, tile.w.seqlen_k - tile.col0(n_block), thread);
      }
      kv.advance();
      if (n_block == 0) {
        break;
      }
      // S of the next key tile first, so that waiting for all but one GEMM waits for S alone.
      issue_s_and_pv(tile.q_slot, v_stage, must_rescale, softmax);
      s_done(tile, n_block - 1);
      must_rescale = to_probabilities(cute::false_type{}, tile, n_block - 1, softmax);
    }
    // The last P V. Without O's own buffer the consumers keep its stage: O is staged there, and
    // the epilogue releases it (store_tile). Each branch waits for its own GEMMs: accumulators of
    // a GEMM in flight must not meet at a join (ptxas would serialize every wgmma, C7515).
    auto last_pv_done = [&] { Barrier::arrive(T::kOwnO ? &ss.v_empty[v_stage] : &ss.stage_read); };
    // With one Q slot the next tile's Q loads only once this tile's last S has released the slot:
    // its name is read after the epilogue, not waited for before the last P V.
    const Tile next = T::kQSlots > 1 ? next_tile() : Tile{};
    if (T::kQSlots > 1 && next.n_blocks > 0) {
      // The next tile's first S, then this tile's last P V; the next tile's first softmax runs
      // under that P V, and this tile's epilogue follows.
      issue_s_and_pv(next.q_slot, v_stage, must_rescale, softmax);
      Softmax next_softmax;
      // A branch ptxas cannot fold (the count is broadcast, so it is unknown to be positive)
      // keeps the softmax in blocks of its own: ptxas would otherwise sink the exponentials
      // below the epilogue's wait for the P V.
      if (__shfl_sync(0xffffffff, next.n_blocks, 0) > 0) {
        s_done(next, next.n_blocks - 1);
        to_probabilities(cute::true_type{}, next, next.n_blocks - 1, next_softmax);
      }
      warpgroup_wait<0>();
      last_pv_done();
      store_tile<T>(p, ss, thread, tile.w, tile.q_slot, v_stage, stage_read_phase, acc_o, softmax);
      softmax = next_softmax;
      started = true;
    } else {
      if constexpr (T::kLazyRescale) {
        rescale_o(must_rescale, softmax);
      }
      turns.wait();
      wgmma_gemm<false>(mma_o, tOrP, tOrV(_, _, _, v_stage), acc_o);
      turns.pass();
      warpgroup_wait<0>();
      last_pv_done();
      store_tile<T>(p, ss, thread, tile.w, tile.q_slot, v_stage, stage_read_phase, acc_o, softmax);
      started = false;
    }
    tile = T::kQSlots > 1 ? next : next_tile();
  }
  if (T::kOwnO && thread % 128 == 0) {
    cute::tma_store_wait<0>();  // O's buffer must outlive the reads of the last stores
  }
}

}  // namespace flashkiln::hopper
