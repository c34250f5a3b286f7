"""Hopper forwards for Nsight Compute: one call without a bias and one with a full bias, same shape.

ncu --clock-control none --kernel-name regex:flashkiln_fwd_hopper \
    tools/pyenv.sh python3 tools/profile_fwd.py [d] [seqlen] [kernel dir]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import flashkiln
from flashkiln.registry import KernelRegistry


def main() -> None:
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    registry = KernelRegistry(Path(sys.argv[3])) if len(sys.argv) > 3 else None
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16)
    for attn_bias in (None, bias):
        flashkiln.attention_forward(q, k, v, bias=attn_bias, backend="hopper", registry=registry)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
