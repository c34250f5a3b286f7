"""Device time of flashkiln.attention_backward beside cuDNN's backward, on the standard sweep's shapes.

For A/B runs of two builds in one device call: run it once per tree (tools/pyenv.sh from each) and
compare the `flashkiln / cudnn` ratios, which absorb the drift between the two processes. Timing as
in bench/bench.py: L2 flushed and a GPU spin queued before each timed call, CUDA events, median.
Usage: tools/pyenv.sh python3 tools/time_backward.py LABEL [--reps N] > out.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkiln

CASES = [(d, s, causal, variant) for d in (64, 128, 256) for s in (2048, 8192) for causal in (False, True)
         for variant in ("plain",)]
CASES += [(128, 4096, causal, variant) for causal in (False, True) for variant in ("deterministic", "sink")]


def time_ms(fn, reps: int) -> float:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(2_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for d, s, causal, variant in CASES:
        b, h = 16384 // s, 2048 // d
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
        mode = "bottom_right" if causal else None
        sink = torch.linspace(-1.0, 2.0, h, device="cuda") if variant == "sink" else None
        out, lse = flashkiln.attention_forward(q, k, v, causal=mode, sink=sink, backend="portable")
        ours = time_ms(lambda: flashkiln.attention_backward(
            dout, q, k, v, out, lse, causal=mode, sink=sink, sink_grad=sink is not None,
            deterministic=variant == "deterministic"), args.reps)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref_out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            cudnn = time_ms(lambda: torch.autograd.grad(ref_out, leaves, dout, retain_graph=True), args.reps)
        rows.append({"label": args.label, "d": d, "S": s, "causal": causal, "variant": variant, "ms": ours,
                     "cudnn_ms": cudnn, "ratio": cudnn / ours})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
