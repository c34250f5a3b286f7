"""Which cubin and tuning a device gets, with faked compute capabilities and shared-memory limits.

The default specs' variants, each with the shared memory its family computes for it, make a
manifest for a fake driver: every arch the specs build is then checked for picking its own cubins
(sm_86's also on 8.9), tiles that fit the device, and the family table choosing hopper on 9.0.
"""
from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from flashkiln import descriptor, families
from flashkiln.archs import ARCHS
from flashkiln.errors import ArchMismatchError
from flashkiln.generator.families import FAMILIES as GENERATOR_FAMILIES
from flashkiln.generator.specs import load_variants
from flashkiln.launch import Target
from test_registry import FakeDriver, kernel_entry, write_manifest
from flashkiln.registry import KernelRegistry

REPO = Path(__file__).resolve().parent.parent
# (compute capability, the device's opt-in shared memory per block, the arch whose cubins it runs)
DEVICES = [((8, 0), 166912, "sm_80"), ((8, 6), 101376, "sm_86"), ((8, 9), 101376, "sm_86"),
           ((12, 0), 101376, "sm_120"), ((9, 0), 232448, "sm_90a")]
PORTABLE_KERNELS = ("fwd", "bwd", "bwd_pre", "bwd_post", "bwd_dq")


def _entries(variants) -> list:
    entries = []
    for v in variants:
        d = v.descriptor
        family = GENERATOR_FAMILIES[d.family]
        entries.append(kernel_entry(d, smem_bytes=family.smem_bytes(d), threads=family.threads(d), spec=v.spec_file,
                                    relative_speed=v.relative_speed))
    return entries


@pytest.fixture(scope="module")
def spec_variants():
    return load_variants(REPO / "specs")


@pytest.fixture
def registry(tmp_path, spec_variants):
    write_manifest(tmp_path / "kernels", _entries(spec_variants))
    return KernelRegistry(tmp_path / "kernels", FakeDriver())


def _portable_requests(spec_variants):
    """Every functional request of the portable family the specs build for sm_80."""
    keys = {}
    for v in spec_variants:
        d = v.descriptor.as_dict()
        if d["family"] == "portable" and d["arch"] == "sm_80":
            request = {k: d[k] for k in descriptor.FUNCTIONAL_FIELDS if k != "arch"}
            keys[tuple(sorted(request.items()))] = request
    return list(keys.values())


@pytest.mark.parametrize("capability, smem_limit, arch", DEVICES, ids=[f"cc{c[0]}{c[1]}" for c, _, _ in DEVICES])
def test_each_device_gets_its_arch_cubin_and_a_tuning_that_fits(registry, spec_variants, capability, smem_limit,
                                                                arch):
    requests = _portable_requests(spec_variants)
    assert {r["kernel"] for r in requests} == set(PORTABLE_KERNELS)
    assert {(r["d_qk"], r["d_v"]) for r in requests} == {(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)}
    by_key = {v.descriptor.functional_key: v.descriptor for v in spec_variants}
    for request in requests:
        entry = registry.find(request, capability, smem_limit)
        assert entry.arch == arch, request
        assert entry.smem_bytes <= smem_limit <= ARCHS[arch].max_smem_per_block, entry.name
        # The tuning is the arch's own row of the tuning table (the spec's variant for that arch).
        assert entry.variant == by_key[entry.variant.functional_key], entry.name


def test_an_ampere_build_on_a_99k_part_takes_only_the_tiles_that_fit(tmp_path, spec_variants):
    """sm_80 cubins run on 8.6, but their larger tiles do not fit its 99 KB: those calls raise
    ArchMismatchError naming the arch to build and the YAML, the others run the sm_80 cubin."""
    write_manifest(tmp_path / "k", _entries([v for v in spec_variants if v.descriptor.arch == "sm_80"]))
    registry = KernelRegistry(tmp_path / "k", FakeDriver())
    small = descriptor.request(kernel="fwd", family="portable", dtype="bf16", d_qk=64, d_v=64)
    assert registry.find(small, (8, 6), 101376).arch == "sm_80"
    large = descriptor.request(kernel="bwd", family="portable", dtype="bf16", d_qk=128, d_v=128)
    with pytest.raises(ArchMismatchError, match=r"allows 101376.*add sm_86 to `arch:`.*specs/portable.yaml"):
        registry.find(large, (8, 6), 101376)
    assert registry.find(large, (8, 0), 166912).arch == "sm_80"  # an A100 takes it


def test_a_device_without_its_arch_built_is_an_arch_mismatch(tmp_path, spec_variants):
    write_manifest(tmp_path / "k", _entries([v for v in spec_variants if v.descriptor.arch == "sm_90a"]))
    registry = KernelRegistry(tmp_path / "k", FakeDriver())
    request = descriptor.request(kernel="fwd", family="portable", dtype="bf16", d_qk=64, d_v=64)
    for capability in ((8, 0), (8, 6), (12, 0)):
        with pytest.raises(ArchMismatchError, match="built for sm_90a, none of which runs on it"):
            registry.find(request, capability, 101376)


def _target(capability: tuple[int, int], smem_limit: int) -> Target:
    return Target(0, capability, 80 << 30, 132, 50 << 20, smem_limit)


@pytest.mark.parametrize("capability, smem_limit, arch", DEVICES, ids=[f"cc{c[0]}{c[1]}" for c, _, _ in DEVICES])
def test_the_family_table_picks_hopper_on_9_0_only(registry, capability, smem_limit, arch):
    """Auto dispatch with faked capabilities: the planners are replaced by recorders of the entry
    they would plan with, so no tensor needs a GPU."""
    call = mock.Mock()
    call.request = lambda family: descriptor.request(kernel="fwd", family=family, dtype="bf16", d_qk=128, d_v=128)
    chosen = {}

    def recorder(name):
        def planner(call, target, registry, scratch):
            chosen[name] = registry.find(call.request(name), *target.limits)
            return []
        return planner

    table = {name: families.Family(f.name, f.runs_on, {"forward": recorder(name)})
             for name, f in families.FAMILIES.items()}
    with mock.patch.dict(families.FAMILIES, table):
        family, _, _ = families.plan("forward", call, None, _target(capability, smem_limit), registry, "cpu")
    assert family == ("hopper" if capability == (9, 0) else "portable")
    assert chosen[family].arch == arch
