"""Device time of flashkiln.attention_backward beside cuDNN's backward, on the standard sweep's shapes.

For A/B runs of two builds in one device call: run it once per tree (tools/pyenv.sh from each) and
compare the `flashkiln / cudnn` ratios, which absorb the drift between the two processes. Timing:
bench/bench.py's, with L2 flushed before each timed call.
Usage: tools/pyenv.sh python3 tools/time_backward.py LABEL [--reps N] [--backend FAMILY] [--sweep [VARIANT]]
  [--seqlens S ...] [--dims D ...] [--group G]
  > out.json
(--sweep: S 1k-16k at d 64 and 128 (--dims) instead of the A/B cases, as plain calls or deterministic or sink
ones, or with an additive bias: "bias" of shape (B, H, S, S), "shared-bias" (1, 1, S, S), "head-bias"
(1, H, S, S) and "row-bias" (B, H, 1, S), without dBias, and "dbias", "shared-dbias", "head-dbias" and
"row-dbias" the same with it; cuDNN's backward stays unbiased, the reference for every variant. Each
row has the peak memory of one flashkiln backward above what was allocated before it, in MiB.
--group G: GQA, H / G key and value heads; cuDNN's backward gets them repeated to H heads, the same
FLOPs, and its time includes the sum of dK and dV over each group that autograd adds.)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkiln

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench import time_ms, visible_pairs  # noqa: E402  (bench/ is a folder of scripts, not a package)

CASES = [(d, s, causal, variant) for d in (64, 128, 256) for s in (2048, 8192) for causal in (False, True)
         for variant in ("plain",)]
CASES += [(128, 4096, causal, variant) for causal in (False, True) for variant in ("deterministic", "sink")]
BIAS_VARIANTS = ("bias", "shared-bias", "head-bias", "row-bias")
VARIANTS = ("plain", "deterministic", "sink", *BIAS_VARIANTS, *(v.replace("bias", "dbias") for v in BIAS_VARIANTS))


def sweep(variant: str, seqlens: tuple[int, ...], dims: tuple[int, ...]) -> list[tuple[int, int, bool, str]]:
    return [(d, s, causal, variant) for d in dims for causal in (False, True) for s in seqlens]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--backend", help="the backward's family (default: auto)")
    parser.add_argument("--sweep", nargs="?", const="plain", choices=VARIANTS)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                        help="the sweep's sequence lengths")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="the sweep's head dims")
    parser.add_argument("--group", type=int, default=1, help="query heads per key/value head (GQA)")
    args = parser.parse_args()
    rows = []
    for d, s, causal, variant in sweep(args.sweep, tuple(args.seqlens), tuple(args.dims)) if args.sweep else CASES:
        b, h = 16384 // s, 2048 // d
        if h % args.group:
            raise SystemExit(f"H = {h} at d = {d} is not a multiple of --group {args.group}")
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(b, h // args.group, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        mode = "bottom_right" if causal else None
        sink = torch.linspace(-1.0, 2.0, h, device="cuda") if variant == "sink" else None
        bias_shape = {"bias": (b, h, s, s), "shared-bias": (1, 1, s, s), "head-bias": (1, h, s, s),
                      "row-bias": (b, h, 1, s)}.get(variant.replace("dbias", "bias"))
        bias = None if bias_shape is None else torch.randn(bias_shape, device="cuda", dtype=torch.bfloat16,
                                                           generator=gen)
        out, lse = flashkiln.attention_forward(q, k, v, causal=mode, sink=sink, bias=bias, backend="portable")
        call = lambda: flashkiln.attention_backward(  # noqa: E731
            dout, q, k, v, out, lse, causal=mode, sink=sink, sink_grad=sink is not None, bias=bias,
            bias_grad=variant.endswith("dbias"), deterministic=variant == "deterministic", backend=args.backend)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        peak_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
        ours = time_ms(call, 3, args.reps, flush_l2=True)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            kv = leaves[1:] if args.group == 1 else [t.repeat_interleave(args.group, dim=1) for t in leaves[1:]]
            ref_out = F.scaled_dot_product_attention(leaves[0], *kv, is_causal=causal)
            cudnn = time_ms(lambda: torch.autograd.grad(ref_out, leaves, dout, retain_graph=True), 3, args.reps,
                            flush_l2=True)
        flops = 2.5 * 4 * b * h * d * visible_pairs(s, s, causal)
        rows.append({"label": args.label, "d": d, "S": s, "causal": causal, "variant": variant, "group": args.group,
                     "ms": ours,
                     "cudnn_ms": cudnn, "ratio": cudnn / ours, "tflops": flops / ours / 1e9,
                     "peak_mib": round(peak_mib, 1),
                     "cudnn_tflops": flops / cudnn / 1e9})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
