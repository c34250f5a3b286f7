"""Device time of one call per kernel family: the hopper kernels beside the portable ones on the same
tensors, forward and backward, for variants the hopper family gains (is a new hopper variant faster
than the portable kernel that auto took before it?).

Cases: head dims 96 and 192/128, and d 256 with a full (B, H, S, S) bias and dBias, at S 4k and 16k
(B = 16384 / S, H = 2048 / d_v, bf16), causal or not; the forward where the hopper family has it.
Timing: bench/bench.py's time_ms, L2 flushed before each timed call. One JSON row per case and pass.
Usage (on a GPU machine): tools/pyenv.sh python3 tools/time_families.py [--reps N] > out.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import flashkiln
from flashkiln.errors import UnsupportedError, VariantNotFoundError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench import time_ms, visible_pairs  # noqa: E402  (bench/ is a folder of scripts, not a package)

FAMILIES = ("hopper", "portable")
CASES = [((96, 96), None), ((192, 128), None), ((256, 256), "full")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    for (d_qk, d_v), bias_kind in CASES:
        for s in args.seqlens:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d_v
                if bias_kind is not None:
                    b = max(1, b // 4)  # a (B, H, S, S) bias and its gradient: keep them within a few GiB
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k = (torch.randn(b, h, s, d_qk, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "qk")
                v, dout = (torch.randn(b, h, s, d_v, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "vd")
                bias = None if bias_kind is None else torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16,
                                                                  generator=gen)
                mode = "bottom_right" if causal else None
                pairs = visible_pairs(s, s, causal)
                for family in FAMILIES:
                    row = {"d_qk": d_qk, "d_v": d_v, "bias": bias_kind, "S": s, "causal": causal, "family": family}
                    try:
                        fwd = lambda: flashkiln.attention_forward(q, k, v, causal=mode, bias=bias,  # noqa: E731
                                                                  backend=family)
                        out, lse = fwd()
                        row["fwd_ms"] = time_ms(fwd, 3, args.reps, flush_l2=True)
                        row["fwd_tflops"] = 2 * b * h * (d_qk + d_v) * pairs / row["fwd_ms"] / 1e9
                    except (UnsupportedError, VariantNotFoundError) as e:  # no such forward: time the backward
                        row["fwd_error"] = type(e).__name__
                        out, lse = flashkiln.attention_forward(q, k, v, causal=mode, bias=bias)
                    bwd = lambda: flashkiln.attention_backward(  # noqa: E731
                        dout, q, k, v, out, lse, causal=mode, bias=bias, bias_grad=bias is not None, backend=family)
                    bwd()
                    row["bwd_ms"] = time_ms(bwd, 3, args.reps, flush_l2=True)
                    row["bwd_tflops"] = 2 * b * h * (3 * d_qk + 2 * d_v) * pairs / row["bwd_ms"] / 1e9
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
