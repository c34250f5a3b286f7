// Kernel parameter blocks: plain structs passed by value as one __grid_constant__ argument.
// Mirrored in runtime/params.py; every generated translation unit static_asserts the size and
// field offsets that Python computes, so the two can never drift apart silently.
#pragma once

#include <cuda/std/cstdint>

namespace flashkiln {

struct FwdParams {
  // Device addresses, kept as integers so that the layout check can bit-cast a constexpr instance.
  uint64_t q;    // (batch, heads_q, seqlen_q, d_qk) by strides, head dim contiguous
  uint64_t k;    // (batch, heads_kv, seqlen_k, d_qk)
  uint64_t v;    // (batch, heads_kv, seqlen_k, d_v)
  uint64_t o;    // (batch, heads_q, seqlen_q, d_v)
  uint64_t lse;  // float (batch, heads_q, seqlen_q), dense; natural log
  uint64_t bias;  // additive score bias (batch, heads_q, seqlen_q, seqlen_k) by strides, or 0
  uint64_t sink;  // float (heads_q,): each head's sink logit, in every row's softmax denominator, or 0
  uint64_t cu_seqlens_q, cu_seqlens_k;  // int (batch + 1,) for packed batches (common/sequence.hpp), or 0
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  int64_t bias_batch_stride, bias_head_stride, bias_row_stride;  // 0 where the bias broadcasts
  int32_t batch, heads_q, heads_kv, seqlen_q, seqlen_k;  // packed: the longest seqlens
  int32_t total_q, total_k;  // tokens of q and k: seqlen_q and seqlen_k when dense
  float scale;       // applied to Q K^T
  float scale_log2;  // scale * log2(e): the softmax runs in base 2
  // The call's reach (common/visibility.hpp, Reach): a window variant's keys below and above each
  // row's aligned key (negative: unbounded), and whether row i aligns with key i (top-left).
  int32_t window_left, window_right, top_left;
  // A softcap variant's scale / cap (common/softcap.hpp; scale above is then the cap).
  float softcap_scale;
};

// One block for every backward kernel (preprocess, main, postprocess); each reads what it needs.
struct BwdParams {
  uint64_t q, k, v, o, dout;  // inputs, (batch, heads, seqlen, dim) by strides
  uint64_t lse;               // float (batch, heads_q, seqlen_q) or packed (heads_q, total_q), from the forward
  uint64_t delta;             // float, as lse: rowsum(dO * O)
  uint64_t dq_accum;          // float (.., dq_accum_rows, d_qk) dense (common/sequence.hpp); 0 when unused
  uint64_t dq, dk, dv;        // outputs by strides (dk/dv when heads_q == heads_kv)
  uint64_t dk_accum, dv_accum;  // float (batch, heads_q, seqlen_k, d) or (heads_q, total_k, d): per query head (GQA)
  uint64_t dq_semaphore;      // int (batch, heads_q, seqlen_q_rounded / tile_m), zeroed (ordered route)
  uint64_t ds_workspace;      // dS tiles of the deterministic workspace route (see bwd_tiles.hpp), or 0
  uint64_t bias;              // as in FwdParams
  uint64_t cu_seqlens_q, cu_seqlens_k;  // as in FwdParams
  uint64_t dlse;              // float, as lse: the LSE's upstream gradient (enters delta), or 0
  uint64_t sink;              // float (heads_q,): the forward's sink logits, or 0
  // float (batch * heads_q, gridDim.x of the main kernel): per key tile, the sum over its rows and
  // keys of p_sink * P * dP, in fp32 from unrounded P and dP (dSink without the rounded O); or 0
  uint64_t dsink_parts;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;
  int64_t bias_batch_stride, bias_head_stride, bias_row_stride;
  int64_t dq_accum_rows;      // rows of dq_accum per head (common/sequence.hpp)
  int32_t batch, heads_q, heads_kv, seqlen_q, seqlen_k;  // as in FwdParams
  int32_t total_q, total_k;
  int32_t seqlen_q_rounded;  // seqlen_q rounded up to kDqAccumRowAlign: the dQ semaphores' rows
  float scale;
  float scale_log2;
  int32_t window_left, window_right, top_left;  // as in FwdParams
  float softcap_scale;                          // as in FwdParams
  // 1: out and lse are this call's own, so where one key tile holds a sequence's every key the
  // kernel takes delta from the unrounded P and dP; 0: they come from more keys than k holds
  // (ring attention's blocks), and delta is the preprocess's rowsum(dO * O) - dLSE.
  int32_t keys_complete;
};

}  // namespace flashkiln
