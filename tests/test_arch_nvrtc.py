"""NVRTC on the CPU for the archs without a GPU in reach: for each, the default specs' kernel with
the most shared memory (the biased deterministic backward at d 128) compiles, issues HMMA and no
HGMMA, and fits the arch's limits (generator/arch_checks.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from flashkiln.generator import build
from flashkiln.generator.arch_checks import check_directory

pytestmark = pytest.mark.nvrtc
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_120"])
def test_the_largest_backward_compiles_and_fits(arch, tmp_path, build_cache):
    selection = build.Selection(pattern=r"^bwd_portable_\w+_bf16_d128_causal-br_bias-additive_det_", archs=(arch,))
    manifest = build.generate(REPO / "specs", tmp_path, workers=2, selection=selection, cache_dir=build_cache,
                              progress=False)
    assert [e.arch for e in manifest.kernels] == [arch]
    assert check_directory(tmp_path) == {}
