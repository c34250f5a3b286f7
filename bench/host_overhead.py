"""Host time per call: flashkiln beside torch SDPA's flash and cudnn backends (shared/CONVENTIONS.md).

B = 1, H = 1, S = 128, d = 64, bf16: the device work is a few microseconds, so 1000 calls with one
synchronize at the end measure what the host spends per call (Python, checks, lookups, launches).
Rows: the forward alone and forward + backward through autograd, per family for flashkiln; the SDPA
forward on inputs that need no gradient (no autograd.Function); the backward alone, beside torch's
flash backward op called directly, and with dBias of a bias that two heads share (H = 2: at d 64
its own kernel, bwd_dbias, a fourth launch). The rows take turns, one loop of 1000 calls each per round, so
that a slow stretch of a shared host falls on every row alike; each row reports the minimum and the
median of its rounds' µs per call (the minimum is the least disturbed).

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
ROUNDS = 7


def per_call_us(fn: Callable[[], object], calls: int = CALLS) -> float:
    """µs per call of one loop of `calls` calls of fn (after a warm-up), synchronized at both ends."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


@dataclasses.dataclass
class Row:
    """A timed call, the context it runs in (entered afresh each round, plan caches emptied first
    where it changes what a call plans) and its rounds' µs per call."""

    name: str
    fn: Callable[[], object]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    replan: bool = False
    samples: list[float] = dataclasses.field(default_factory=list)


def interleaved(rows: list[Row], rounds: int = ROUNDS) -> None:
    """Each round times every row once, in order."""
    for _ in range(rounds):
        for row in rows:
            if row.replan:
                forward.PLANS.clear()
                backward.PLANS.clear()
            with row.context():
                row.samples.append(per_call_us(row.fn))


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

    out, lse = flashkiln.attention_forward(q, k, v)
    rows = []
    for family in args.families:
        rows.append(Row(f"flashkiln.attention_forward (backend={family})",
                        lambda family=family: flashkiln.attention_forward(q, k, v, backend=family)))
        # SDPA has no backend argument: auto picks hopper on an H200 (forward and backward); force
        # the other family by making the hopper family refuse the GPU (and plan afresh).
        refuse = dataclasses.replace(families.FAMILIES["hopper"], runs_on=lambda capability: "forced portable")
        forced = (lambda refuse=refuse: mock.patch.dict(families.FAMILIES, {"hopper": refuse})) \
            if family == "portable" else contextlib.nullcontext
        rows.append(Row(f"flashkiln.scaled_dot_product_attention fwd + bwd ({family} family)",
                        train(flashkiln.scaled_dot_product_attention), forced, replan=True))
    rows.append(Row("flashkiln.scaled_dot_product_attention, forward",
                    lambda: flashkiln.scaled_dot_product_attention(q, k, v), replan=True))
    for family in args.families:
        rows.append(Row(f"flashkiln.attention_backward (backend={family})",
                        lambda family=family: flashkiln.attention_backward(dout, q, k, v, out, lse, backend=family)))
    # A bias that two heads share, with dBias: at d 64 the hopper route adds bwd_dbias's launch.
    shared = [torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    bias = torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
    shared_out, shared_lse = flashkiln.attention_forward(*shared[:3], bias=bias)
    rows.append(Row("flashkiln.attention_backward (hopper), a bias shared by 2 heads, with dBias",
                    lambda: flashkiln.attention_backward(shared[3], *shared[:3], shared_out, shared_lse, bias=bias,
                                                         bias_grad=True, backend="hopper")))
    rows.append(Row("floor: a Python autograd.Function that only allocates, fwd + bwd", train(_AllocateOnly.apply)))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        rows.append(Row(f"torch SDPA {name}, forward", lambda: F.scaled_dot_product_attention(q, k, v),
                        lambda backend=backend: sdpa_kernel(backend)))
        rows.append(Row(f"torch SDPA {name}, fwd + bwd", train(F.scaled_dot_product_attention),
                        lambda backend=backend: sdpa_kernel(backend)))
    rows.append(Row("torch's flash backward op, no autograd (aten)", _torch_flash_backward(q, k, v, dout)))
    interleaved(rows)
    table = "\n".join(["| call | host µs per call (min) | median |", "|---|---|---|"]
                      + [f"| {r.name} | {min(r.samples):.0f} | {statistics.median(r.samples):.0f} |" for r in rows])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host.md").write_text(table + "\n")
    (args.out / "host.json").write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": "B=1 H=1 S=128 d=64 bf16",
        "calls": CALLS, "rounds": ROUNDS,
        "rows": [{"call": r.name, "us": min(r.samples), "median_us": statistics.median(r.samples),
                  "samples_us": r.samples} for r in rows]}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
