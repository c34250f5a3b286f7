"""Peak device memory of one forward + backward through autograd, beside torch's cuDNN and flash
(FlashAttention-2) backends: B = 1, H = 16, bf16, d 64, 128 and 256, S 16k and 32k, causal off.

Each number is the peak of torch's caching allocator during the step minus what was allocated
before it (q, k, v and dout), in MiB: the step's outputs, gradients and every workspace. A
backend that cannot run a shape is reported as such.
Usage: tools/pyenv.sh python3 bench/memory.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkiln
from host_overhead import training_step  # bench/ is on sys.path when one of its scripts runs

SHAPES = [(d, s) for d in (64, 128, 256) for s in (16384, 32768)]
HEADS = 16


def _torch_backend(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)
    return attend


BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "flashkiln": flashkiln.scaled_dot_product_attention,
    "cudnn": _torch_backend(SDPBackend.CUDNN_ATTENTION),
    "flash (FA2)": _torch_backend(SDPBackend.FLASH_ATTENTION),
}


def peak_mib(attend: Callable[..., torch.Tensor], d: int, s: int) -> float:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, HEADS, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    step = training_step(attend, leaves, dout)
    step()  # warm: plans, kernels and cuDNN's graph exist before the measured step
    for t in leaves:
        t.grad = None
    return step_peak_mib(step)


def step_peak_mib(step: Callable[[], None]) -> float:
    """Peak memory of one call of `step` above what was allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/bench-memory"))
    args = parser.parse_args()
    rows = []
    for d, s in SHAPES:
        row: dict[str, object] = {"d": d, "S": s}
        for name, attend in BACKENDS.items():
            try:
                row[name] = round(peak_mib(attend, d, s), 1)
            except (RuntimeError, flashkiln.FlashkilnError) as exc:
                row[name] = f"cannot run ({str(exc).splitlines()[0][:60]})"
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(rows, indent=1))
    names = list(BACKENDS)
    lines = [f"Peak memory of forward + backward above the inputs, MiB (B = 1, H = {HEADS}, bf16, not causal)", "",
             "| d | S | " + " | ".join(names) + " | flashkiln / cudnn |", "|---" * (3 + len(names)) + "|"]
    for row in rows:
        ratio = (f"{row['flashkiln'] / row['cudnn']:.2f}" if all(isinstance(row[n], float) for n in ("flashkiln", "cudnn"))
                 else "-")
        lines.append(f"| {row['d']} | {row['S']} | " + " | ".join(str(row[n]) for n in names) + f" | {ratio} |")
    (args.out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
