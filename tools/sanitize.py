"""A few small forward and backward calls with ragged shapes, for compute-sanitizer (memcheck, racecheck).

Run on a GPU machine: compute-sanitizer --tool memcheck tools/pyenv.sh python3 tools/sanitize.py
(set PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor is its own allocation).
"""
from __future__ import annotations

import os
import sys
from unittest import mock

import torch

import flashkiln
from flashkiln.dq_routes import ROUTE_ENV, ROUTES

CASES = [  # (B, H_q, H_kv, S_q, S_k, d, causal, bias shape or None)
    (1, 2, 1, 17, 129, 64, None, (1, 1, 1, 129)),
    (1, 2, 2, 129, 17, 128, "bottom_right", (1, 2, 129, 17)),
    (2, 3, 1, 113, 200, 256, "top_left", None),
    (1, 1, 1, 1, 1, 128, None, None),
]


def main() -> int:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else len(CASES)
    for b, hq, hkv, sq, sk, d, causal, bias_shape in CASES[:limit]:
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16)
        bias = None if bias_shape is None else torch.randn(bias_shape, device="cuda", dtype=torch.bfloat16)
        sink = torch.linspace(-1, 1, hq, device="cuda") if bias is None else None
        out, lse = flashkiln.attention_forward(q, k, v, causal=causal, bias=bias, sink=sink)
        grads = []
        # A biased backward runs the deterministic routes only (and dBias the workspace one).
        for route in ROUTES if bias is None else ("ordered", "workspace"):
            with mock.patch.dict(os.environ, {ROUTE_ENV: route}):
                grads += flashkiln.attention_backward(torch.randn_like(out), q, k, v, out, lse, causal=causal,
                                                      deterministic=route != "atomic", bias=bias, sink=sink,
                                                      bias_grad=bias is not None and route == "workspace")
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
        print(f"B={b} Hq={hq} Hkv={hkv} Sq={sq} Sk={sk} d={d} causal={causal} bias={bias_shape}: finite={finite}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
