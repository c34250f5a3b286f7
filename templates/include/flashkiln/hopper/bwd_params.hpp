// Parameter block of the Hopper backward's main kernel, mirrored by HopperBwdParams in
// runtime/params.py (each unit static_asserts every field's size and offset against it). The
// preprocess and postprocess around it take BwdParams (params.hpp).
#pragma once

#include <cuda/std/cstdint>

#include <flashkiln/hopper/fwd_params.hpp>

namespace flashkiln {

struct HopperBwdParams {
  // 4-d maps (column, row, head, batch): Q and dO in boxes of a query tile's rows, K and V of a
  // key tile's (TMA zero-fills rows past a dense sequence's end; a packed one's the kernel zeroes).
  TmaDescriptor tma_q, tma_k, tma_v, tma_do;
  // The additive bias's map (runtime/tma.py, encode_bias: boxes of a query tile's rows, or of one
  // row where the bias is broadcast over them, by 64 keys), with a bias variant.
  TmaDescriptor tma_bias;
  // The map of ds_workspace's planes (a full bias's dBias) as the bias's, for the producer's
  // stores of dS tiles, with ds_workspace.
  TmaDescriptor tma_dbias;
  uint64_t lse;    // float (batch, heads_q, total_q): the forward's, natural log
  uint64_t delta;  // float, as lse: rowsum(dO * O) - dLSE, from the preprocess
  uint64_t dlse;   // float, as lse: the LSE's upstream gradient, or 0
  // float (batch, heads_q, dq_accum_rows, d): dQ / scale in query tiles of (hopper/bwd_dq_tiles.hpp)
  // order from each sequence's first row (common/sequence.hpp), zeroed by the preprocess; the
  // postprocess reads it back.
  uint64_t dq_accum;
  uint64_t dk, dv;              // (batch, heads_kv, seqlen_k, d) by strides, when heads_q == heads_kv
  // GQA: float (batch, heads, total_k, d), or 0: sums per KV head that every query head of its
  // group adds into (zeroed; dkv_sums set), or per query head (a deterministic call)
  uint64_t dk_accum, dv_accum;
  uint64_t sink;                // float (heads_q,): the forward's sink logits, when dsink_parts is set
  // float (batch, heads_q, key tiles): per CTA, the sum over its keys and rows of p_sink * P * dP
  // (dSink, as BwdParams::dsink_parts), or 0
  uint64_t dsink_parts;
  // int (batch, heads_q, query tiles of seqlen_q, consumer warpgroups), zeroed: with it (a
  // deterministic call) the key tiles add each part of a query tile's dQ in a fixed order; or 0
  uint64_t dq_semaphore;
  uint64_t cu_seqlens_q, cu_seqlens_k;  // int (batch + 1,): a packed batch's sequence bounds, or 0
  // dBias of a bias that varies along the keys (runtime/bias.py), one of these three or none:
  // dS of every tile in the portable workspace route's layout (portable/bwd_tiles.hpp), the tiles
  // no query tile visits as zeros (a full bias: this is its dBias), stored through tma_dbias;
  uint64_t ds_workspace;
  // float (batch, heads_q, seqlen_k), zeroed: dS summed over the rows, tile by tile (a bias
  // broadcast over the rows: dBias sums this over its other broadcast dims);
  uint64_t dbias_columns;
  // float (bias batch entries, bias heads, seqlen_q, seqlen_k in 8-element pieces), zeroed: dS
  // added into the bias's own rows by the (batch, head) pairs that share them (a bias broadcast
  // over batch entries or heads only); in a deterministic call in a fixed order, counted per
  // (bias slice, query tile, key tile) by dbias_semaphore, int, zeroed; else in any order (0).
  uint64_t dbias_sum;
  uint64_t dbias_semaphore;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;
  int64_t dq_accum_rows;  // per head: seqlen_q rounded up to kDqAccumRowAlign
  int32_t batch, heads_q, heads_kv;
  int32_t seqlen_q, seqlen_k;  // packed: the longest sequences' (they size the grid)
  int32_t total_q, total_k;    // token rows of the tensors (common/sequence.hpp); dense: seqlen_q, seqlen_k
  float scale;       // applied to Q K^T
  float scale_log2;  // scale * log2(e)
  // The bias map's coordinate steps per query row, head and batch entry: 0 along its broadcast dims.
  int32_t bias_row_step, bias_head_step, bias_batch_step;
  int32_t window_left, window_right, top_left;  // as in HopperFwdParams
  float softcap_scale;                          // as in HopperFwdParams
  int32_t keys_complete;                        // as in BwdParams
  // Deterministic: a key tile may start its sweep of the query tiles at its own index
  // (hopper/bwd_schedule.hpp, QuerySweep), since each sequence's key tiles all run at once.
  int32_t staggered_sweep;
  int32_t dkv_sums;  // dk_accum and dv_accum hold sums per KV head
  int32_t _pad[13];  // sizeof is a multiple of 64 (the maps' alignment): spelled out for the mirror
};

}  // namespace flashkiln
