// Parameter block of the Hopper forward, mirrored by HopperFwdParams in runtime/params.py (the
// unit static_asserts every field's size and offset against it, as for FwdParams).
#pragma once

#include <cuda/std/cstdint>

namespace flashkiln {

// A CUtensorMap, encoded on the host by cuTensorMapEncodeTiled (runtime/tma.py). TMA reads it
// from the kernel's __grid_constant__ parameter, which needs 64-byte alignment.
struct alignas(64) TmaDescriptor {
  uint64_t words[16];
};

struct HopperFwdParams {
  // 4-d maps (column, row, head, batch) over Q, K, V (loads) and O (stores): they carry the
  // addresses, shapes and strides of the four tensors.
  TmaDescriptor tma_q, tma_k, tma_v, tma_o;
  // The additive bias as (key, query row, head, batch), when the variant has one: a dim the bias
  // broadcasts along has extent 1 and is addressed at coordinate 0 (its step below is 0); a bias
  // broadcast over query rows is read as one row per tile (the map's box is 1 row high).
  TmaDescriptor tma_bias;
  uint64_t lse;   // float (batch, heads_q, seqlen_q), or packed (heads_q, total_q), dense; natural log
  uint64_t sink;  // float (heads_q,), or 0
  // Packed batches (common/sequence.hpp): int (batch + 1,) sequence bounds, or 0 when dense. The maps
  // then cover the (1, heads, total, d) token tensors and tiles address rows from a sequence's
  // first token; O's rows that end a sequence go out through `o` (the epilogue), since a TMA
  // store clips only at the tensor's end and would overwrite the next sequence.
  uint64_t cu_seqlens_q, cu_seqlens_k;
  uint64_t o;                          // O's address, for those rows
  int64_t o_row_stride, o_head_stride;  // elements
  int32_t batch, heads_q, heads_kv, seqlen_q, seqlen_k;  // packed: the longest seqlens
  int32_t total_q, total_k;  // tokens of q and k: seqlen_q and seqlen_k when dense
  int32_t num_m_blocks;  // query tiles per head
  // Rows the grid of query tiles starts above row 0 (a multiple of 64; 0 without a causal mask):
  // the runtime's flashkiln.tile_choice.causal_row_shift, which its tile choice counts too.
  int32_t row_shift;
  float scale;           // applied to Q K^T
  float scale_log2;      // scale * log2(e)
  // An int in global memory, zero at launch, from which CTAs claim work tiles past their first
  // (the runtime passes one where tiles differ in length: under a causal mask, and in packed
  // batches); 0: a fixed round robin.
  uint64_t tile_counter;
  int32_t bias_row_step, bias_head_step, bias_batch_step;  // 1, or 0 where the bias broadcasts
  // The work tiles' innermost dim (tile_scheduler.hpp, TileOrder): heads or batches for a bias
  // broadcast along them that does not stay in L2 otherwise (the runtime decides:
  // hopper_forward.tile_order); query tiles otherwise.
  int32_t tile_order;
  // The call's reach (common/visibility.hpp, Reach): a window variant's keys below and above each
  // row's aligned key (negative: unbounded), and whether row i aligns with key i (top-left).
  int32_t window_left, window_right, top_left;
  // A softcap variant's scale / cap (common/softcap.hpp; scale above is then the cap).
  float softcap_scale;
  int32_t _pad[12];  // sizeof is a multiple of 64 (the maps' alignment): spelled out for the mirror
};

}  // namespace flashkiln
