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
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  int32_t batch, heads_q, heads_kv, seqlen_q, seqlen_k;
  float scale;       // applied to Q K^T
  float scale_log2;  // scale * log2(e): the softmax runs in base 2
  int32_t _pad0;
};

}  // namespace flashkiln
