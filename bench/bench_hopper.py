"""Forward benchmark of the two flashkiln families beside cuDNN and FlashAttention (torch SDPA).

Standard sweep shapes (shared/CONVENTIONS.md): bf16, H = 2048 / d, B = 16384 / S, causal off and on;
timing and FLOP counting as in bench/bench.py (median of CUDA-event timings behind a sleep kernel,
4 * B * H * d * visible pairs). Prints a table with each backend's TFLOP/s and the ratio
hopper / cudnn, and writes it as JSON.

Usage (GPU machine): tools/pyenv.sh python3 bench/bench_hopper.py --out build/bench-hopper [--seqlens ...]
  [--hopper-dir LABEL=DIR ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashkiln  # noqa: E402
from flashkiln.registry import KernelRegistry  # noqa: E402
from bench import TORCH_BACKENDS, time_ms, torch_sdpa, visible_pairs  # noqa: E402


def _forward_from(registry: KernelRegistry, q, k, v, causal):
    return flashkiln.attention_forward(q, k, v, causal=causal, backend="hopper", registry=registry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--hopper-dir", action="append", default=[], metavar="LABEL=DIR",
                        help="also time the hopper kernels of another generated directory")
    args = parser.parse_args()
    backends = {
        "hopper": lambda q, k, v, c: flashkiln.attention_forward(q, k, v, causal=c, backend="hopper"),
        **{label: partial(_forward_from, KernelRegistry(Path(directory)))
           for label, directory in (item.split("=", 1) for item in args.hopper_dir)},
        "portable": lambda q, k, v, c: flashkiln.attention_forward(q, k, v, causal=c, backend="portable"),
        "cudnn": lambda q, k, v, c: torch_sdpa(TORCH_BACKENDS["cudnn"], c is not None)(q, k, v),
        "flash": lambda q, k, v, c: torch_sdpa(TORCH_BACKENDS["flash"], c is not None)(q, k, v),
    }
    rows = []
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("TFLOP/s (max |O - O_cudnn|)")
    print("| d | causal | S | " + " | ".join(backends) + " | hopper/cudnn |")
    print("|---|---|---|" + "---|" * (len(backends) + 1))
    for d in args.dims:
        for causal in (None, "top_left"):
            for s in args.seqlens:
                b, h = 16384 // s, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(3))
                flops = 4 * b * h * d * visible_pairs(s, s, causal is not None)
                row = {"d": d, "causal": causal is not None, "S": s}
                expected = backends["cudnn"](q, k, v, causal)
                for name, fn in backends.items():
                    try:
                        got = fn(q, k, v, causal)
                        # Sanity, not a test: the timed kernel computes the same attention as cuDNN.
                        out = got[0] if isinstance(got, tuple) else got
                        row[f"{name}_maxdiff"] = out.sub(expected).abs().max().item()
                        ms = time_ms(lambda: fn(q, k, v, causal), 3, args.reps)
                        row[name] = flops / (ms * 1e-3) / 1e12
                    except Exception as exc:  # a peer that does not run this shape: recorded, not fatal
                        row[name] = None
                        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                ratio = row["hopper"] / row["cudnn"] if row.get("hopper") and row.get("cudnn") else None
                row["hopper_over_cudnn"] = ratio
                rows.append(row)
                cells = [f"{row[n]:.0f} ({row[n + '_maxdiff']:.3f})" if row[n] else "-" for n in backends]
                ratio_cell = f"{ratio:.2f}" if ratio else "-"
                print(f"| {d} | {causal is not None} | {s} | " + " | ".join(cells) + f" | {ratio_cell} |", flush=True)
                del q, k, v
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_hopper.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
