"""flashkiln's own Python work per call, on a machine without a GPU: an A/B tool for host-time changes.

The calls run on CPU tensors against plans of the portable family made by the tests' helpers, with
a driver that launches nothing and a faked current device and stream, so what is timed is the
Python work (keys, plan lookups, allocations, parameter binding) and none of the driver's or the
GPU allocator's. Rows, µs per call (min and median of interleaved rounds of 1000 calls each):

- attention_forward / attention_backward hits (B = 1, H = 1, S = 128, d = 64);
- flashkiln.scaled_dot_product_attention on inputs that need no gradient (the forward alone);
- a training step through flashkiln.scaled_dot_product_attention (autograd, both directions);
- the same step through a bare autograd.Function that calls attention_forward and
  attention_backward (what the SDPA drop-in's own layers cost above it), and through an
  autograd.Function that only allocates (autograd's floor, bench/host_overhead.py's).

On the H200's host every row costs several times what it costs here (docs/perf.md): compare
revisions on one machine, never a row here with one measured there.

With --native the plans launch through flashkiln._launch, whose driver entry points are C
functions that do nothing (built here with `cc`): what is timed is then the native path's Python
and C work, against the Python loop's without it.

Usage: .venv/bin/python tools/host_python.py [--rounds 15] [--calls 1000] [--native]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT / "tests"), str(_ROOT / "bench")]
import flashkiln  # noqa: E402
from flashkiln import backward, dq_routes, forward  # noqa: E402
from flashkiln.params import params_layout  # noqa: E402
from flashkiln.registry import KernelRegistry  # noqa: E402
from host_overhead import _AllocateOnly, training_step  # noqa: E402  (bench/ is a folder of scripts)
from test_backward_api import bwd_descriptor  # noqa: E402  (tests/ holds the fake manifest's helpers)
from test_planned_calls import backward_plan, forward_plan, qkv  # noqa: E402
from test_registry import FakeDriver, descriptor, kernel_entry, write_manifest  # noqa: E402


class _SilentDriver(FakeDriver):
    """A FakeDriver that records nothing (a recording one grows for every launch); with entry
    points, kernels are integer handles and the plans launch through flashkiln._launch."""

    def __init__(self, entry_points: tuple[int, int] | None):
        super().__init__()
        self._entry_points = entry_points

    def get_kernel(self, library, symbol: str):
        return super().get_kernel(library, symbol) if self._entry_points is None else 0x1000

    def entry_points(self) -> tuple[int, int] | None:
        return self._entry_points

    def launch(self, *args) -> None:
        pass

    def replace_tensor_map_address(self, *args) -> None:
        pass


_NOOP_ENTRY_POINTS = """
int launch_kernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                  unsigned smem, void* stream, void** params, void** extra) { return 0; }
int replace_address(void* tensor_map, void* address) { return 0; }
"""


def _noop_entry_points(directory: Path) -> tuple[int, int]:
    """cuLaunchKernel and cuTensorMapReplaceAddress stand-ins that return CUDA_SUCCESS at once."""
    (directory / "noop.c").write_text(_NOOP_ENTRY_POINTS)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(directory / "noop.c"), "-o", str(directory / "noop.so")],
                   check=True)
    library = ctypes.CDLL(str(directory / "noop.so"))
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (library.launch_kernel, library.replace_address))


class _Attend(torch.autograd.Function):
    """The least an autograd.Function around flashkiln's two calls can do."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = flashkiln.attention_forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return flashkiln.attention_backward(dout, q, k, v, out, lse)


def _fake_gpu(directory: Path, native: bool) -> KernelRegistry:
    """Plans of the portable family for any call, made without checks of the device."""
    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 7
    for name in (dq_routes.ROUTE_ENV, dq_routes.WORKSPACE_BUDGET_ENV):
        if name in os.environ:
            raise SystemExit(f"unset ${name}: it changes the backward's plan")
    variants = [descriptor(d=64)] + [bwd_descriptor(kernel, d=64) for kernel in ("bwd", "bwd_pre", "bwd_post")]
    entries = [kernel_entry(d, params_layout=params_layout(d.kernel).digest) for d in variants]
    driver = _SilentDriver(_noop_entry_points(directory) if native else None)
    registry = KernelRegistry(write_manifest(directory, entries), driver=driver)
    forward.plan_forward = lambda q, k, v, *rest: forward_plan(registry, q, k, v)
    backward.plan_backward = lambda dout, q, k, v, *rest: backward_plan(registry, q, k, v)
    return registry


def _interleaved(rows: dict[str, Callable[[], object]], rounds: int, calls: int) -> None:
    for fn in rows.values():
        for _ in range(100):
            fn()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    print(f"{'min':>8} {'median':>8}  µs per call")
    for name, samples in times.items():
        print(f"{min(samples):8.2f} {statistics.median(samples):8.2f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--native", action="store_true", help="launch through flashkiln._launch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        _fake_gpu(Path(directory), args.native)
        q, k, v = qkv(hq=1, hkv=1, s=128, d=64)
        dout = torch.randn_like(q)
        out, lse = flashkiln.attention_forward(q, k, v)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def step(attend: Callable[..., torch.Tensor]) -> Callable[[], None]:
            return training_step(attend, leaves, dout)

        _interleaved({
            "attention_forward (hit)": lambda: flashkiln.attention_forward(q, k, v),
            "attention_backward (hit)": lambda: flashkiln.attention_backward(dout, q, k, v, out, lse),
            "scaled_dot_product_attention, no gradient": lambda: flashkiln.scaled_dot_product_attention(q, k, v),
            "step: flashkiln.scaled_dot_product_attention": step(flashkiln.scaled_dot_product_attention),
            "step: a bare autograd.Function of the two calls": step(_Attend.apply),
            "step: an autograd.Function that only allocates": step(_AllocateOnly.apply),
        }, args.rounds, args.calls)


if __name__ == "__main__":
    main()
