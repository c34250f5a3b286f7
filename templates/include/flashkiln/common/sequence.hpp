// Where one batch entry's tokens lie, for dense and packed (variable-length) batches.
//
// Dense: q is (batch, heads, seqlen_q, d) by strides, and the per-row fp32 arrays (LSE, delta,
// GQA's dK/dV accumulators) are dense (batch, heads, seqlen). Packed: the token dim holds every
// sequence back to back, q (total_q, heads, d) seen as one batch entry of total_q rows; sequence b
// is tokens [cu_seqlens_q[b], cu_seqlens_q[b + 1]), and the per-row arrays are (heads, total).
// The runtime sets total_q = seqlen_q (total_k = seqlen_k) for dense batches, so one formula serves
// both. In packed batches seqlen_q and seqlen_k hold the longest lengths (they size the grid).
#pragma once

#include <cuda/std/cstdint>

#include <flashkiln/common/math.hpp>

namespace flashkiln {

// The dQ accumulator gives each sequence its rows rounded up to this (so whole query tiles add
// unguarded): dense (batch, heads, seqlen_q_rounded), packed (heads, total_q + batch * this) with
// sequence b from row cu_seqlens_q[b] + b * this. Mirrored as DQ_ACCUM_ROW_ALIGN in runtime/params.py.
inline constexpr int kDqAccumRowAlign = 128;

struct Sequence {
  int batch;
  bool packed;
  int64_t q_begin, k_begin;  // the sequence's first token in the token dim (0 when dense)
  int seqlen_q, seqlen_k;

  // Batch entry for batch strides and per-row arrays: packed sequences all live in entry 0.
  __device__ __forceinline__ int64_t layout_batch() const { return packed ? 0 : batch; }

  // Element offset of the sequence's first row, given a tensor's batch and row strides.
  __device__ __forceinline__ int64_t q_offset(int64_t batch_stride, int64_t row_stride) const {
    return layout_batch() * batch_stride + q_begin * row_stride;
  }
  __device__ __forceinline__ int64_t k_offset(int64_t batch_stride, int64_t row_stride) const {
    return layout_batch() * batch_stride + k_begin * row_stride;
  }

  // Index of the sequence's first query (key) row of `head` in a per-row array.
  template <class Params>
  __device__ __forceinline__ int64_t q_row(Params const& p, int head) const {
    return (layout_batch() * p.heads_q + head) * p.total_q + q_begin;
  }
  template <class Params>
  __device__ __forceinline__ int64_t k_row(Params const& p, int head) const {
    return (layout_batch() * p.heads_q + head) * p.total_k + k_begin;
  }

  // Index of the sequence's first row of `head` in the dQ accumulator, and its rows there.
  template <class Params>
  __device__ __forceinline__ int64_t dq_accum_row(Params const& p, int head) const {
    return (layout_batch() * p.heads_q + head) * p.dq_accum_rows +
           (packed ? q_begin + int64_t(batch) * kDqAccumRowAlign : 0);
  }
  __device__ __forceinline__ int dq_accum_rows() const {
    return ceil_div(seqlen_q, kDqAccumRowAlign) * kDqAccumRowAlign;
  }
};

// Sequence `batch` of the call. Packed offsets are clamped into [0, total] and lengths to the
// given maxima, so malformed cu_seqlens can make a wrong answer but never an access out of bounds.
template <class Params>
__device__ __forceinline__ Sequence sequence_of(Params const& p, int batch) {
  if (p.cu_seqlens_q == 0) {
    return Sequence{batch, false, 0, 0, p.seqlen_q, p.seqlen_k};
  }
  auto bounds = [batch](uint64_t cu_seqlens, int total, int max_len, int64_t& begin, int& len) {
    auto cu = reinterpret_cast<int const*>(cu_seqlens);
    const int64_t lo = min(max(int64_t(cu[batch]), int64_t(0)), int64_t(total));
    const int64_t hi = min(max(int64_t(cu[batch + 1]), lo), min(int64_t(total), lo + max_len));
    begin = lo;
    len = int(hi - lo);
  };
  Sequence s{batch, true, 0, 0, 0, 0};
  bounds(p.cu_seqlens_q, p.total_q, p.seqlen_q, s.q_begin, s.seqlen_q);
  bounds(p.cu_seqlens_k, p.total_k, p.seqlen_k, s.k_begin, s.seqlen_k);
  return s;
}

}  // namespace flashkiln
