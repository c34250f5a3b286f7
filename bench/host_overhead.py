"""Host time per call: flashkiln beside torch SDPA's flash and cudnn backends (shared/CONVENTIONS.md).

B = 1, H = 1, S = 128, d = 64, bf16: the device work is a few microseconds, so 1000 calls with one
synchronize at the end measure what the host spends per call (Python, checks, lookups, launches).
Rows: the forward alone and forward + backward through autograd, per family for flashkiln; the SDPA
forward on inputs that need no gradient (no autograd.Function); the backward alone, beside torch's
flash backward op called directly.

Usage (on a GPU machine): tools/pyenv.sh python3 bench/host_overhead.py --out build/bench-host
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkiln
from flashkiln import backward, families, forward

CALLS = 1000


REPEATS = 5  # the median of this many loops of CALLS calls (the host's timings drift between loops)


def per_call_us(fn: Callable[[], object], calls: int = CALLS) -> float:
    for _ in range(20):
        fn()
    loops = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(loops)


class _AllocateOnly(torch.autograd.Function):
    """The floor of any Python autograd.Function here: its forward only allocates the output."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return dout, dout, dout


def training_step(attend: Callable[..., torch.Tensor], leaves: list[torch.Tensor],
                  dout: torch.Tensor) -> Callable[[], None]:
    """One forward + backward through autograd of `attend` on `leaves`, their gradients reset first."""
    def step() -> None:
        for t in leaves:
            t.grad = None
        attend(*leaves).backward(dout)
    return step


def _torch_flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          dout: torch.Tensor) -> Callable[[], object]:
    """torch's flash backward op called directly: the counterpart of flashkiln.attention_backward."""
    aten = torch.ops.aten
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v)
    return lambda: aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q,
                                                                     max_k, 0.0, False, seed, offset)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("build/bench-host"))
    parser.add_argument("--families", nargs="+", choices=list(families.BACKENDS), default=list(families.BACKENDS))
    args = parser.parse_args()
    q, k, v, dout = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def train(attend: Callable[..., torch.Tensor]) -> Callable[[], None]:
        return training_step(attend, leaves, dout)

    rows = []
    out, lse = flashkiln.attention_forward(q, k, v)
    for family in args.families:
        rows.append((f"flashkiln.attention_forward (backend={family})",
                     per_call_us(lambda: flashkiln.attention_forward(q, k, v, backend=family))))
        # SDPA has no backend argument: auto picks hopper on an H200 (forward and backward); force
        # the other family by making the hopper family refuse the GPU (and plan afresh).
        refuse = dataclasses.replace(families.FAMILIES["hopper"], runs_on=lambda capability: "forced portable")
        forced = mock.patch.dict(families.FAMILIES, {"hopper": refuse}) if family == "portable" \
            else contextlib.nullcontext()
        forward.PLANS.clear()
        with forced:
            rows.append((f"flashkiln.scaled_dot_product_attention fwd + bwd ({family} family)",
                         per_call_us(train(flashkiln.scaled_dot_product_attention))))
        forward.PLANS.clear()
        backward.PLANS.clear()
    rows.append(("flashkiln.scaled_dot_product_attention, forward",
                 per_call_us(lambda: flashkiln.scaled_dot_product_attention(q, k, v))))
    for family in args.families:
        rows.append((f"flashkiln.attention_backward (backend={family})",
                     per_call_us(lambda: flashkiln.attention_backward(dout, q, k, v, out, lse, backend=family))))
    backward.PLANS.clear()
    rows.append(("floor: a Python autograd.Function that only allocates, fwd + bwd",
                 per_call_us(train(_AllocateOnly.apply))))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            rows.append((f"torch SDPA {name}, forward", per_call_us(lambda: F.scaled_dot_product_attention(q, k, v))))
            rows.append((f"torch SDPA {name}, fwd + bwd", per_call_us(train(F.scaled_dot_product_attention))))
    rows.append(("torch's flash backward op, no autograd (aten)", per_call_us(_torch_flash_backward(q, k, v, dout))))
    table = "\n".join(["| call | host µs per call |", "|---|---|"] + [f"| {n} | {us:.0f} |" for n, us in rows])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host.md").write_text(table + "\n")
    (args.out / "host.json").write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": "B=1 H=1 S=128 d=64 bf16",
        "calls": CALLS, "rows": [{"call": n, "us": us} for n, us in rows]}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
