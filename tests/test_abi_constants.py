"""Constants the runtime mirrors from the headers (generator/abi_constants.py) are static_asserted in
every unit that includes them: a Python value that drifts from its header fails the compile."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flashkiln.archs import ARCHS
from flashkiln.generator import abi_constants
from flashkiln.generator.nvrtc import CompileError, compile_cubin
from flashkiln.generator.render import render
from flashkiln.generator.specs import load_variants
from flashkiln.generator.toolchain import toolchain

SPECS = Path(__file__).resolve().parents[1] / "specs"


def first_variant(family: str, kernel: str):
    return next(v.descriptor for v in load_variants(SPECS)
                if v.descriptor.family == family and v.descriptor.kernel == kernel and v.relative_speed == 1)


@pytest.mark.parametrize("family, kernel", [("portable", "fwd"), ("portable", "bwd"), ("portable", "bwd_dq"),
                                            ("portable", "bwd_pre"), ("portable", "bwd_post"), ("hopper", "fwd"),
                                            ("hopper", "bwd"), ("hopper", "bwd_post")])
def test_every_unit_checks_its_constants(family, kernel):
    d = first_variant(family, kernel)
    source = render(d)
    constants = abi_constants.abi_constants(d.family, d.kernel, d.arch)
    assert constants["unit"] and all(f"static_assert({c.cpp} == {c.value}," in source for c in constants["unit"])
    assert all(source.count(f"static_assert({c.cpp} == {c.value},") == 1 for c in constants["traits"])
    assert bool(constants["traits"]) == (family == "hopper" and kernel != "bwd_post")


@pytest.mark.nvrtc
def test_a_drifted_constant_fails_the_compile(monkeypatch):
    """Constants of a hopper unit set wrong in Python, of each kind (the dQ row alignment, a tile order,
    the TMA box, the shared-memory limit): NVRTC reports exactly those."""
    drifted = {"DQ_ACCUM_ROW_ALIGN": 64, "HEADS_INNER": 2, "BOX_COLS": 32,
               "ARCHS": {**ARCHS, "sm_90a": dataclasses.replace(ARCHS["sm_90a"], max_smem_per_block=228 * 1024)}}
    for name, value in drifted.items():
        monkeypatch.setattr(abi_constants, name, value)
    d = first_variant("hopper", "fwd")
    with pytest.raises(CompileError) as info:
        compile_cubin(render(d), d.name, toolchain().options(d.arch))
    constants = abi_constants.abi_constants(d.family, d.kernel, d.arch)
    failed = {c.cpp for c in constants["unit"] + constants["traits"]
              if f"{c.cpp} differs from {c.python} = {c.value}" in info.value.log}
    assert failed == {"flashkiln::kDqAccumRowAlign", "int(flashkiln::hopper::kHeadsInner)", "Traits::kBoxCols",
                      "Traits::kMaxSmemBytes"}
