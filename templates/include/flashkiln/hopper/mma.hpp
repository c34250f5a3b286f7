// Warpgroup MMA helpers: one wgmma GEMM over all k-blocks, and views of the m64nN accumulator.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

namespace flashkiln::hopper {

using namespace cute;

// Marks every register of `acc` as written here, with no instruction, so that its old values are
// dead from their last read on. For an accumulator that a zero-initialized GEMM overwrites next:
// that GEMM's operand fence ("+f") reads them, which keeps them live until then, across the loop.
template <class Tensor>
__device__ __forceinline__ void discard_operand(Tensor& acc) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    asm volatile("" : "=f"(acc(i))::"memory");
  }
}

// acc (+)= A B on the warpgroup's tensor cores, as one committed group. kZeroInit overwrites acc
// with the first k-block's product. The caller waits (warpgroup_wait) before reading acc.
template <bool kZeroInit, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void wgmma_gemm(TiledMma& mma, TensorA const& a, TensorB const& b, TensorC& acc) {
  // A is either register values (P) or shared-memory descriptors (Q): only values need fencing.
  constexpr bool kARegs = !is_same_v<typename TensorA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegs) {
    warpgroup_fence_operand(const_cast<TensorA&>(a));
  }
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
  if constexpr (kARegs) {
    warpgroup_fence_operand(const_cast<TensorA&>(a));
  }
}

// A wgmma accumulator fragment ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols): per n8 group a thread
// holds a column pair (mode 0,0) of two rows eight apart (mode 0,1).
template <class Layout>
__device__ __forceinline__ constexpr auto rowcol_view(Layout const& acc) {
  static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

template <class Tensor>
__device__ __forceinline__ auto rowcol(Tensor&& t) {
  return make_tensor(t.data(), rowcol_view(t.layout()));
}

// The same fragment as the register A operand of an m64nNk16 wgmma: ((2, 2, 2), MMA_M, N/16).
// Two neighbouring n8 groups hold exactly a thread's values of one k16 slice, in order.
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_operand_a(Layout const& acc) {
  static_assert(decltype(size<2>(Layout{}))::value == 1, "one MMA atom along N");
  auto split = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(acc), get<2, 1>(split));
}

}  // namespace flashkiln::hopper
