// The backward's two small memory-bound kernels around the main one:
//   preprocess:  delta = rowsum(dO * O) - dLSE in fp32, and the dQ accumulator zeroed (if there is one);
//   postprocess: dQ = scale * dQ_accum, converted to the element type, written by dQ's strides.
// Rows are spread over groups of 8 lanes that move 16 bytes each (128 contiguous bytes a row).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <flashkiln/common/sequence.hpp>
#include <flashkiln/params.hpp>

namespace flashkiln::portable {

constexpr int kRowLanes = 8;

template <class Element_, int kDimQK_, int kDimV_, int kThreads_>
struct RowKernelTraits {
  using Element = Element_;
  static constexpr int kDimQK = kDimQK_;
  static constexpr int kDimV = kDimV_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kRowsPerCta = kThreads / kRowLanes;
  static constexpr int kVec = 16 / sizeof(Element);  // elements per 16-byte access
  static_assert(kDimQK % kVec == 0 && kDimV % kVec == 0 && kThreads % 32 == 0);
  static constexpr int kSmemBytes = 0;
};

// Sum of x over the 8 lanes of a row group.
__device__ __forceinline__ float row_group_sum(float x) {
  CUTE_UNROLL
  for (int offset = kRowLanes / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return x;
}

template <class T>
__device__ __forceinline__ void bwd_preprocess(BwdParams const& p) {
  using Element = typename T::Element;
  using Vec = cutlass::Array<Element, T::kVec>;
  const int lane = threadIdx.x % kRowLanes;
  const int row = blockIdx.x * T::kRowsPerCta + threadIdx.x / kRowLanes;
  const int head = blockIdx.y;
  const Sequence seq = sequence_of(p, blockIdx.z);

  if (row < seq.seqlen_q) {
    auto o_row = reinterpret_cast<Element const*>(p.o) + seq.q_offset(p.o_batch_stride, p.o_row_stride) +
                 head * p.o_head_stride + row * p.o_row_stride;
    auto do_row = reinterpret_cast<Element const*>(p.dout) + seq.q_offset(p.do_batch_stride, p.do_row_stride) +
                  head * p.do_head_stride + row * p.do_row_stride;
    float sum = 0.f;
    for (int col = lane * T::kVec; col < T::kDimV; col += kRowLanes * T::kVec) {
      const Vec o = *reinterpret_cast<Vec const*>(o_row + col);
      const Vec d = *reinterpret_cast<Vec const*>(do_row + col);
      CUTE_UNROLL
      for (int i = 0; i < T::kVec; ++i) {
        sum += float(o[i]) * float(d[i]);
      }
    }
    sum = row_group_sum(sum);
    if (lane == 0) {
      const int64_t index = seq.q_row(p, head) + row;
      // dLSE_i enters as dS_ij = P_ij (dP_ij - delta_i + dLSE_i), since dLSE_i / dS_ij = P_ij.
      const float dlse = p.dlse != 0 ? reinterpret_cast<float const*>(p.dlse)[index] : 0.f;
      reinterpret_cast<float*>(p.delta)[index] = sum - dlse;
    }
  }
  if (p.dq_accum != 0 && row < seq.dq_accum_rows()) {
    float4* acc = reinterpret_cast<float4*>(reinterpret_cast<float*>(p.dq_accum) +
                                            (seq.dq_accum_row(p, head) + row) * T::kDimQK);
    for (int i = lane; i < T::kDimQK / 4; i += kRowLanes) {
      acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

template <class T>
__device__ __forceinline__ void bwd_postprocess(BwdParams const& p) {
  using Element = typename T::Element;
  constexpr int kVec = T::kVec;
  const int lane = threadIdx.x % kRowLanes;
  const int row = blockIdx.x * T::kRowsPerCta + threadIdx.x / kRowLanes;
  const int head = blockIdx.y;
  const Sequence seq = sequence_of(p, blockIdx.z);
  if (row >= seq.seqlen_q) {
    return;
  }
  float const* acc = reinterpret_cast<float const*>(p.dq_accum) + (seq.dq_accum_row(p, head) + row) * T::kDimQK;
  auto dq_row = reinterpret_cast<Element*>(p.dq) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride) +
                head * p.dq_head_stride + row * p.dq_row_stride;
  cutlass::NumericArrayConverter<Element, float, kVec> convert;
  for (int col = lane * kVec; col < T::kDimQK; col += kRowLanes * kVec) {
    cutlass::Array<float, kVec> values = *reinterpret_cast<cutlass::Array<float, kVec> const*>(acc + col);
    CUTE_UNROLL
    for (int i = 0; i < kVec; ++i) {
      values[i] *= p.scale;
    }
    *reinterpret_cast<cutlass::Array<Element, kVec>*>(dq_row + col) = convert(values);
  }
}

}  // namespace flashkiln::portable
