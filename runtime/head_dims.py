"""Head dims that were not generated: the next larger generated kernel computes them.

A call whose (d_qk, d_v) has no kernel runs the smallest generated pair that covers both, on
copies of q, k (and v, out, dO) zero-padded along the head dim, with the scale of the real d_qk;
its results are copied back without the padding. Zero columns add nothing to q kᵀ, and give zero
output and gradient columns, so the result is exact (the same arithmetic on the same values),
at the cost of those copies.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import VariantNotFoundError

MAX_HEAD_DIM = 256  # the largest head dim any kernel computes


def dims_text(d_qk: int, d_v: int) -> str:
    return f"{d_qk}" if d_qk == d_v else f"{d_qk}x{d_v}"


def kernel_dims(d_qk: int, d_v: int, generated: frozenset[tuple[int, int]], what: str) -> tuple[int, int]:
    """The head dims of the kernel that computes (d_qk, d_v): themselves when generated, else the
    smallest generated pair at least as large in both. `what` names the kernels in the error."""
    if (d_qk, d_v) in generated:
        return d_qk, d_v
    covering = [dims for dims in generated if dims[0] >= d_qk and dims[1] >= d_v]
    if not covering:
        have = ", ".join(dims_text(*dims) for dims in sorted(generated)) or "none"
        raise VariantNotFoundError(
            f"no generated {what} kernel computes head dims {dims_text(d_qk, d_v)} (generated for this GPU: {have}); "
            "add a head dim at least this large to the specs (`head_dims:` of a variant group in specs/*.yaml, "
            "with its tuning row) and run `make generate`")
    return min(covering, key=lambda dims: (dims[0] + dims[1], dims))


def padded(t: torch.Tensor, d: int) -> torch.Tensor:
    """`t` zero-padded along its last dim to `d` (a copy), or `t` itself when it is that wide."""
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))
