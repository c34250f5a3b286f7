// The hopper kernels' hand-written shared-memory and accumulator arithmetic, checked on the host
// against CuTe's layouts of the same tiles (those wgmma and TMA use), for every tile shape the
// kernels build. Built and run by tests/test_tile_layouts.py with the host C++ compiler: the
// headers' __device__ helpers are plain arithmetic, compiled here as host functions (a warp's
// collectives emulated, `collective` below). Prints one line per shape and exits with the number
// of shapes that failed.
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

// A warp's collective operations (shuffles, ldmatrix), emulated by running each lane several times
// (run_warp): each call records what its lane sends (a value, or a row's address) and receives
// what the other lanes sent at the same call of the pass before. The last pass, once every value
// that went through fewer collectives than there are passes has settled, is the one that counts.
constexpr int kCollectivePasses = 4;
static int collective_pass;
static uint32_t collective_sent[2][32][256];
static int collective_calls[32];

// What the lanes sent at one call, in the pass before.
struct Sent {
  int call;
  uint32_t operator[](int lane) const { return collective_sent[(collective_pass + 1) % 2][lane][call]; }
};

// This lane's next call: records what it sends.
inline Sent collective(uint32_t sent) {
  const int lane = threadIdx.x % 32, call = collective_calls[lane]++;
  collective_sent[collective_pass % 2][lane][call] = sent;
  return {call};
}

inline uint32_t __shfl_xor_sync(unsigned, uint32_t value, int lane_mask) {
  return collective(value)[threadIdx.x % 32 ^ lane_mask];
}

// Shared addresses are byte offsets into `shared_window`.
#define FLASHKILN_HOST_SHARED_ACCESS
namespace flashkiln {
static char* shared_window;
inline uint32_t load_shared_u32_at(uint32_t address) { uint32_t v; memcpy(&v, shared_window + address, 4); return v; }
inline uint16_t load_shared_u16_at(uint32_t address) { uint16_t v; memcpy(&v, shared_window + address, 2); return v; }
inline uint4 load_shared_u128_at(uint32_t address) { uint4 v; memcpy(&v, shared_window + address, 16); return v; }

// ldmatrix.x4.trans as PTX defines it: lane l receives, of block b, entry l / 4 of the rows that
// lanes 8 b + 2 (l % 4) and 8 b + 2 (l % 4) + 1 gave the addresses of.
inline void load_blocks_transposed(uint32_t address, uint32_t (&out)[4]) {
  const Sent rows = collective(address);
  const int lane = threadIdx.x % 32;
  for (int b = 0; b < 4; ++b) {
    uint16_t low, high;
    memcpy(&low, shared_window + rows[8 * b + 2 * (lane % 4)] + 2 * (lane / 4), 2);
    memcpy(&high, shared_window + rows[8 * b + 2 * (lane % 4) + 1] + 2 * (lane / 4), 2);
    out[b] = low | uint32_t(high) << 16;
  }
}

// stmatrix.x4 as PTX defines it: the row whose address lane l gave (row j = l % 8 of block l / 8)
// receives the 4-byte pairs that lanes 4 j to 4 j + 3 gave for the block, in lane order. Not in the
// first pass (as below).
inline void store_blocks(uint32_t address, uint32_t const (&in)[4]) {
  const Sent row = collective(address);
  const Sent blocks[4] = {collective(in[0]), collective(in[1]), collective(in[2]), collective(in[3])};
  const int lane = threadIdx.x % 32, b = lane / 8, j = lane % 8;
  for (int m = 0; m < 4 && collective_pass > 0; ++m) {
    const uint32_t pair = blocks[b][4 * j + m];
    memcpy(shared_window + row[lane] + 4 * m, &pair, 4);
  }
}

// stmatrix.x4.trans as PTX defines it: the row whose address lane l gave (row l % 8 of block
// l / 8) receives entry i from half (l % 8) % 2 of what lane 4 i + (l % 8) / 2 gave for the block.
// Not in the first pass, which has no addresses yet (and would write to 0).
inline void store_blocks_transposed(uint32_t address, uint32_t const (&in)[4]) {
  const Sent row = collective(address);
  const Sent blocks[4] = {collective(in[0]), collective(in[1]), collective(in[2]), collective(in[3])};
  const int lane = threadIdx.x % 32, b = lane / 8, j = lane % 8;
  for (int i = 0; i < 8 && collective_pass > 0; ++i) {
    const uint16_t entry = uint16_t(blocks[b][4 * i + j / 2] >> (16 * (j % 2)));
    memcpy(shared_window + row[lane] + 2 * i, &entry, 2);
  }
}
}  // namespace flashkiln

// PTX prmt's default mode: byte i of the result is byte (selector >> 4 i) & 7 of b:a.
inline uint32_t __byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  const uint64_t bytes = uint64_t(b) << 32 | a;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    out |= uint32_t(bytes >> (8 * ((selector >> (4 * i)) & 7)) & 0xff) << (8 * i);
  }
  return out;
}

#include <flashkiln/hopper/bwd_dq_tiles.hpp>
#include <flashkiln/hopper/fwd_epilogue.hpp>
#include <flashkiln/hopper/head_boxes.hpp>
#include <flashkiln/hopper/swizzled_tile.hpp>
#include <flashkiln/hopper/transposed_tile.hpp>

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

// TMA's (and wgmma's) layout of a (kRows, kCols) tile of 2-byte entries in swizzled boxes of
// kBoxCols columns; a bias tile (where the backward reads a bias and stores a full bias's dS) has
// boxes of 64 keys.
template <int kRows, int kCols, int kBoxCols = 64>
using BoxTileLayout = decltype(tile_to_shape(BoxSmemAtom<Elem, kBoxCols>{}, Shape<Int<kRows>, Int<kCols>>{}));

// swizzled_offset, SwizzledPairs, zero_rows and copy_rows_out against the TMA/wgmma
// layout of a (kRows, kCols) tile of 2-byte entries in swizzled boxes of kBoxCols columns
// (head_boxes.hpp: 128-byte boxes of 64, or 64-byte ones of 32).
template <int kRows, int kCols, int kBoxCols>
void check_swizzled_tile() {
  alignas(1024) static Elem buffer[kRows * kCols];
  auto tile = make_tensor(make_smem_ptr(buffer), BoxTileLayout<kRows, kCols, kBoxCols>{});
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

// Runs body(thread, last) for the 32 threads of warp `warp` of a warpgroup, kCollectivePasses times
// (see collective); `last` on the pass whose results count.
template <class Body>
void run_warp(int warp, Body&& body) {
  memset(collective_sent, 0, sizeof(collective_sent));
  for (collective_pass = 0; collective_pass < kCollectivePasses; ++collective_pass) {
    memset(collective_calls, 0, sizeof(collective_calls));
    for (int lane = 0; lane < 32; ++lane) {
      threadIdx.x = 32 * warp + lane;
      body(int(threadIdx.x), collective_pass == kCollectivePasses - 1);
    }
  }
}

// store_fragment: the m64 fragments of a (kRows, kCols) tile in swizzled boxes of kBoxCols columns,
// each warpgroup's of 64 rows by kFragCols columns (all, or a warpgroup's share where two split
// them), each entry holding its own (row, column), must land where TMA's (and wgmma's) layout keeps
// them.
template <int kRows, int kCols, int kBoxCols, int kFragCols>
void check_fragment_store() {
  auto entry = [](int r, int c) { return uint16_t(r * 300 + c); };
  alignas(1024) static uint16_t buffer[kRows * kCols];
  memset(buffer, 0xff, sizeof(buffer));
  flashkiln::shared_window = reinterpret_cast<char*>(buffer);
  for (int rows = 0; rows < kRows; rows += 64) {
    for (int cols = 0; cols < kCols; cols += kFragCols) {
      for (int warp = 0; warp < 4; ++warp) {
        run_warp(warp, [&](int t, bool) {
          const FragmentCoords coords{rows + 16 * warp + t % 32 / 4, cols + 2 * (t % 4)};
          Tensor frag = make_tensor<uint16_t>(Int<kFragCols / 2>{});
          for (int i = 0; i < size(frag); ++i) {
            frag(i) = entry(get<0>(coords(i)), get<1>(coords(i)));
          }
          store_fragment<kRows, kBoxCols>(frag, coords, 0);
        });
      }
    }
  }
  auto tile = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(buffer)), BoxTileLayout<kRows, kCols, kBoxCols>{});
  bool ok = true;
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) {
      uint16_t bits;
      memcpy(&bits, raw_pointer_cast(&tile(r, c)), 2);
      ok &= bits == entry(r, c);
    }
  }
  report(ok, "fragment store", kRows, kCols);
}

// The rows of a consumer warpgroup's fragment of a (kRows, kKeys) tile of S^T: all, where the two
// split the keys (64 each, kKeys 128), or half, where they split the rows (kKeys 64: split columns).
template <int kRows, int kKeys>
constexpr int kFragmentRows = kKeys == 64 ? kRows / 2 : kRows;

// Runs body(coords, last) for every thread of the two consumer warpgroups, over their m64 (keys,
// rows) fragments of S^T as the backward's GEMM partitions a (kRows, kKeys) tile; coords(i) is
// entry i's (key, row). `last` as run_warp's.
template <int kRows, int kKeys, class Body>
void for_consumer_fragments(Body&& body) {
  constexpr bool kSplitRows = kKeys == 64;
  constexpr int kFragRows = kFragmentRows<kRows, kKeys>;
  using Atom = decltype(GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<kFragRows>, _64>, GMMA::Major::K,
                                             GMMA::Major::K>());
  auto mma = make_tiled_mma(Atom{});
  for (int warpgroup = 0; warpgroup < 2; ++warpgroup) {
    const auto first = kSplitRows ? make_coord(0, kFragRows * warpgroup) : make_coord(64 * warpgroup, 0);
    for (int warp = 0; warp < 4; ++warp) {
      run_warp(warp, [&](int t, bool last) {
        Tensor entries = domain_offset(first, make_identity_tensor(Shape<_64, Int<kFragRows>>{}));
        body(mma.get_thread_slice(t).partition_C(entries), last);
      });
    }
  }
}

// for_quads_of_transposed and store_rows_of_transposed over the consumers' fragments of 2-byte
// entries (dS^T in the element type), each entry holding its own (row, key): every run of four keys
// (4-aligned) must come out once, with the coordinates it is emitted with, and every entry land
// where TMA's (and wgmma's K-major) layout of a bias tile keeps it (a full bias's dS is stored
// there).
template <int kRows, int kKeys>
void check_transposed_rows() {
  auto entry = [](int row, int key) { return uint32_t(row * 256 + key); };
  bool ok = true;
  static int seen_quads[kRows][kKeys];
  memset(seen_quads, 0, sizeof(seen_quads));
  alignas(1024) static uint16_t buffer[kRows * kKeys];
  memset(buffer, 0xff, sizeof(buffer));
  flashkiln::shared_window = reinterpret_cast<char*>(buffer);
  for_consumer_fragments<kRows, kKeys>([&](auto const& coords, bool last) {
    Tensor frag = make_tensor<uint16_t>(size(coords));
    for (int i = 0; i < size(frag); ++i) {
      frag(i) = uint16_t(entry(get<1>(coords(i)), get<0>(coords(i))));
    }
    for_quads_of_transposed(frag, coords, [&](int row, int key, uint32_t low, uint32_t high) {
      if (last) {
        ok &= key % 4 == 0 && low == (entry(row, key) | entry(row, key + 1) << 16) &&
              high == (entry(row, key + 2) | entry(row, key + 3) << 16);
        ++seen_quads[row][key];
      }
    });
    // Every pass (its collectives must run in each); the last one's values overwrite the others'.
    store_rows_of_transposed<kRows, kFragmentRows<kRows, kKeys>>(frag, coords, 0);
  });
  auto tile = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(buffer)), BoxTileLayout<kRows, kKeys>{});
  for (int row = 0; row < kRows; ++row) {
    for (int key = 0; key < kKeys; ++key) {
      uint16_t bits;
      memcpy(&bits, raw_pointer_cast(&tile(row, key)), 2);
      ok &= seen_quads[row][key] == (key % 4 == 0) && bits == uint16_t(entry(row, key));
    }
  }
  report(ok, "transposed fragment rows", kRows, kKeys);
}

// bias_transposed_into: a (kRows, kKeys) bias tile in TMA's layout, added to the consumers'
// fragments of S^T, each entry must gain its own (row, key)'s bias; kRowBroadcast: row 0's (a bias
// broadcast over the rows fills only each box's first row), for every row.
template <int kRows, int kKeys, bool kRowBroadcast>
void check_bias_transposed() {
  auto bias = [](int row, int key) { return float((row * 7 + key * 3) % 251); };  // exact in bf16
  alignas(1024) static Elem buffer[kRows * kKeys];
  auto tile = make_tensor(make_smem_ptr(buffer), BoxTileLayout<kRows, kKeys>{});
  for (int row = 0; row < kRows; ++row) {
    for (int key = 0; key < kKeys; ++key) {
      tile(row, key) = Elem(kRowBroadcast && row > 0 ? -1.f : bias(row, key));  // one row: the rest unread
    }
  }
  flashkiln::shared_window = reinterpret_cast<char*>(buffer);
  bool ok = true;
  for_consumer_fragments<kRows, kKeys>([&](auto const& coords, bool last) {
    Tensor acc = make_tensor<float>(size(coords));
    for (int i = 0; i < size(acc); ++i) {
      acc(i) = 0.5f;
    }
    bias_transposed_into<kRows, kFragmentRows<kRows, kKeys>, kRowBroadcast, Elem>(acc, coords, 0, 1.f);
    for (int i = 0; last && i < size(acc); ++i) {
      ok &= acc(i) == 0.5f + bias(kRowBroadcast ? 0 : get<1>(coords(i)), get<0>(coords(i)));
    }
  });
  report(ok, kRowBroadcast ? "bias tile into S^T (one row)" : "bias tile into S^T", kRows, kKeys);
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
  // store_fragment: dS^T and P^T (keys, rows) by keys and split (a warpgroup's 32 rows), dK and dV
  // (keys, d) of 128-byte and 64-byte boxes, whole and split, O (rows, d).
  check_fragment_store<128, 128, 64, 128>();
  check_fragment_store<64, 64, 64, 32>();
  check_fragment_store<128, 64, 64, 64>();
  check_fragment_store<128, 96, 32, 96>();
  check_fragment_store<64, 192, 32, 96>();
  check_fragment_store<64, 256, 64, 128>();
  check_dq_tile<64>();
  check_dq_tile<96>();
  check_dq_tile<128>();
  check_dq_tile<192>();
  check_dq_tile<256>();
  // The backward's (query rows, keys) tiles with a bias: 64 or 128 x 128 split by keys, 64 x 64 by
  // rows.
  check_transposed_rows<64, 128>();
  check_transposed_rows<128, 128>();
  check_transposed_rows<64, 64>();
  check_bias_transposed<64, 128, false>();
  check_bias_transposed<128, 128, false>();
  check_bias_transposed<64, 64, false>();
  check_bias_transposed<64, 128, true>();
  check_bias_transposed<128, 128, true>();
  check_bias_transposed<64, 64, true>();
  return failures;
}
