"""Device time of flashkiln with a score modification beside flashkiln without one, per family (no
peers: bench/bench.py --window and --softcap time FlexAttention too, with its compiles).

--mod window: per (d, causal, S, w) the forward and backward with window (w, w), causal (w, 0)
(w = -1: none, the reference), TFLOP/s over the visible pairs (bench.py's window_visible_pairs)
and that rate over the reference's. --mod softcap: per (d, causal, S) without and with a cap.
Timing: bench.py's time_ms, L2 flushed before each timed call.
Usage: tools/pyenv.sh python3 tools/time_score_mods.py [--mod window|softcap] [--backend FAMILY] [--quick]
  [--dims 64 128 256] > out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import flashkiln

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench import WINDOWS, time_ms, window_of, window_visible_pairs  # noqa: E402  (bench/ is a folder of scripts)

SOFTCAP = 30.0  # Gemma 2's attention cap is 50; any cap costs the same


def variants(mod: str, causal: bool) -> list[tuple[str, dict, tuple[int, int]]]:
    """(label, extra arguments, window for the pair count) per timed call, the reference first."""
    if mod == "softcap":
        return [("none", {}, (-1, -1)), (f"softcap {SOFTCAP:g}", {"softcap": SOFTCAP}, (-1, -1))]
    return [("w=-1", {}, (-1, -1))] + [(f"w={w}", {"window_size": window_of(w, causal)}, window_of(w, causal))
                                       for w in WINDOWS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mod", choices=("window", "softcap"), default="window")
    parser.add_argument("--backend", help="the family (default: auto)")
    parser.add_argument("--quick", action="store_true", help="S 4k and 16k only")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="head dims (default: 64 128)")
    args = parser.parse_args()
    rows = []
    for d in args.dims:
        for causal in (False, True):
            for s in (4096, 16384) if args.quick else (4096, 8192, 16384, 32768):
                b, h = max(1, 16384 // s), 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                                 for _ in range(4))
                reference = {}
                for label, extra, (left, right) in variants(args.mod, causal):
                    kw = dict(causal="bottom_right" if causal else None, backend=args.backend, **extra)
                    out, lse = flashkiln.attention_forward(q, k, v, **kw)
                    fwd = time_ms(lambda: flashkiln.attention_forward(q, k, v, **kw), 3, args.reps, flush_l2=True)
                    bwd = time_ms(lambda: flashkiln.attention_backward(dout, q, k, v, out, lse, **kw), 3, args.reps,
                                  flush_l2=True)
                    flops = 4 * b * h * d * window_visible_pairs(s, s, left, 0 if causal else right)
                    rates = {"fwd": flops / fwd / 1e9, "bwd": 2.5 * flops / bwd / 1e9}
                    reference = reference or rates
                    row = {"d": d, "causal": causal, "seqlen": s, "variant": label, "fwd_ms": fwd, "bwd_ms": bwd,
                           **{f"{p}_tflops": r for p, r in rates.items()},
                           **{f"{p}_x_reference": r / reference[p] for p, r in rates.items()}}
                    rows.append(row)
                    print(f"d{d} causal={causal} S={s} {label}: fwd {fwd:.3f} ms {rates['fwd']:.0f} TF "
                          f"(x{row['fwd_x_reference']:.2f}), bwd {bwd:.3f} ms {rates['bwd']:.0f} TF "
                          f"(x{row['bwd_x_reference']:.2f})", file=sys.stderr, flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": args.backend,
               "mod": args.mod, "rows": rows}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
