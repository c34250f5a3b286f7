"""The hopper kernels' hand-written tile arithmetic (hopper/swizzled_tile.hpp with its row copy,
bwd_dq_tiles.hpp, transposed_tile.hpp's row pairs, runs of four keys and stores into a bias tile)
against CuTe's layouts of the same tiles, on the host: tests/host/tile_layouts.cpp, built with the
host C++ compiler and the generator's include dirs, checks every tile shape the kernels build.

A wrong swizzle or accumulator order there gives wrong gradients only on a GPU; this finds it
without one. The C++ is built with -fpermissive: CUTLASS's numeric conversions name device
intrinsics (__hfma2, __byte_perm) in templates that this host program never instantiates, which
g++ otherwise rejects; -w silences the warnings that this leaves.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from flashkiln.generator.toolchain import toolchain

SOURCE = Path(__file__).resolve().parent / "host" / "tile_layouts.cpp"


def test_the_kernels_tile_arithmetic_matches_cute_layouts(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no host C++ compiler (c++ or g++) on PATH")
    includes = toolchain().include_dirs
    assert any((d / "crt" / "host_defines.h").is_file() for d in includes), \
        "CUDA's crt headers are missing: pip install 'flashkiln[dev]' (nvidia-cuda-crt)"
    binary = tmp_path / "tile_layouts"
    build = subprocess.run([compiler, "-std=c++17", "-fpermissive", "-w", "-O1", *(f"-I{d}" for d in includes),
                            str(SOURCE), "-o", str(binary)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-6000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "FAIL" not in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("ok ") == run.stdout.count("\n") > 0, run.stdout
