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

// Shared addresses are byte offsets into `shared_window`.
#define FLASHKILN_HOST_SHARED_ACCESS
namespace flashkiln {
static char* shared_window;
inline uint32_t load_shared_u32_at(uint32_t address) { uint32_t v; memcpy(&v, shared_window + address, 4); return v; }
inline uint16_t load_shared_u16_at(uint32_t address) { uint16_t v; memcpy(&v, shared_window + address, 2); return v; }
inline uint4 load_shared_u128_at(uint32_t address) { uint4 v; memcpy(&v, shared_window + address, 16); return v; }
inline void store_shared_u32_at(uint32_t address, uint32_t value) { memcpy(shared_window + address, &value, 4); }
}  // namespace flashkiln

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

// swizzled_offset, SwizzledPairs, zero_rows and copy_rows_out against the TMA/wgmma
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
  // copy_rows_out: as the packed forward copies O (each warpgroup's 64 rows of the staged tile, its
  // first box at its first row, by its 128 threads), and as the backward copies dK and dV (the
  // tile's first rows, by 256 threads), into rows of a wider output.
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) {
      const uint16_t value = uint16_t(r * kCols + c);
      memcpy(raw_pointer_cast(&tile(r, c)), &value, 2);
    }
  }
  flashkiln::shared_window = reinterpret_cast<char*>(buffer);
  constexpr int kOutStride = kCols + 8;
  static uint16_t out[kRows * kOutStride];
  auto copied = [&](int first_row, int rows) {
    bool same = true;
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < kOutStride; ++c) {
        same &= out[r * kOutStride + c] == (r < rows && c < kCols ? uint16_t((first_row + r) * kCols + c) : 0xffff);
      }
    }
    return same;
  };
  for (int first = 0; first < kRows; first += 64) {
    for (int rows : {1, 7, 63, 64}) {
      memset(out, 0xff, sizeof(out));
      for (int t = 0; t < 128; ++t) {
        copy_rows_out<64, kCols, kBoxCols, 128>(first * kBoxCols * 2, kRows * kBoxCols * 2,
                                                reinterpret_cast<Elem*>(out), kOutStride, rows, t);
      }
      ok &= copied(first, rows);
    }
  }
  if constexpr (kRows * kCols / 8 % 256 == 0) {
    for (int rows : {1, 17, kRows - 1, kRows}) {
      memset(out, 0xff, sizeof(out));
      for (int t = 0; t < 256; ++t) {
        copy_rows_out<kRows, kCols, kBoxCols, 256>(0, kRows * kBoxCols * 2, reinterpret_cast<Elem*>(out), kOutStride,
                                                   rows, t);
      }
      ok &= copied(0, rows);
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
