"""common/visibility.hpp on the device against its Python mirror, flashkiln.visibility: a probe kernel
that includes that header alone, compiled with NVRTC, evaluates every rule over a grid of cases
(each causal mode with and without a window, the sequence lengths and windows of
test_visibility.py, the kernels' tiles, row shifts, and random arguments) and every result must equal the mirror's. The probe's source and its
compile for sm_90a are checked on the CPU too."""
from __future__ import annotations

import ctypes
import itertools
import random

import numpy as np
import pytest

from flashkiln.generator.toolchain import INCLUDE_DIR
from flashkiln.launch import ceil_div
from flashkiln.visibility import (CAUSAL_MODES, first_hidden_column, first_visible_column, needs_mask, visibility,
                                  visible_key_tiles, visiting_query_tiles)
from test_visibility import SHAPES, TILES, WINDOWS

HEADER = "flashkiln/common/visibility.hpp"
INPUTS = ("causal", "tile", "seqlen_q", "seqlen_k", "row", "col0", "row_begin", "row_end", "n_block", "n_tiles",
          "m_tiles", "windowed", "window_left", "window_right")
OUTPUTS = ("offset", "span", "first_hidden_column", "first_visible_column", "needs_mask", "keys_first", "keys_end",
           "queries_first", "queries_end")


def probe_source(tiles: tuple[tuple[int, int], ...] = TILES) -> str:
    """A kernel evaluating the header's rules for one case per thread: INPUTS in, OUTPUTS out. The
    causal mode, whether a window applies, and the tile (an index into `tiles`) pick the template
    instantiation."""
    tile_cases = "\n".join(f"    case {i}: evaluate<kCausal, kWindow, {m}, {n}>(in, out); break;"
                           for i, (m, n) in enumerate(tiles))
    # The kernels compile a causal mask or none; its alignment is the call's (in[0] == 1: top_left).
    mode_cases = "\n".join(f"    case {2 * i + w}: by_tile<flashkiln::Causal::{'none' if mode == 'none' else 'masked'}, "
                           f"{'true' if w else 'false'}>(in[1], in, out); break;"
                           for i, mode in enumerate(CAUSAL_MODES) for w in (0, 1))
    top_left = CAUSAL_MODES.index("top_left")
    return f"""#include <{HEADER}>

struct ProbeParams {{
  unsigned long long cases, results;  // int[count][{len(INPUTS)}], int[count][{len(OUTPUTS)}]
  int count;
}};

template <flashkiln::Causal kCausal, bool kWindow, int kBlockM, int kBlockN>
__device__ void evaluate(int const* in, int* out) {{
  const auto v = flashkiln::visibility<kCausal, kWindow>(in[2], in[3], flashkiln::Reach{{in[12], in[13], in[0] == {top_left}}});
  const flashkiln::TileRange keys = flashkiln::visible_key_tiles<kBlockN>(v, in[6], in[7], in[9]);
  const flashkiln::TileRange queries = flashkiln::visiting_query_tiles<kBlockM, kBlockN>(v, in[8], in[10]);
  out[0] = v.offset;
  out[1] = v.span;
  out[2] = flashkiln::first_hidden_column(v, in[4], in[5]);
  out[3] = flashkiln::first_visible_column(v, in[4], in[5]);
  out[4] = flashkiln::needs_mask<kBlockM, kBlockN>(v, in[4], in[5]);
  out[5] = keys.first;
  out[6] = keys.end;
  out[7] = queries.first;
  out[8] = queries.end;
}}

template <flashkiln::Causal kCausal, bool kWindow>
__device__ void by_tile(int tile, int const* in, int* out) {{
  switch (tile) {{
{tile_cases}
  }}
}}

extern "C" __global__ void visibility_probe(ProbeParams p) {{
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.count) {{
    return;
  }}
  int const* in = reinterpret_cast<int const*>(p.cases) + i * {len(INPUTS)};
  int* out = reinterpret_cast<int*>(p.results) + i * {len(OUTPUTS)};
  switch (2 * in[0] + in[11]) {{
{mode_cases}
  }}
}}
"""


class ProbeParams(ctypes.Structure):
    _fields_ = [("cases", ctypes.c_uint64), ("results", ctypes.c_uint64), ("count", ctypes.c_int32)]


def nvrtc_unavailable_reason() -> str | None:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return "cuda-bindings is not installed (cuda.bindings.nvrtc)"
    try:
        err, *_ = nvrtc.nvrtcVersion()
    except Exception as e:  # the NVRTC library itself is missing (nvidia-cuda-nvrtc)
        return f"NVRTC cannot be loaded: {e}"
    return None if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else f"nvrtcVersion failed: {err}"


def compile_probe(arch: str) -> bytes:
    from flashkiln.generator.nvrtc import compile_cubin

    reason = nvrtc_unavailable_reason()
    if reason:
        pytest.skip(reason)
    # Only flashkiln's own include dir: the header must need nothing else (no CuTe, no CCCL).
    return compile_cubin(probe_source(), "visibility_probe", [f"-arch={arch}", "-std=c++17", f"-I{INCLUDE_DIR}"]).cubin


def expected(case: tuple[int, ...]) -> tuple[int, ...]:
    causal, tile, sq, sk, row, col0, row_begin, row_end, n_block, n_tiles, m_tiles, windowed, left, right = case
    tile_m, tile_n = TILES[tile]
    v = visibility(CAUSAL_MODES[causal], sq, sk, (left, right) if windowed else None)
    keys = visible_key_tiles(v, row_begin, row_end, tile_n, n_tiles)
    queries = visiting_query_tiles(v, n_block, tile_m, tile_n, m_tiles)
    return (v.offset, v.span, first_hidden_column(v, row, col0), first_visible_column(v, row, col0),
            int(needs_mask(v, row, col0, tile_m, tile_n)), *keys, *queries)


def cases() -> list[tuple[int, ...]]:
    """The kernels' own arguments over the test shapes (tile starts with and without the hopper's
    row shift, rows inside and at the ends of tiles), then random ones, negative ones among them."""
    out = []
    for (causal, _), window, (sq, sk), (tile, (tile_m, tile_n)) in itertools.product(
            enumerate(CAUSAL_MODES), WINDOWS, SHAPES, enumerate(TILES)):
        windowed = (int(window is not None), *(window or (-1, -1)))
        n_tiles, m_tiles = ceil_div(sk, tile_n), ceil_div(sq, tile_m)
        for shift, m, n in itertools.product(range(0, tile_m, 64), range(m_tiles), range(n_tiles + 1)):
            row0 = m * tile_m - shift
            for row, row_end in ((row0, row0 + tile_m), (row0 + 1, min(sq, row0 + tile_m)),
                                 (row0 + tile_m - 1, min(sq, row0 + 64))):
                out.append((causal, tile, sq, sk, row, n * tile_n, row0, row_end, n, n_tiles, m_tiles, *windowed))
    rng = random.Random(21)
    for _ in range(40000):
        sq, sk = rng.randrange(0, 3000), rng.randrange(0, 3000)
        out.append((rng.randrange(len(CAUSAL_MODES)), rng.randrange(len(TILES)), sq, sk,
                    *(rng.randrange(-3000, 3000) for _ in range(5)), rng.randrange(0, 50), rng.randrange(0, 50),
                    rng.randrange(2), rng.randrange(-1, 3000), rng.randrange(-1, 3000)))
    return out


@pytest.mark.nvrtc
def test_probe_includes_the_header_alone_and_compiles_for_sm90a():
    source = probe_source()
    assert [line for line in source.splitlines() if line.startswith("#include")] == [f"#include <{HEADER}>"]
    assert compile_probe("sm_90a")


@pytest.mark.gpu
def test_device_rules_match_the_python_mirror():
    import torch

    from flashkiln.driver import CudaDriver

    device = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(device)
    image = compile_probe(f"sm_{major}{minor}")
    driver = CudaDriver()
    driver.bind_context(device)
    kernel = driver.get_kernel(driver.load_library(image), "visibility_probe")

    grid = cases()
    inputs = torch.tensor(grid, dtype=torch.int32, device="cuda")
    results = torch.full((len(grid), len(OUTPUTS)), -12345, dtype=torch.int32, device="cuda")
    params = ProbeParams(inputs.data_ptr(), results.data_ptr(), len(grid))
    threads = 256
    driver.launch(kernel, (ceil_div(len(grid), threads), 1, 1), (threads, 1, 1), 0,
                  torch.cuda.current_stream().cuda_stream, params)
    got = results.cpu().numpy()
    want = np.array([expected(c) for c in grid], dtype=np.int32)
    wrong = np.flatnonzero((got != want).any(axis=1))
    details = [f"{dict(zip(INPUTS, grid[i]))}: device {dict(zip(OUTPUTS, got[i]))}, python "
               f"{dict(zip(OUTPUTS, want[i]))}" for i in wrong[:5]]
    assert wrong.size == 0, f"{wrong.size} of {len(grid)} cases differ, e.g.\n" + "\n".join(details)
