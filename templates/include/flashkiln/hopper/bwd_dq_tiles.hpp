// How the Hopper backward lays out its fp32 dQ accumulator: per (batch entry, head) and query tile
// of kBlockM = 64 rows, kParts column parts of kCols = d / kParts columns, each part stored in the
// register order of an m64 wgmma accumulator fragment (pairs of columns, thread-major), so that a
// warpgroup stages its fragment in shared memory with conflict-free 8-byte stores and adds the
// whole part with one bulk reduce (cp.reduce.async.bulk). The postprocess reads it back through
// `pair_position`. Query tiles lie at 64-row steps of the head's rows (dq_accum_rows, rounded to
// kDqAccumRowAlign, is a multiple of 64).
#pragma once

#include <flashkiln/common/sequence.hpp>

namespace flashkiln::hopper {

inline constexpr int kDqTileRows = 64;
inline constexpr int kBwdConsumerWarpgroups = 2;  // of the main kernel (bwd_traits.hpp)
static_assert(kDqAccumRowAlign % kDqTileRows == 0, "a head's accumulator rows are whole query tiles");

// Parts per query tile for a head dim: one per consumer warpgroup of the main kernel where each
// gets whole 64-column boxes, else one (the warpgroups take turns, a whole query tile each).
__host__ __device__ constexpr int dq_tile_parts(int dim) {
  return dim / kBwdConsumerWarpgroups >= 64 ? kBwdConsumerWarpgroups : 1;
}

template <int kDim, int kParts>
struct DqTileLayout {
  static constexpr int kCols = kDim / kParts;
  static constexpr int kPartFloats = kDqTileRows * kCols;
  static constexpr int kTileFloats = kDqTileRows * kDim;

  // Where the pair of columns that starts at float `index` of a tile (even) belongs. In an m64nN
  // fp32 accumulator, thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 (+8) and
  // columns 8 j + 2 (t % 4) (+1) of n8 group j, as its values 4 j + 2 (row + 8) + (column + 1);
  // pair v / 2 of thread t lies at float2 index (v / 2) * 128 + t of its part.
  struct Position {
    int row, col;
  };
  __host__ __device__ static constexpr Position pair_position(int index) {
    const int part = index / kPartFloats;
    const int pair = index % kPartFloats / 256;
    const int t = index % 256 / 2;
    return {16 * (t / 32) + (t % 32) / 4 + 8 * (pair % 2), part * kCols + 8 * (pair / 2) + 2 * (t % 4)};
  }
};

}  // namespace flashkiln::hopper
