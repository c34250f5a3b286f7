"""Shared test setup: GPU tests skip with a stated reason where there is no GPU or no kernels.

`make gpu-test` sets FLASHKILN_REQUIRE_GPU=1, which turns those skips into failures, so a GPU
run can never pass by skipping everything.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/reference.py and friends


def _gpu_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    from flashkiln.manifest import MANIFEST_NAME
    from flashkiln.registry import default_kernel_dir

    if not (default_kernel_dir() / MANIFEST_NAME).is_file():
        return f"no generated kernels in {default_kernel_dir()}: run `make generate`"
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
