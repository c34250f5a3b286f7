"""Kernels fit their arch without the hardware (generator/arch_checks.py): the rules on made-up
entries, the default specs' variants for every arch (shared memory, launch), and, where
`make generate` has built them, every kernel in generated/ from its cubin and the manifest.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from flashkiln.archs import ARCHS
from flashkiln.generator.arch_checks import SPILL_BOUND, check_directory, entry_problems
from flashkiln.generator.families import FAMILIES
from flashkiln.generator.specs import load_variants
from flashkiln.manifest import MANIFEST_NAME
from test_registry import descriptor, kernel_entry

REPO = Path(__file__).resolve().parent.parent
KERNEL_DIR = Path(os.environ.get("FLASHKILN_KERNEL_DIR", REPO / "generated"))


def _entry(arch="sm_86", **overrides):
    return kernel_entry(descriptor(arch=arch), **{"smem_bytes": 32768, "threads": 128, **overrides})


def test_a_portable_kernel_that_fits_has_no_problem():
    assert entry_problems(_entry(), {"HMMA": 64, "LDSM": 8}, {"REG": 168, "SHARED": 0}) == []


@pytest.mark.parametrize("opcodes, usage, overrides, message", [
    ({"FFMA": 10}, {}, {}, "issues no HMMA"),
    ({"HMMA": 1, "HGMMA": 4}, {}, {}, "issues 4 HGMMA"),
    ({"HMMA": 1}, {"SHARED": 2048}, {"smem_bytes": 100000}, "102048 bytes of shared memory"),
    ({"HMMA": 1}, {"REG": 255}, {"threads": 512}, "255 registers x 512 threads"),
    ({"HMMA": 1}, {}, {"threads": 2048}, "2048 threads per block"),
    ({"HMMA": 1}, {}, {"spill_bytes": SPILL_BOUND + 4}, "spills"),
])
def test_each_broken_limit_is_named(opcodes, usage, overrides, message):
    problems = entry_problems(_entry(**overrides), opcodes, usage)
    assert any(message in p for p in problems), problems


def test_the_default_specs_launch_within_every_arch():
    """Before anything compiles: dynamic shared memory and threads of every variant of every arch."""
    variants = load_variants(REPO / "specs")
    assert {v.descriptor.arch for v in variants} == {"sm_80", "sm_86", "sm_90a", "sm_120"}
    for v in variants:
        d, family = v.descriptor, FAMILIES[v.descriptor.family]
        assert family.smem_bytes(d) <= ARCHS[d.arch].max_smem_per_block, d.name
        assert family.threads(d) <= 1024, d.name


@pytest.mark.skipif(not (KERNEL_DIR / MANIFEST_NAME).exists(), reason=f"no kernels built in {KERNEL_DIR}")
def test_every_built_kernel_fits_its_arch():
    problems = check_directory(KERNEL_DIR)
    assert not problems, "\n".join(f"{name}: {'; '.join(p)}" for name, p in sorted(problems.items()))
