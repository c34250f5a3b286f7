"""Where a Hopper backward CTA's time goes, per CTA, from a build with the timeline probe.

A build made with `python -m flashkiln.generator generate --probe timeline ...` compiles
hopper/timeline.hpp's marks into its hopper backwards: for every CTA of the main kernel, its SM, the
global timer at entry and when its consumers have issued dK and dV, and the SM clock at entry, once
K and V have landed, once the first query tile's Q and dO have landed, at the sweep's end and at
that last point; and, summed over the sweep, the consumers' clocks waiting for their stage and for
their dQ staging buffer, and the producer's storing a full bias's dS tiles. This tool runs one
backward per case on the standard sweep's shapes (B * S = 16k tokens, H = 2048 / d; the A/B cases'
shapes), reads the array back and prints, per case, medians over the CTAs in µs: the wait for K and
V, the fill up to the first stage, the time per swept query tile, those three sums per tile, the
epilogue, and the gap on an SM between one CTA's epilogue and the next one's entry (the CTA's drain,
its exit and the next one's launch and set-up); the fixed cost per CTA (all but the sweep) in tiles'
time; the sweeps' share of the kernel's SM time; and the call's median time (L2 flushed), to set
beside a build without the probe (--time-only) for the probe's own cost.

Usage: FLASHKILN_KERNEL_DIR=probe-build tools/pyenv.sh python3 tools/bwd_timeline.py
  [--dims 64 128] [--seqlens 2048 8192] [--windows -1 512] [--bias none bias dbias] [--out rows.jsonl]
  [--time-only]
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import flashkiln
from flashkiln import backward
from flashkiln.registry import KernelRegistry, default_registry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench import time_ms, window_of  # noqa: E402  (bench/ is a folder of scripts, not a package)

SYMBOL = b"flashkiln_bwd_timeline"
PROBE = "timeline"  # generate --probe's name (flashkiln.generator.render.PROBES)
SLOTS = 12  # hopper/timeline.hpp's kTimelineSlots
CTAS = 1 << 16  # and its kTimelineCtas
(SMID, START_TIME, START_CLOCK, KV_CLOCK, FIRST_CLOCK, SWEEP_END_CLOCK, EPILOGUE_CLOCK, END_TIME, TILES, STAGE_WAIT,
 DS_STORE, DQ_WAIT) = range(SLOTS)


def _timeline(library: Any, ctas: int, zero: bool) -> list[list[int]]:
    """The first `ctas` rows of the probe's array in `library` (a loaded CUlibrary), or with `zero`
    the whole array zeroed."""
    from cuda.bindings import driver as cu

    err, address, nbytes = cu.cuLibraryGetGlobal(library, SYMBOL)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"the main kernel's module has no {SYMBOL.decode()} ({err}): not built with --probe {PROBE}")
    if nbytes != CTAS * SLOTS * 8:
        raise SystemExit(f"{SYMBOL.decode()} holds {nbytes} bytes, not {CTAS} CTAs of {SLOTS} slots: a probe build "
                         "of another hopper/timeline.hpp than this tool's")
    if zero:
        (err,) = cu.cuMemsetD8(address, 0, nbytes)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        return []
    values = (ctypes.c_uint64 * (ctas * SLOTS))()
    (err,) = cu.cuMemcpyDtoH(ctypes.addressof(values), address, ctas * SLOTS * 8)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return [list(values[i * SLOTS:(i + 1) * SLOTS]) for i in range(ctas)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(rows: list[list[int]]) -> dict:
    """Medians over the CTAs of each phase in µs, and the kernel's totals (the module docstring)."""
    rows = [r for r in rows if r[END_TIME] and r[TILES]]  # CTAs that swept (a causal grid has empty ones)
    # SM clock cycles per ns, from each CTA's span on both clocks.
    ghz = _median([(r[EPILOGUE_CLOCK] - r[START_CLOCK]) / (r[END_TIME] - r[START_TIME])
                   for r in rows if r[END_TIME] > r[START_TIME]])
    us = lambda cycles: cycles / ghz / 1e3  # noqa: E731
    kv = [us(r[KV_CLOCK] - r[START_CLOCK]) for r in rows]
    fill = [us(r[FIRST_CLOCK] - r[KV_CLOCK]) for r in rows]
    per_tile = [us(r[SWEEP_END_CLOCK] - r[FIRST_CLOCK]) / r[TILES] for r in rows]
    epilogue = [us(r[EPILOGUE_CLOCK] - r[SWEEP_END_CLOCK]) for r in rows]
    # Per swept tile: the consumer's waits for its stage and for its dQ staging buffer, the producer's
    # stores of dS.
    stage_wait, ds_store, dq_wait = ([us(r[slot]) / r[TILES] for r in rows] for slot in (STAGE_WAIT, DS_STORE, DQ_WAIT))
    by_sm: dict[int, list[list[int]]] = {}
    for r in rows:
        by_sm.setdefault(r[SMID], []).append(r)
    gaps = []
    for ctas in by_sm.values():
        ctas.sort(key=lambda r: r[START_TIME])
        gaps += [(b[START_TIME] - a[END_TIME]) / 1e3 for a, b in zip(ctas, ctas[1:])]
    span = (max(r[END_TIME] for r in rows) - min(r[START_TIME] for r in rows)) / 1e3
    sweeps = sum(us(r[SWEEP_END_CLOCK] - r[FIRST_CLOCK]) for r in rows)
    tile = _median(per_tile)
    fixed = _median(kv) + _median(fill) + _median(epilogue) + _median(gaps)
    return {"ctas": len(rows), "sms": len(by_sm), "sm_ghz": round(ghz, 3), "tiles": _median([r[TILES] for r in rows]),
            "kv_us": round(_median(kv), 3), "fill_us": round(_median(fill), 3), "tile_us": round(tile, 3),
            "epilogue_us": round(_median(epilogue), 3), "stage_wait_us": round(_median(stage_wait), 3),
            "ds_store_us": round(_median(ds_store), 3), "dq_wait_us": round(_median(dq_wait), 3),
            "gap_us": round(_median(gaps), 3),
            "gap_mean_us": round(statistics.fmean(gaps), 3) if gaps else float("nan"),
            "fixed_tiles": round(fixed / tile, 2), "span_us": round(span, 1),
            "sweep_share": round(sweeps / (len(by_sm) * span), 3)}


COLUMNS = ("ctas", "sms", "tiles", "kv_us", "fill_us", "tile_us", "stage_wait_us", "dq_wait_us", "ds_store_us",
           "epilogue_us", "gap_us", "gap_mean_us", "fixed_tiles", "span_us", "sweep_share", "ms")


def probe(case: dict, registry: KernelRegistry, time_only: bool) -> dict:
    """One backward of `case` (d, S, causal, w, bias): its time, and unless `time_only` its timeline's
    summary and rows."""
    d, s = case["d"], case["S"]
    b, h = 16384 // s, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    bias = torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16, generator=gen) if case["bias"] else None
    mode = "bottom_right" if case["causal"] else None
    window = None if case["w"] < 0 else window_of(case["w"], case["causal"])
    out, lse = flashkiln.attention_forward(q, k, v, causal=mode, window_size=window, bias=bias)
    call = lambda: flashkiln.attention_backward(dout, q, k, v, out, lse, causal=mode,  # noqa: E731
                                                window_size=window, bias=bias, bias_grad=case["bias"] == "dbias",
                                                backend="hopper")
    for _ in range(3):
        call()
    ms = time_ms(call, 0, 5, flush_l2=True)  # the probe build's own time, against an A/B's
    if time_only:
        return {**case, "ms": ms}
    main = backward.PLANS.newest().launches[1]  # this call's plan's main kernel
    library = registry.library_of(main.entry)
    ctas = min(main.grid[0] * main.grid[1] * main.grid[2], CTAS)  # the CTAs past the array record nothing
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    _timeline(library, ctas, zero=True)
    flush.zero_()  # as time_ms(flush_l2=True) does before each timed call
    call()
    torch.cuda.synchronize()
    rows = _timeline(library, ctas, zero=False)
    return {**case, "kernel": main.entry.name, "ms": round(ms, 4), **summarize(rows), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--windows", type=int, nargs="+", default=[-1], help="window widths (bench.window_of); -1: none")
    parser.add_argument("--bias", nargs="+", choices=("none", "bias", "dbias"), default=["none"],
                        help="a full (B, H, S, S) bias, without or with dBias")
    parser.add_argument("--out", type=Path, help="the raw per-CTA rows, one JSON line per case")
    parser.add_argument("--time-only", action="store_true",
                        help="only the calls' times, as `ms`, one JSON line per case (for a build without the probe)")
    args = parser.parse_args()
    registry = default_registry()
    if not args.time_only:
        if PROBE not in registry.manifest.build.get("probes", []):
            raise SystemExit(f"{registry.manifest.directory} was built without the {PROBE} probe: "
                             f"generate it with --probe {PROBE} (or pass --time-only)")
        print("| d | S | causal | w | bias | " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * (5 + len(COLUMNS)))
    for d, s, causal, w, bias in itertools.product(args.dims, args.seqlens, (False, True), args.windows, args.bias):
        case = {"d": d, "S": s, "causal": causal, "w": w, "bias": None if bias == "none" else bias}
        result = probe(case, registry, args.time_only)
        if args.time_only:
            print(json.dumps(result), flush=True)
            continue
        print(f"| {d} | {s} | {causal} | {w} | {bias} | " + " | ".join(str(result[c]) for c in COLUMNS) + " |",
              flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
