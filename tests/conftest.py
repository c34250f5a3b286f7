"""Shared test setup: GPU tests skip with a stated reason where there is no GPU, no kernels, or
only the default set of them.

`make gpu-test` sets FLASHKILN_REQUIRE_GPU=1, which turns those skips into failures, so a GPU
run can never pass by skipping everything.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/reference.py and friends


@pytest.fixture(autouse=True)
def _exact_fp32_reference():
    """REF32 (shared/CONVENTIONS.md) must really be fp32: no TF32 in the reference's matmuls."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    yield


@pytest.fixture(autouse=True)
def _fresh_plan_caches():
    """Plans made under one test's monkeypatching must not serve the next test."""
    yield
    from flashkiln import backward, forward

    forward.PLANS.clear()
    backward.PLANS.clear()


@pytest.fixture
def deterministic_algorithms():
    """torch's deterministic mode for the test (flashkiln's backward takes it as its default), for
    tests that compare two calls bitwise: otherwise dQ, GQA's dK and dV, and a shared bias's dBias
    are added in any order."""
    import torch

    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def spy_planner(monkeypatch, family: str, direction: str = "forward") -> list:
    """Record what `family`'s `direction` planner returns from now on (plan caches emptied, so that
    every call plans)."""
    import dataclasses

    from flashkiln import backward, families, forward

    forward.PLANS.clear()
    backward.PLANS.clear()
    planned: list = []
    entry = families.FAMILIES[family]
    real = entry.planners[direction]
    spied = dataclasses.replace(entry, planners={**entry.planners, direction: lambda *a: planned.append(real(*a))
                                                 or planned[-1]})
    monkeypatch.setitem(families.FAMILIES, family, spied)
    return planned


@pytest.fixture
def force_tile_order(monkeypatch):
    """force(order) makes the hopper forward run work tiles in `order` ("heads" or "batch"
    innermost; flashkiln.hopper_family.tile_order) and returns (the order's value, the launches
    planned from then on)."""

    def force(order: str) -> tuple[int, list]:
        from flashkiln import hopper_family

        value = {"heads": hopper_family.HEADS_INNER, "batch": hopper_family.BATCH_INNER}[order]
        monkeypatch.setattr(hopper_family, "tile_order", lambda *args: value)
        planned = spy_planner(monkeypatch, "hopper")
        return value, planned

    return force


def _gpu_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    from flashkiln.manifest import MANIFEST_NAME
    from flashkiln.registry import default_kernel_dir

    manifest = default_kernel_dir() / MANIFEST_NAME
    if not manifest.is_file():
        return f"no generated kernels in {default_kernel_dir()}: run `make generate`"
    import json

    if json.loads(manifest.read_text())["build"].get("selection", {}).get("set") == "default":
        return (f"the kernels in {default_kernel_dir()} are the default set, and the GPU tests run both "
                "families on one call: build the full set (`make generate SET=full`)")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("FLASHKILN_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"GPU tests required (FLASHKILN_REQUIRE_GPU=1) but: {reason}")
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


# The smallest portable forward (one warp, 16 x 16 tiles, d = 32): what the CPU tests compile.
TINY_TUNING = {"tile_m": 16, "tile_n": 16, "warps": 1, "stages": 1}


def write_tiny_specs(root: Path) -> Path:
    import yaml

    (root / "tuning").mkdir(parents=True, exist_ok=True)
    (root / "tiny.yaml").write_text(yaml.safe_dump({
        "family": "portable", "tuning": "tuning/portable.yaml",
        "variants": [{"kernel": ["fwd"], "arch": ["sm_80", "sm_90a"], "dtype": ["bf16"], "head_dims": [32],
                      "causal": ["none", "bottom_right"]}],
    }))
    (root / "tuning" / "portable.yaml").write_text(yaml.safe_dump(
        {"fwd": {"sm_80": {32: TINY_TUNING}, "sm_90a": {32: TINY_TUNING}}}))
    return root


@pytest.fixture(scope="session")
def tiny_specs(tmp_path_factory) -> Path:
    return write_tiny_specs(tmp_path_factory.mktemp("tiny-specs"))


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory) -> Path:
    """One NVRTC cache for the whole session: each tiny unit compiles once."""
    return tmp_path_factory.mktemp("nvrtc-cache")
