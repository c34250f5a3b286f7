"""A few small forward and backward calls with ragged shapes, dense and packed (varlen), for
compute-sanitizer (memcheck, racecheck).

Run on a GPU machine: compute-sanitizer --tool memcheck tools/pyenv.sh python3 tools/sanitize.py
(set PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor is its own allocation). `--only dense`
or `--only packed` runs one of the two case lists, so that memcheck's slow passes can run side by
side in two processes.
"""
from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

import flashkiln
from flashkiln.dq_routes import ROUTE_ENV, ROUTES

# (B, H_q, H_kv, S_q, S_k, d or (d_qk, d_v), causal, bias shape or None, score modifications);
# racecheck runs the first 10 (tools/device_run.sh)
CASES = [
    (1, 2, 1, 130, 200, 256, "bottom_right", None, {}),  # d 256: the hopper backward's split columns
    (1, 2, 1, 129, 200, 256, None, (1, 1, 1, 200), {}),  # ... with a bias: key sums joined across warpgroups
    (1, 2, 1, 130, 200, (192, 128), "bottom_right", (1, 2, 130, 200), {}),  # split columns, d_qk != d_v
    (1, 2, 2, 200, 300, 128, "top_left", None, {}),  # the hopper forward's second tuning (128 keys)
    (1, 2, 1, 17, 129, 64, None, (1, 1, 1, 129), {}),
    (1, 2, 1, 200, 300, 64, "bottom_right", (1, 2, 200, 300), {}),  # d 64 with a bias: dS in its bias tiles
    (1, 2, 2, 129, 17, 128, "bottom_right", (1, 2, 129, 17), {}),
    # dBias shared by batch entries: bwd_dbias, 144 tiles (CTAs that take two, tiles no row sees)
    (2, 3, 1, 1500, 200, 128, "top_left", (1, 3, 1500, 200), {}),
    (2, 4, 2, 100, 130, 64, None, (2, 1, 100, 130), {}),  # ... by heads, per batch entry, at d 64: bwd_dbias
    (2, 4, 2, 100, 130, 128, "bottom_right", (2, 1, 100, 130), {}),  # ... at d 128: the main kernel's sum
    (1, 3, 1, 500, 500, 64, "top_left", None, {}),  # 192-row tiles whose warpgroups skip key tiles
    (2, 3, 1, 113, 200, 256, "top_left", None, {}),
    (1, 1, 1, 1, 1, 128, None, None, {}),
    (1, 2, 1, 200, 200, 64, "top_left", None, {}),  # ... and at d 64 (128 query rows)
    (1, 2, 2, 33, 40, 64, "bottom_right", (1, 2, 33, 1), {}),  # a key-constant bias: dBias in closed form
    (1, 2, 1, 300, 260, 128, None, None, {"window_size": (70, 30)}),  # first key tiles above 0, both edges
    (1, 2, 1, 300, 200, 64, None, None, {}),  # deterministic: staggered sweeps (5 query tiles, 2 key tiles)
    (1, 2, 2, 257, 257, 64, "bottom_right", None, {"window_size": (100, 0), "softcap": 20.0}),
    (1, 2, 2, 100, 150, 96, "top_left", (1, 1, 1, 150), {}),  # d 96: 64-byte swizzled boxes
    (1, 2, 1, 300, 300, 256, "bottom_right", None, {"window_size": (100, 0), "softcap": 30.0}),  # Gemma 2
]
# Packed batches: (query lengths, key lengths, H_q, H_kv, d, causal, bias?), with zero-length
# sequences and a token past the last sequence.
PACKED_CASES = [
    ((17, 0, 130), (129, 5, 0), 2, 1, 64, "bottom_right", True),
    ((1, 70), (64, 70), 2, 2, 128, "top_left", False),
    ((17, 0, 130), (129, 5, 0), 2, 1, 256, "bottom_right", False),
    ((17, 0, 130), (129, 5, 0), 2, 1, 96, None, True),
]


def backward_on_every_route(out, q, k, v, lse, bias, **kwargs) -> list[torch.Tensor]:
    """The backward with the LSE's gradient, and dSink where there is a sink: on the hopper family
    deterministic and not (its ordered and atomic routes), with dBias where there is a bias, where
    it has the call (it names what it lacks otherwise); then each route of the portable family,
    where a biased backward runs the deterministic ones only (and dBias the workspace one)."""
    grads = []
    sink_grad = kwargs.get("sink") is not None
    for deterministic in (False, True):
        try:
            grads += flashkiln.attention_backward(torch.randn_like(out), q, k, v, out, lse, dlse=torch.randn_like(lse),
                                                  backend="hopper", bias=bias, bias_grad=bias is not None,
                                                  sink_grad=sink_grad,
                                                  deterministic=deterministic, **kwargs)
        except (flashkiln.UnsupportedError, flashkiln.VariantNotFoundError):
            pass
    for route in ROUTES if bias is None else ("ordered", "workspace"):
        with mock.patch.dict(os.environ, {ROUTE_ENV: route}):
            try:
                grads += flashkiln.attention_backward(
                    torch.randn_like(out), q, k, v, out, lse, dlse=torch.randn_like(lse),
                    deterministic=route != "atomic", bias=bias, bias_grad=bias is not None and route == "workspace",
                    sink_grad=sink_grad, backend="portable", **kwargs)
            except (flashkiln.UnsupportedError, flashkiln.VariantNotFoundError):
                pass  # a score modification the specs give no kernels for on this route
    return grads


def main() -> int:
    parser = argparse.ArgumentParser(description="Ragged forward and backward calls for compute-sanitizer.")
    parser.add_argument("limit", nargs="?", type=int, default=len(CASES), help="the first N cases of each list")
    parser.add_argument("--only", choices=("dense", "packed"), help="one case list (default: both)")
    args = parser.parse_args()
    dense = CASES[:args.limit] if args.only != "packed" else []
    packed_cases = PACKED_CASES[:args.limit] if args.only != "dense" else []
    for b, hq, hkv, sq, sk, d, causal, bias_shape, mods in dense:
        d_qk, d_v = d if isinstance(d, tuple) else (d, d)
        q = torch.randn(b, hq, sq, d_qk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, sk, d_qk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, sk, d_v, device="cuda", dtype=torch.bfloat16)
        bias = None if bias_shape is None else torch.randn(bias_shape, device="cuda", dtype=torch.bfloat16)
        sink = torch.linspace(-1, 1, hq, device="cuda") if bias is None else None
        out, lse = flashkiln.attention_forward(q, k, v, causal=causal, bias=bias, sink=sink, **mods)
        grads = backward_on_every_route(out, q, k, v, lse, bias, causal=causal, sink=sink, **mods)
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
        print(f"B={b} Hq={hq} Hkv={hkv} Sq={sq} Sk={sk} d={d} causal={causal} bias={bias_shape} {mods}: "
              f"finite={finite}", flush=True)
    for lengths_q, lengths_k, hq, hkv, d, causal, with_bias in packed_cases:
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                      for n in (lengths_q, lengths_k))
        packed = flashkiln.PackedBatch(cu_q, cu_k, max(lengths_q), max(lengths_k))
        q = torch.randn(sum(lengths_q) + 1, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(lengths_k) + 1, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        bias = torch.randn(len(lengths_q), hq, max(lengths_q), max(lengths_k), device="cuda",
                           dtype=torch.bfloat16) if with_bias else None
        sink = torch.linspace(-1, 1, hq, device="cuda")
        out, lse = flashkiln.attention_forward(q, k, v, causal=causal, bias=bias, sink=sink, packed=packed)
        grads = backward_on_every_route(out, q, k, v, lse, bias, causal=causal, sink=sink, packed=packed)
        torch.cuda.synchronize()
        inside = slice(0, sum(lengths_q))
        finite = bool(torch.isfinite(out[inside]).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
        print(f"packed q={lengths_q} k={lengths_k} Hq={hq} Hkv={hkv} d={d} causal={causal} bias={with_bias}: "
              f"finite={finite}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
