"""Forward-only A/B of hopper kernel builds beside cuDNN, in one process (issue 5 tuning runs).

Method of bench/bench.py (median of CUDA-event timings of single calls after a sleep kernel),
bf16, H = 2048 / d, B = 16384 / S, causal = top-left square. Each build's output is also compared
with cuDNN's (max |O - O_cudnn|).

Usage: tools/pyenv.sh python3 bench/bench_hopper_variants.py LABEL=KERNEL_DIR[@full|@shared|@heads] ...
       [--seqlens 2048 8192] [--head-dims 64 128 192x128 256] [--causal both|off|on] [--json out.json]
A build named with @full, @shared or @heads runs with an additive bias of shape (B, H, S, S),
(1, 1, S, S) or (1, H, S, S) (non-causal rows only), so that builds with and without a bias
compare in one process; its output is compared with torch's efficient backend on the same bias.
A head dim d_qkxd_v (192x128) runs with H = 2048 / d_qk and 2 (d_qk + d_v) FLOPs per visible
pair; where cuDNN refuses it, torch's efficient backend takes its column.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashkiln  # noqa: E402
from bench import time_ms, visible_pairs  # noqa: E402
from flashkiln.registry import KernelRegistry  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("builds", nargs="+", metavar="LABEL=DIR")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", nargs="+", default=["64", "128", "256"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--causal", choices=["both", "off", "on"], default="both")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    builds = {}
    for build in args.builds:
        label, _, where = build.partition("=")
        path, _, bias = where.partition("@")
        builds[label] = (KernelRegistry(Path(path)), bias or None)
    rows = []
    print("d causal S " + " ".join(["cudnn", *builds]) + "   (TFLOP/s; x cudnn; max|O-O_cudnn|)", flush=True)
    for dims in args.head_dims:
        d, _, d_v = dims.partition("x")
        d, d_v = int(d), int(d_v or d)
        peer = SDPBackend.CUDNN_ATTENTION
        try:
            with sdpa_kernel(peer), torch.no_grad():
                F.scaled_dot_product_attention(*(torch.zeros(1, 1, 64, n, device="cuda", dtype=torch.bfloat16)
                                                 for n in (d, d, d_v)))
        except RuntimeError:
            peer = SDPBackend.EFFICIENT_ATTENTION
            print(f"d {dims}: cuDNN refuses it; the cudnn column is torch's efficient backend", flush=True)
        for causal in {"both": (False, True), "off": (False,), "on": (True,)}[args.causal]:
            for s in args.seqlens:
                b, h = 16384 // s, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(s * 1000 + d)
                q, k, v = (torch.randn(b, h, s, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for dim in (d, d, d_v))
                flops = 2 * b * h * (d + d_v) * visible_pairs(s, s, causal)

                biases = {"full": (b, h, s, s), "shared": (1, 1, s, s), "heads": (1, h, s, s)}
                biases = {name: torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                          for name, shape in biases.items() if not causal and any(x[1] == name for x in builds.values())}

                def cudnn():
                    with sdpa_kernel(peer):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def efficient(bias):
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

                with torch.no_grad():
                    refs = {None: cudnn(), **{name: efficient(bias) for name, bias in biases.items()}}
                    row = {"d": dims, "causal": causal, "seqlen": s, "cudnn": flops / time_ms(cudnn, args.warmup, args.reps) / 1e9}
                    for label, (reg, bias_name) in builds.items():
                        if bias_name is not None and causal:
                            continue
                        fn = lambda reg=reg, bias=biases.get(bias_name): flashkiln.attention_forward(  # noqa: E731
                            q, k, v, causal="top_left" if causal else None, bias=bias, backend="hopper",
                            registry=reg)[0]
                        row[label] = flops / time_ms(fn, args.warmup, args.reps) / 1e9
                        row[label + ":err"] = (fn().float() - refs[bias_name].float()).abs().max().item()
                rows.append(row)
                cells = [f"{row['cudnn']:.0f}"] + [f"{row[l]:.0f} ({row[l] / row['cudnn']:.2f}; {row[l + ':err']:.4f})"
                                                  if l in row else "-" for l in builds]
                print(f"{dims} {'c' if causal else '-'} {s} " + " | ".join(cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "cudnn": torch.backends.cudnn.version(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
