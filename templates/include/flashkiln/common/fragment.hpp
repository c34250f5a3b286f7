// Accumulator fragments of both families' MMAs (mma.sync m16n8, wgmma m64nN): reductions across
// the quad that holds a row, and conversions to the operand element type.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flashkiln {

// The four threads of a quad (lanes 4g..4g+3) hold the columns of the same accumulator rows.
template <class Op>
__device__ __forceinline__ float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  return x;
}

// Element-wise conversion of a register fragment (fp32 accumulators to fp16/bf16) into a new
// owning fragment of the same layout, using the paired cvt instructions.
template <class To, class Tensor>
__device__ __forceinline__ auto convert_fragment(Tensor const& src) {
  using From = typename cute::remove_cvref_t<Tensor>::value_type;
  constexpr int N = decltype(cute::size(src))::value;
  auto dst = cute::make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
  return dst;
}

}  // namespace flashkiln
