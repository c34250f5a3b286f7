// The hopper kernels' hand-written shared-memory and accumulator arithmetic, checked on the host
// against CuTe's layouts of the same tiles (those wgmma and TMA use), for every tile shape the
// kernels build. Built and run by tests/test_tile_layouts.py with the host C++ compiler: the
// headers' __device__ helpers are plain arithmetic, compiled here as host functions. Prints one
// line per shape and exits with the number of shapes that failed.
#define __device__
#define __forceinline__ inline
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <vector_types.h>

// The built-in variables that the included headers' kernel code names (none of it runs here).
static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

#include <flashkiln/hopper/bwd_dq_tiles.hpp>
#include <flashkiln/hopper/fwd_epilogue.hpp>
#include <flashkiln/hopper/head_boxes.hpp>
#include <flashkiln/hopper/swizzled_tile.hpp>

using namespace cute;
using namespace flashkiln::hopper;
using Elem = cutlass::bfloat16_t;

static int failures = 0;

static void report(bool ok, char const* what, int a, int b) {
  printf("%s %s %d x %d\n", ok ? "ok  " : "FAIL", what, a, b);
  failures += !ok;
}

// A thread's entries of an m64nN wgmma accumulator (row, column): entry i is pair i / 2 of n8
// group i / 4, rows r0 and r0 + 8.
struct FragmentCoords {
  int r0, c0;
  auto operator()(int i) const { return cute::make_tuple(r0 + 8 * (i / 2 % 2), c0 + i % 2 + 8 * (i / 4)); }
};

// swizzled_offset, SwizzledPairs, zero_rows and the forward's copy_rows_out against the TMA/wgmma
// layout of a (kRows, kCols) tile of 2-byte entries in swizzled boxes of kBoxCols columns
// (head_boxes.hpp: 128-byte boxes of 64, or 64-byte ones of 32).
template <int kRows, int kCols, int kBoxCols>
void check_swizzled_tile() {
  using Layout = decltype(tile_to_shape(BoxSmemAtom<Elem, kBoxCols>{}, Shape<Int<kRows>, Int<kCols>>{}));
  alignas(1024) static Elem buffer[kRows * kCols];
  auto tile = make_tensor(make_smem_ptr(buffer), Layout{});
  auto byte_of = [&](int r, int c) { return long((char*)raw_pointer_cast(&tile(r, c)) - (char*)buffer); };
  bool ok = true;
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) {
      ok &= byte_of(r, c) == long(swizzled_offset<kRows, kBoxCols>(r, c));
    }
  }
  for (int rows = 0; rows < kRows; rows += 64) {  // each warpgroup's m64 fragments of the tile
    for (int t = 0; t < 128; ++t) {
      const FragmentCoords coords{rows + 16 * (t / 32) + t % 32 / 4, 2 * (t % 4)};
      const SwizzledPairs<kRows, false, FragmentCoords, kBoxCols> pairs(coords);
      for (int i = 0; i < kCols / 2; i += 2) {
        ok &= long(pairs(i)) == byte_of(get<0>(coords(i)), get<1>(coords(i)));
      }
    }
  }
  for (int first = 0; first < kRows; first += 8) {
    memset(buffer, 0xff, sizeof(buffer));
    for (int t = 0; t < 128; ++t) {
      zero_rows<kRows, kCols, kBoxCols>(buffer, first, t);
    }
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < kCols; ++c) {
        uint16_t bits;
        memcpy(&bits, raw_pointer_cast(&tile(r, c)), 2);
        ok &= (bits == 0) == (r >= first);
      }
    }
  }
  // A packed forward's O: each warpgroup's 64 rows of a staged (kRows, kCols) tile, copied out by
  // rows through the swizzle (the warpgroup's first box starts at its first row).
  struct Traits {
    using Element = Elem;
    static constexpr int kVBoxCols = kBoxCols;
    static constexpr int kDimV = kCols;
  };
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) {
      const uint16_t value = uint16_t(r * kCols + c);
      memcpy(raw_pointer_cast(&tile(r, c)), &value, 2);
    }
  }
  static uint16_t out[64 * kCols];
  for (int rows = 0; rows < kRows; rows += 64) {
    memset(out, 0, sizeof(out));
    for (int t = 0; t < 128; ++t) {
      copy_rows_out<Traits>(buffer + rows * kBoxCols, kRows * kBoxCols, reinterpret_cast<Elem*>(out), kCols, 64, t);
    }
    for (int r = 0; r < 64; ++r) {
      for (int c = 0; c < kCols; ++c) {
        ok &= out[r * kCols + c] == uint16_t((rows + r) * kCols + c);
      }
    }
  }
  report(ok, "swizzled tile", kRows, kCols);
}

// DqTileLayout::pair_position against CuTe's m64nN accumulator layout: the float the main kernel
// stages for thread t's value v (pair v / 2 at float2 (v / 2) * 128 + t of its part) must be the
// entry bwd_post reads there.
template <int kDim>
void check_dq_tile() {
  constexpr int kParts = dq_tile_parts(kDim);
  using Tile = DqTileLayout<kDim, kParts>;
  using Atom = decltype(GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<Tile::kCols>, _64>,
                                             GMMA::Major::MN, GMMA::Major::MN>());
  auto mma = make_tiled_mma(Atom{});
  bool ok = true;
  for (int part = 0; part < kParts; ++part) {
    for (int t = 0; t < 128; ++t) {
      Tensor entries = mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, Int<Tile::kCols>>{}));
      for (int v = 0; v < size(entries); ++v) {
        const auto position = Tile::pair_position(part * Tile::kPartFloats + (v / 2) * 256 + 2 * t);
        ok &= position.row == get<0>(entries(v)) && position.col == part * Tile::kCols + get<1>(entries(v)) - v % 2;
      }
    }
  }
  report(ok, "dQ accumulator tile", 64, kDim);
}

int main() {
  // 128-byte boxes: head dims 64, 128 and 256, and the (keys, rows) tiles of P^T and dS.
  check_swizzled_tile<64, 64, 64>();
  check_swizzled_tile<64, 128, 64>();
  check_swizzled_tile<128, 64, 64>();
  check_swizzled_tile<128, 128, 64>();
  check_swizzled_tile<64, 256, 64>();
  // 64-byte boxes: d 96, and d_qk 192 whose columns two warpgroups split.
  check_swizzled_tile<64, 96, 32>();
  check_swizzled_tile<128, 96, 32>();
  check_swizzled_tile<64, 192, 32>();
  check_swizzled_tile<128, 192, 32>();
  check_dq_tile<64>();
  check_dq_tile<96>();
  check_dq_tile<128>();
  check_dq_tile<192>();
  check_dq_tile<256>();
  return failures;
}
