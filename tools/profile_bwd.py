"""One backward of flashkiln and one of torch's flash backend on the same shape, for Nsight Compute.

ncu --clock-control none --kernel-name regex:'flashkiln_bwd_hopper|flash_bwd_dq_dk_dv' \
    tools/pyenv.sh python3 tools/profile_bwd.py [d] [seqlen] [causal|none] [window]
(window W: flashkiln's calls with window (W, W), causal (W, 0); torch's flash backend has no window,
so its backward then stays full.)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkiln

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench import window_of  # noqa: E402  (bench/ is a folder of scripts, not a package)


def main() -> None:
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
    width = int(sys.argv[4]) if len(sys.argv) > 4 else None
    window = None if width is None else window_of(width, causal)
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mode = "top_left" if causal else None
    out, lse = flashkiln.attention_forward(q, k, v, causal=mode, window_size=window)
    flashkiln.attention_backward(dout, q, k, v, out, lse, causal=mode, window_size=window)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(dout)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
