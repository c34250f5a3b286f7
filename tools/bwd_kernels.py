"""Where the backward's device time goes: each kernel of flashkiln.attention_backward and of cuDNN's
backward through autograd, per call (torch.profiler's CUDA activity, averaged over --reps calls).

Usage: tools/pyenv.sh python3 tools/bwd_kernels.py [--reps N] [--cases d:S[:causal][:wW] ...] > out.txt
(B = 16384 / S, H = 2048 / d, bf16, as tools/time_backward.py's sweep. `wW`: window (W, W), causal
(W, 0), as tools/time_score_mods.py's; cuDNN has no window, so a windowed case times flashkiln alone.)
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flashkiln

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench import window_of  # noqa: E402  (bench/ is a folder of scripts, not a package)


def kernel_times(run, reps: int) -> dict[str, float]:
    """Mean device µs per call of each kernel that `run` launches."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:60]] += event.device_time / reps
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cases", nargs="+", default=["128:1024", "128:4096", "128:16384", "128:1024:causal",
                                                      "64:1024", "64:16384"])
    args = parser.parse_args()
    for case in args.cases:
        d, s, *rest = case.split(":")
        d, s, causal = int(d), int(s), "causal" in rest
        widths = [int(token[1:]) for token in rest if token.startswith("w")]
        window = window_of(widths[0], causal) if widths else None
        b, h = 16384 // s, 2048 // d
        q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        mode = "bottom_right" if causal else None
        out, lse = flashkiln.attention_forward(q, k, v, causal=mode, window_size=window)
        ours = kernel_times(lambda: flashkiln.attention_backward(dout, q, k, v, out, lse, causal=mode,
                                                                 window_size=window), args.reps)
        timed = [("flashkiln", ours)]
        if window is None:
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

            def cudnn() -> None:
                torch.autograd.grad(ref, (qg, kg, vg), dout, retain_graph=True)
            timed.append(("cudnn", kernel_times(cudnn, args.reps)))
        print(f"d {d} S {s} B {b} H {h} causal {causal} window {window}")
        for label, times in timed:
            print(f"  {label}: {sum(times.values()):.1f} us")
            for name, us in sorted(times.items(), key=lambda item: -item[1]):
                print(f"    {us:9.1f}  {name}")


if __name__ == "__main__":
    main()
