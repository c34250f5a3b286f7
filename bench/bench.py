"""Attention benchmark: flashkiln beside torch's SDPA backends on the same shapes, in one process.

Standard sweep (shared/CONVENTIONS.md): bf16, H = 2048 / d, B = 16384 / S, S in 512..16k,
d in {64, 128, 256}, causal off and on; forward and backward. Each timing is the median of
CUDA-event timings of single calls; before each timed call the GPU is kept busy with a sleep
kernel (~2.5 ms, grown 4x while the device reaches a call before its host work has ended), so
host-side launch overhead overlaps it and only device time is measured; a timing that holds host
time even behind the longest sleep (a backend that synchronizes) is marked † in the tables. FLOPs: forward
4 * B * H * d * (visible (i, j) pairs), exact under the causal mask; backward 2.5x that, its time
the median of (forward + backward through autograd) minus the median forward. That median itself
is the "train" table's (3.5x the forward's FLOPs), printed wherever backwards are timed.

Usage (on a GPU machine): tools/pyenv.sh python3 bench/bench.py --out build/bench [--quick]
  [--passes fwd bwd] [--extra-kernel-dir LABEL=DIR ...]  (other generated dirs: forward only)
  [--bias full|shared]  (an additive bias and dBias instead, non-causal; with FlexAttention)
  [--varlen]  (packed batches of 16384 tokens in sequences of S/8..S tokens, S the longest; beside
               torch's efficient backend on nested tensors and FlexAttention with a document mask;
               forward also flashkiln's portable family, beside the hopper one that auto picks)
  [--softcap] (logit softcapping, cap SOFTCAP, d 64 and 128: flashkiln without and with it beside
               FlexAttention's score_mod of the same cap)
  [--window]  (sliding-window attention, window w = (w, w), causal (w, 0), w in WINDOWS, S 4k..32k,
               d 64 and 128, B = max(1, 16384 / S): flashkiln beside FlexAttention with the same
               mask and beside flashkiln without a window; FLOPs over the window's visible pairs;
               peak memory of both at bench/memory.py's shapes)
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flashkiln
from flashkiln.dq_routes import ROUTE_ENV, ROUTES
from flashkiln.errors import FlashkilnError
from flashkiln.registry import KernelRegistry
from memory import SHAPES as MEMORY_SHAPES, peak_mib  # bench/memory.py (bench/ is a folder of scripts)

TORCH_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
WINDOWS = (128, 512, 4096)
SOFTCAP = 30.0  # the --softcap table's cap (Gemma 2's attention cap is 50; every cap costs the same)


# FlexAttention runs compiled, as its documentation asks (eager is a slow reference path): one
# compile per shape, and room for every shape of a sweep before torch would fall back to eager.
torch._dynamo.config.cache_size_limit = 256
_flex = torch.compile(flex_attention, dynamic=False)


def visible_pairs(sq: int, sk: int, causal: bool) -> int:
    """(i, j) pairs a top-left causal mask leaves visible (all of them without a mask)."""
    if not causal:
        return sq * sk
    full = min(sq, sk)  # row i sees min(i + 1, sk) keys
    return full * (full + 1) // 2 + max(0, sq - sk) * sk


def window_of(w: int, causal: bool) -> tuple[int, int]:
    """The benchmarks' window of width w: (w, w), or (w, 0) under a causal mask. w = -1 leaves the
    left side unbounded: no window, or under a causal mask none beyond it."""
    return w, 0 if causal else w


def window_band(sq: int, sk: int, left: int, right: int) -> tuple[int, int]:
    """The key-minus-query offsets j - i that window (left, right) leaves visible, FlashAttention's
    rule: i + S_k - S_q - left <= j <= i + S_k - S_q + right; -1: unbounded (a bound past every pair)."""
    shift = sk - sq
    return (shift - left if left >= 0 else -sq, shift + right if right >= 0 else sk)


def window_visible_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """(i, j) pairs, 0 <= j < sk, inside window (left, right): summed over the query rows."""
    lo, hi = window_band(sq, sk, left, right)
    i = torch.arange(sq, dtype=torch.int64)
    return int(((i + hi).clamp(max=sk - 1) - (i + lo).clamp(min=0) + 1).clamp(min=0).sum())


def window_mask(sq: int, sk: int, left: int, right: int) -> Callable:
    """FlexAttention's mask_mod of window (left, right)."""
    lo, hi = window_band(sq, sk, left, right)
    return lambda b, h, i, j: (j - i >= lo) & (j - i <= hi)


def _brute_window_pairs(sq: int, sk: int, left: int, right: int) -> int:
    return sum(1 for i in range(sq) for j in range(sk) if (left < 0 or j >= i + sk - sq - left)
               and (right < 0 or j <= i + sk - sq + right))


# The count and the mask against the rule read literally, on small shapes (S_q != S_k both ways).
assert all(window_visible_pairs(*c) == _brute_window_pairs(*c)
           == int(window_mask(*c)(0, 0, torch.arange(c[0])[:, None], torch.arange(c[1])[None]).sum())
           for c in ((sq, sk, left, right) for sq in (1, 5, 13) for sk in (1, 7, 13)
                     for left in (-1, 0, 3, 20) for right in (-1, 0, 2))), "window_visible_pairs: wrong count"


# The sleep kernel each timed call is queued behind (torch.cuda._sleep's cycles; 5M is about 2.5 ms
# at the H200's clock): the call's host work hides behind it as long as the host stays behind the
# sleep. A call that outran it is timed again behind one 4x longer, up to the longest.
SLEEP_CYCLES = 5_000_000
MAX_SLEEP_CYCLES = 320_000_000


class Milliseconds(float):
    """A timing; `host_bound` where the device reached some timed call before its host work ended,
    even behind the longest sleep: the value then holds host time, and the tables mark it."""

    def __new__(cls, value: float, host_bound: bool = False) -> "Milliseconds":
        timing = super().__new__(cls, value)
        timing.host_bound = host_bound
        return timing


def time_ms(fn: Callable[[], object], warmup: int, reps: int, flush_l2: bool = False) -> Milliseconds:
    """Median device time of fn(); with `flush_l2`, a 256 MiB write before each timed call."""
    for _ in range(warmup):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush_l2 else None
    sleep = SLEEP_CYCLES
    while True:
        times, overtaken = _timed_calls(fn, reps, flush, sleep)
        if not overtaken or sleep >= MAX_SLEEP_CYCLES:
            break
        sleep *= 4
    if overtaken:
        print(f"bench: {overtaken} of {reps} timed calls reached the device before their host work ended, "
              f"even behind a sleep of {sleep} cycles: these timings include host time", file=sys.stderr)
    return Milliseconds(statistics.median(times), host_bound=overtaken > 0)


def _timed_calls(fn: Callable[[], object], reps: int, flush: torch.Tensor | None,
                 sleep: int) -> tuple[list[float], int]:
    """Each call's event-timed milliseconds behind a sleep of `sleep` cycles, and how many calls the
    device had already begun when fn() returned (their start event complete): those may hold
    gaps of host time."""
    torch.cuda.synchronize()
    times, overtaken = [], 0
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(sleep)
        start.record()
        fn()
        overtaken += start.query()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, overtaken


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / (time_ms(lambda: a @ b, 3, 10) * 1e-3) / 1e12


def read_bandwidth_tbps() -> float:
    """Device memory read bandwidth: a sum over 4 GiB of bf16, far past L2 (the bound a full bias
    stream meets; docs/perf.md, v16)."""
    x = torch.randn(2 << 30, device="cuda", dtype=torch.bfloat16)
    return x.numel() * x.element_size() / (time_ms(lambda: x.sum(dtype=torch.float32), 3, 20) * 1e-3) / 1e12


def torch_sdpa(backend: SDPBackend, causal: bool) -> Attention:
    def attend(q, k, v, **kwargs):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    return attend


def with_backward(attend: Attention, dout: torch.Tensor, deterministic: bool,
                  route: str | None = None) -> Callable[[object], object]:
    """(q, k, v) -> forward and backward through autograd (deterministic mode on for the backward;
    flashkiln's dq route forced to `route` when given)."""
    env = {} if route is None else {ROUTE_ENV: route}

    def step(leaves):
        for t in leaves:
            t.grad = None  # no accumulation kernels in the timing
        out = attend(*leaves[:3])
        torch.use_deterministic_algorithms(deterministic)
        try:
            with mock.patch.dict(os.environ, env):
                out.backward(dout)
        finally:
            torch.use_deterministic_algorithms(False)
    return step


def bias_cases(passes: list[str], bias: torch.Tensor, registries: dict[str, KernelRegistry | None]) -> dict:
    """flashkiln with and without `bias` (its gradient too, when it requires one), torch's
    efficient backend with it (the one torch backend that returns dBias) and FlexAttention; the
    forward of the other kernel directories too."""
    kiln = lambda q, k, v: flashkiln.scaled_dot_product_attention(q, k, v)  # noqa: E731
    kiln_bias = lambda q, k, v: flashkiln.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # noqa: E731
    efficient = torch_sdpa(SDPBackend.EFFICIENT_ATTENTION, False)
    efficient_bias = lambda q, k, v: efficient(q, k, v, attn_mask=bias)  # noqa: E731
    shared = bias.shape[0] == 1
    # A learnable bias as FlexAttention writes it: a captured tensor read in score_mod.
    score_mod = (lambda score, b, h, i, j: score + bias[0, 0, i, j]) if shared else \
        (lambda score, b, h, i, j: score + bias[b, h, i, j])
    flex_bias = lambda q, k, v: _flex(q, k, v, score_mod=score_mod)  # noqa: E731
    cases = {(name, p): (fn, False, None) for p in passes for name, fn in
             (("flashkiln", kiln), ("flashkiln+bias", kiln_bias), ("efficient+bias", efficient_bias),
              ("flex+bias", flex_bias))}
    if "fwd" in passes:
        # The portable family's biased forward too (auto takes the hopper one where it applies).
        cases[("flashkiln-portable+bias", "fwd")] = ((lambda q, k, v: flashkiln.attention_forward(
            q, k, v, bias=bias, backend="portable")[0]), False, None)
        for name, registry in registries.items():
            if registry is not None:
                cases[(f"{name}+bias", "fwd")] = ((lambda q, k, v, registry=registry: flashkiln.attention_forward(
                    q, k, v, bias=bias, registry=registry)[0]), False, None)
    return cases


def packed_lengths(longest: int, tokens: int, seed: int) -> list[int]:
    """Sequence lengths drawn from [longest / 8, longest] until they hold `tokens` (the last one cut)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        drawn = int(torch.randint(max(1, longest // 8), longest + 1, (1,), generator=gen))
        lengths.append(min(drawn, tokens - sum(lengths)))
    return lengths


def varlen_cases(passes: list[str], lengths: list[int], causal: bool) -> dict:
    """Attention over one packed batch of (total, H, d) tokens: flashkiln's varlen kernels, torch's
    efficient backend on nested (jagged) tensors, and FlexAttention with a document mask."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest, total = max(lengths), sum(lengths)
    mode = "top_left" if causal else None
    kiln = lambda q, k, v: flashkiln.varlen_attention(q, k, v, cu, cu, longest, longest, causal=mode)  # noqa: E731

    def efficient(q, k, v):
        nested = [torch.nested.nested_tensor_from_jagged(t, offsets=cu.long()).transpose(1, 2) for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(*nested, is_causal=causal)
        return out.transpose(1, 2).values()

    document = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                       torch.tensor(lengths, device="cuda"))
    start = cu[:-1].long()[document]

    def same_document(b, h, i, j):
        visible = document[i] == document[j]
        return visible & (j - start[j] <= i - start[i]) if causal else visible
    block_mask = create_block_mask(same_document, None, None, total, total, device="cuda")

    def flex(q, k, v):
        out = _flex(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block_mask)
        return out[0].transpose(0, 1)
    cases = {(name, p): (fn, False, None) for p in passes for name, fn in
             (("flashkiln-varlen", kiln), ("efficient-nested", efficient), ("flex-document", flex))}
    if "fwd" in passes:  # flashkiln-varlen's forward runs the hopper family on an H200: the portable one beside it
        packed = flashkiln.PackedBatch(cu, cu, longest, longest)
        cases[("flashkiln-varlen-portable", "fwd")] = ((lambda q, k, v: flashkiln.attention_forward(
            q, k, v, causal=mode, packed=packed, backend="portable")[0]), False, None)
    return cases


def window_cases(passes: list[str], s: int, causal: bool, left: int, right: int) -> dict:
    """flashkiln with window (left, right) and FlexAttention with the same mask (its block mask
    built here, outside the timings); left = -1: flashkiln without a window alone, the reference."""
    if left < 0:
        full = lambda q, k, v: flashkiln.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        return {("flashkiln", p): (full, False, None) for p in passes}
    kiln = lambda q, k, v: flashkiln.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=causal, window_size=(left, right))
    block_mask = create_block_mask(window_mask(s, s, left, right), None, None, s, s, device="cuda")
    flex = lambda q, k, v: _flex(q, k, v, block_mask=block_mask)  # noqa: E731
    return {(name, p): (fn, False, None) for p in passes for name, fn in
            (("flashkiln-window", kiln), ("flex-window", flex))}


def softcap_cases(passes: list[str], s: int, causal: bool) -> dict:
    """flashkiln without and with a logit softcap, and FlexAttention's score modification of the same
    cap (with its causal block mask, built here)."""
    kiln = lambda q, k, v: flashkiln.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    capped = lambda q, k, v: flashkiln.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=causal, softcap=SOFTCAP)
    score_mod = lambda score, b, h, i, j: SOFTCAP * torch.tanh(score / SOFTCAP)  # noqa: E731
    block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, s, s, device="cuda") if causal else None
    flex = lambda q, k, v: _flex(q, k, v, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
    return {(name, p): (fn, False, None) for p in passes for name, fn in
            (("flashkiln", kiln), ("flashkiln-softcap", capped), ("flex-softcap", flex))}


def cases_for(d: int, causal: bool, passes: list[str], registries: dict[str, KernelRegistry | None]) -> dict:
    """(name, pass) -> (attention function, deterministic backward?, flashkiln dq route forced or None)"""
    mode = "top_left" if causal else None
    cases = {}
    for name, backend in TORCH_BACKENDS.items():
        for p in passes:
            cases[(name, p)] = (torch_sdpa(backend, causal), False, None)
    if "bwd" in passes:
        cases[("flash-det", "bwd")] = (torch_sdpa(SDPBackend.FLASH_ATTENTION, causal), True, None)
        kiln = lambda q, k, v: flashkiln.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        cases[("flashkiln", "bwd")] = (kiln, False, None)
        cases[("flashkiln-det", "bwd")] = (kiln, True, None)
        # Each dq route forced (the two above take the preferred one within the workspace budget).
        for route in ROUTES:
            cases[(f"flashkiln[{route}]", "bwd")] = (kiln, route != "atomic", route)
    if "fwd" in passes:
        # flashkiln picks its family itself (the hopper one on an H100/H200); the portable one too.
        for name, registry in registries.items():
            cases[(name, "fwd")] = ((lambda q, k, v, registry=registry: flashkiln.attention_forward(
                q, k, v, causal=mode, registry=registry)[0]), False, None)
        cases[("flashkiln-portable", "fwd")] = ((lambda q, k, v: flashkiln.attention_forward(
            q, k, v, causal=mode, backend="portable")[0]), False, None)
    return cases


def measure(p: str, attend: Attention, leaves: list[torch.Tensor], dout: torch.Tensor, deterministic: bool,
            route: str | None, args: argparse.Namespace) -> dict[str, Milliseconds]:
    """Milliseconds per pass: of one forward (p == "fwd"), or of one backward through autograd of
    `attend` on leaves[:3] (the inputs; further leaves, a bias, get gradients too) together with
    "train", the forward and backward through autograd it is measured from (p == "bwd")."""
    if p == "fwd":
        with torch.no_grad():
            return {"fwd": time_ms(lambda: attend(*leaves[:3]), args.warmup, args.reps)}
    step = with_backward(attend, dout, deterministic, route)
    train = time_ms(lambda: step(leaves), args.warmup, args.reps)
    forward = time_ms(lambda: attend(*leaves[:3]), args.warmup, args.reps)
    return {"bwd": Milliseconds(train - forward, train.host_bound or forward.host_bound), "train": train}


# FLOPs of each pass in forwards' FLOPs (a backward's five GEMMs to the forward's two).
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "train": 3.5}
PASS_NAMES = {"fwd": "forward", "bwd": "backward", "train": "forward + backward through autograd"}
CHART_NAMES = {"fwd": "forward", "bwd": "backward", "train": "train"}


def record(rows: list[dict], cases: dict, leaves: list[torch.Tensor], dout: torch.Tensor, fwd_flops: int,
           args: argparse.Namespace, peak: Callable[[Attention], float] | None = None, **shape) -> None:
    """Time every case and append its row (a case that cannot run is reported and skipped); with
    `peak`, each backend's peak memory too (MiB, once per backend, in each of its rows)."""
    label = " ".join(f"{k}={v}" for k, v in shape.items())
    peaks: dict[str, float] = {}
    for (name, p), (attend, deterministic, route) in cases.items():
        try:
            times = measure(p, attend, leaves, dout, deterministic, route, args)
            if peak is not None and name not in peaks:
                peaks[name] = peak(attend)
        except (RuntimeError, FlashkilnError) as exc:
            print(f"  {name} {p} {label}: skipped ({str(exc).splitlines()[0]})", file=sys.stderr)
            continue
        for timed, ms in times.items():
            rows.append({"backend": name, "pass": timed, **shape, "ms": float(ms),
                         "tflops": fwd_flops * PASS_FLOPS[timed] / (ms * 1e-3) / 1e12,
                         **({"host_bound": True} if ms.host_bound else {}),
                         **({"peak_mib": peaks[name]} if name in peaks else {})})
            print(f"{name:>22} {timed} {label} {ms:8.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)


def run(args: argparse.Namespace) -> dict:
    if args.seqlens:
        seqlens = args.seqlens
    elif args.window:
        seqlens = [4096, 16384] if args.quick else [4096, 8192, 16384, 32768]
    else:
        seqlens = [2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    head_dims = args.head_dims or ([64, 128] if args.window or args.softcap else [64, 128, 256])
    # "flashkiln": the default registry, which --kernel-dir points at for every row (main sets it).
    registries: dict[str, KernelRegistry | None] = {"flashkiln": None}
    for spec in args.extra_kernel_dir:
        label, _, path = spec.partition("=")
        registries[f"flashkiln[{label}]"] = KernelRegistry(Path(path))
    rows: list[dict] = []
    for d in head_dims:
        # torch's SDPA takes no attn_mask together with is_causal: biased runs are not causal.
        for causal in (False,) if args.bias != "none" else {"both": (False, True), "no": (False,),
                                                            "yes": (True,)}[args.causal]:
            for s in seqlens:
                b, h = max(1, 16384 // s), 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(s * 1000 + d)
                if args.varlen:
                    lengths = packed_lengths(s, 16384, s)
                    q, k, v, dout = (torch.randn(sum(lengths), h, d, device="cuda", dtype=torch.bfloat16,
                                                 generator=gen) for _ in range(4))
                    fwd_flops = 4 * h * d * sum(visible_pairs(n, n, causal) for n in lengths)
                    leaves = [t.requires_grad_() for t in (q, k, v)]
                    record(rows, varlen_cases(args.passes, lengths, causal), leaves, dout, fwd_flops, args,
                           d=d, causal=causal, seqlen=s, batch=len(lengths), heads=h)
                    continue
                q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                                 for _ in range(4))
                fwd_flops = 4 * b * h * d * visible_pairs(s, s, causal)
                leaves = [t.requires_grad_() for t in (q, k, v)]
                if args.window:
                    peak = (lambda attend: peak_mib(attend, d, s)) if (d, s) in MEMORY_SHAPES else None
                    for w in (-1, *args.windows):  # -1: without a window, the reference rate
                        left, right = window_of(w, causal)
                        record(rows, window_cases(args.passes, s, causal, left, right), leaves, dout,
                               4 * b * h * d * window_visible_pairs(s, s, left, right), args, peak,
                               d=d, causal=causal, seqlen=s, window=w, batch=b, heads=h)
                    continue
                if args.softcap:
                    record(rows, softcap_cases(args.passes, s, causal), leaves, dout, fwd_flops, args, d=d,
                           causal=causal, seqlen=s, batch=b, heads=h)
                    continue
                if args.bias != "none":
                    bias = torch.randn((b, h, s, s) if args.bias == "full" else (1, 1, s, s), device="cuda",
                                       dtype=torch.bfloat16, generator=gen).requires_grad_()
                    cases = bias_cases(args.passes, bias, registries)
                    leaves.append(bias)
                else:
                    cases = cases_for(d, causal, args.passes, registries)
                record(rows, cases, leaves, dout, fwd_flops, args, d=d, causal=causal, seqlen=s, batch=b, heads=h)
    cudnn = {(r["pass"], r["d"], r["causal"], r["seqlen"]): r["tflops"] for r in rows if r["backend"] == "cudnn"}
    for r in rows:
        ref = cudnn.get((r["pass"], r["d"], r["causal"], r["seqlen"]))
        r["vs_cudnn"] = r["tflops"] / ref if ref else None
    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": props.name,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cuda": torch.version.cuda,
        "flashkiln": flashkiln.__version__,
        "kernel_build": {name: (reg or KernelRegistry()).manifest.build for name, reg in registries.items()},
        "bf16_matmul_tflops": matmul_peak_tflops(),
        "read_TBps": read_bandwidth_tbps(),
        "method": "median of CUDA-event timings of single calls after a sleep kernel; bf16; "
                  "H=2048/d, B=max(1, 16384/S); FLOPs 4*B*H*d*visible pairs (backward 2.5x; its time "
                  "median(fwd+bwd) - median(fwd))",
        "rows": rows,
    }


HOST_BOUND_NOTE = ("† holds host time: the device reached these calls before their host work ended, even behind "
                   "the longest sleep")


def rate(r: dict) -> str:
    """A row's TFLOP/s as the tables print it, marked where its timing holds host time."""
    return f"{r['tflops']:.0f}" + ("†" if r.get("host_bound") else "")


def host_bound_note(rows: list[dict]) -> list[str]:
    return ["", HOST_BOUND_NOTE] if any(r.get("host_bound") for r in rows) else []


def table(result: dict, p: str) -> str:
    rows = [r for r in result["rows"] if r["pass"] == p]
    backends = sorted({r["backend"] for r in rows}, key=lambda n: (not n.startswith("flashkiln"), n))
    lines = [f"{PASS_NAMES[p]}, TFLOP/s (x cuDNN)", "",
             "| d | causal | S | " + " | ".join(backends) + " |", "|---|---|---|" + "---|" * len(backends)]
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["d"], r["causal"], r["seqlen"]), {})[r["backend"]] = r
    for (d, causal, s), cells in sorted(by_key.items()):
        text = []
        for b in backends:
            r = cells.get(b)
            text.append("-" if r is None else rate(r) + (f" ({r['vs_cudnn']:.2f})" if r["vs_cudnn"] else ""))
        lines.append(f"| {d} | {causal} | {s} | " + " | ".join(text) + " |")
    return "\n".join(lines + host_bound_note(rows))


def window_table(result: dict, p: str) -> str:
    """One line per (d, causal, S, window): flashkiln with the window, its rate over flashkiln's
    without one (same d, causal, S) and over FlexAttention's with the window, and peak memory."""
    cells = {(r["backend"], r["d"], r["causal"], r["seqlen"], r["window"]): r for r in result["rows"] if r["pass"] == p}

    def ratio(a: dict | None, b: dict | None) -> str:
        return f"{a['tflops'] / b['tflops']:.2f}" if a and b else "-"

    def mib(r: dict | None) -> str:
        return f"{r['peak_mib']:.0f}" if r and "peak_mib" in r else "-"

    lines = [f"{PASS_NAMES[p]} with a sliding window, TFLOP/s over the visible pairs; "
             "window w: (w, w), causal (w, 0); target for w >= 512: x full >= 0.85, x flex >= 1.5; "
             "peak MiB of forward + backward above the inputs at B = 1, H = 16 (bench/memory.py)", "",
             "| d | causal | S | w | flashkiln | full | x full | flex | x flex | MiB flashkiln | MiB flex | MiB full |",
             "|---" * 12 + "|"]
    for d, causal, s, w in sorted({key[1:] for key in cells if key[4] >= 0}):
        kiln, flex = cells.get(("flashkiln-window", d, causal, s, w)), cells.get(("flex-window", d, causal, s, w))
        full = cells.get(("flashkiln", d, causal, s, -1))
        rates = [rate(r) if r else "-" for r in (kiln, full, flex)]
        lines.append(f"| {d} | {causal} | {s} | {w} | {rates[0]} | {rates[1]} | {ratio(kiln, full)} | {rates[2]} | "
                     f"{ratio(kiln, flex)} | {mib(kiln)} | {mib(flex)} | {mib(full)} |")
    return "\n".join(lines + host_bound_note(list(cells.values())))


def chart(result: dict, p: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["pass"] == p]
    series = lambda r: r["backend"] + (f" w={r['window']}" if r.get("window", -1) >= 0 else "")  # noqa: E731
    dims = sorted({r["d"] for r in rows})
    # At least 10 inches wide: a one-head-dim run's title and legend fit too.
    fig, axes = plt.subplots(2, len(dims), figsize=(max(5 * len(dims), 10), 8), squeeze=False)
    for col, d in enumerate(dims):
        for row, causal in enumerate((False, True)):
            ax = axes[row][col]
            for backend in sorted({series(r) for r in rows}):
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                             if series(r) == backend and r["d"] == d and r["causal"] == causal)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
            ax.set_xscale("log", base=2)
            ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    columns = min(len(handles), 2 * len(dims) + 1)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=columns, fontsize=9)
    fig.suptitle(f"attention {PASS_NAMES[p]}, bf16, {result['device']} "
                 f"({result['date'][:10]})")
    fig.tight_layout(rect=(0, 0.02 + 0.03 * math.ceil(len(handles) / columns), 1, 1))  # room for the legend's rows
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/bench"))
    parser.add_argument("--quick", action="store_true", help="S in {2k, 8k} only ({4k, 16k} with --window)")
    parser.add_argument("--seqlens", type=int, nargs="+", help="instead of the table's sequence lengths")
    parser.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS), help="--window's window sizes")
    parser.add_argument("--causal", choices=("both", "no", "yes"), default="both", help="which masks to time")
    parser.add_argument("--head-dims", type=int, nargs="+", help="default: 64 128 256 (64 128 with --window)")
    parser.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    parser.add_argument("--bias", choices=["none", "full", "shared"], default="none",
                        help="time an additive bias instead (full: (B, H, S, S), shared: (1, 1, S, S)), with dBias "
                             "in the backward, beside flashkiln without it and torch's efficient backend")
    parser.add_argument("--varlen", action="store_true",
                        help="time packed variable-length batches instead (S is the longest sequence)")
    parser.add_argument("--softcap", action="store_true",
                        help=f"time logit softcapping (cap {SOFTCAP:g}) instead, beside FlexAttention's score_mod "
                             "and flashkiln without it")
    parser.add_argument("--window", action="store_true",
                        help="time sliding-window attention instead, beside FlexAttention and flashkiln without a window")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--kernel-dir", type=Path,
                        help="flashkiln's kernels for every row, forward and backward (sets $FLASHKILN_KERNEL_DIR; "
                             "default: the runtime's default)")
    parser.add_argument("--extra-kernel-dir", action="append", default=[], metavar="LABEL=DIR",
                        help="also time the kernels of another generated directory (tuning candidates)")
    args = parser.parse_args()
    if args.kernel_dir:
        # Through the environment, so that every call's default registry (the SDPA drop-in's and
        # the backward's too, which take no registry argument) loads these kernels.
        os.environ["FLASHKILN_KERNEL_DIR"] = str(args.kernel_dir.resolve())
    torch.backends.cuda.matmul.allow_tf32 = False
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(result, indent=1))
    # Every timed backward also gave its forward + backward through autograd ("train").
    passes = [*args.passes, *(["train"] if "bwd" in args.passes else [])]
    tables = "\n\n".join((window_table if args.window else table)(result, p) for p in passes)
    (args.out / "bench.md").write_text(tables + "\n")
    for p in passes:
        chart(result, p, args.out / f"{CHART_NAMES[p]}.png")
    print(f"\n{result['device']}, torch {result['torch']}, cuDNN {result['cudnn']}, "
          f"bf16 matmul {result['bf16_matmul_tflops']:.0f} TFLOP/s, memory read {result['read_TBps']:.2f} TB/s\n")
    print(tables)


if __name__ == "__main__":
    main()
