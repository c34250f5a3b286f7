"""Hopper forwards for Nsight Compute: one call without a bias and (unless --no-bias) one with a
full bias, same shape (bf16, H = 2048 / d, B = 16384 / S, as in the benchmarks).

ncu --clock-control none --kernel-name regex:flashkiln_fwd_hopper \
    tools/pyenv.sh python3 tools/profile_fwd.py [d] [seqlen] [--causal] [--no-bias] [--kernel-dir DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import flashkiln
from flashkiln.registry import KernelRegistry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("d", type=int, nargs="?", default=128)
    parser.add_argument("seqlen", type=int, nargs="?", default=4096)
    parser.add_argument("--causal", action="store_true", help="top-left causal mask")
    parser.add_argument("--no-bias", action="store_true", help="skip the call with a bias")
    parser.add_argument("--kernel-dir", type=Path)
    args = parser.parse_args()
    d, s = args.d, args.seqlen
    registry = KernelRegistry(args.kernel_dir) if args.kernel_dir else None
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    biases = [None] if args.no_bias else [None, torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16)]
    for bias in biases:
        flashkiln.attention_forward(q, k, v, bias=bias, causal="top_left" if args.causal else None,
                                    backend="hopper", registry=registry)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
