"""Packed variable-length batches: the layout of flash_attn_varlen_func.

q is (total_q, H_q, d), k and v (total_k, H_kv, d): the sequences lie back to back along the
token dim, sequence b being tokens cu_seqlens_q[b] to cu_seqlens_q[b + 1] of q (and likewise of
k, v). The kernels see the token tensors as one batch entry of (1, H, total, d) and read the
sequence bounds from cu_seqlens on the device, so nothing waits for the host; the grid covers
the longest sequences (max_seqlen_q/k) and CTAs past a shorter one return at once.

The values of cu_seqlens are not read on the host (that would synchronize): they must start at
0 or later, never decrease, end at most at total, and differ by at most max_seqlen. The kernels
clamp them into those bounds, so breaking this gives wrong values, never a stray memory access;
PackedBatch.validate (varlen_attention(..., validate=True)) checks them, at the cost of a sync.
Tokens in no sequence (before the first or past the last) get O = 0 and LSE = -inf, as a row that
sees no key, and zero gradients, also in buffers the caller passes (out=, dq=, ...): the kernels
write the tokens inside sequences only, and the host fills the rest. The hopper forward (its
`packed: true` variants) reads whole key tiles, so past a sequence's end it may load tokens of the
next one or of no sequence, but it masks their scores and zeroes their values before they are used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import inputs
from .params import DQ_ACCUM_ROW_ALIGN

_MAX_TOKENS = 2**31 - 1  # token counts travel as int32
TOKENS = "(total_tokens, heads, head_dim)"  # the layout of q, k, v, out and their gradients


@dataclass(frozen=True)
class PackedBatch:
    """The sequence boundaries of a packed batch (see the module docstring)."""

    cu_seqlens_q: torch.Tensor  # int32 (batch + 1,)
    cu_seqlens_k: torch.Tensor  # int32 (batch + 1,)
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    def validate(self, total_q: int, total_k: int) -> None:
        """Check the boundaries' values against the token counts: InvalidInputError naming the first
        problem. It reads cu_seqlens on the host, so it waits for the GPU: an opt-in check (the
        kernels themselves only clamp, see the module docstring)."""
        for name, cu, total, longest in (("cu_seqlens_q", self.cu_seqlens_q, total_q, self.max_seqlen_q),
                                         ("cu_seqlens_k", self.cu_seqlens_k, total_k, self.max_seqlen_k)):
            offsets = cu.tolist()
            if offsets[0] < 0 or offsets[-1] > total:
                inputs.fail(f"{name} runs from {offsets[0]} to {offsets[-1]}, outside the {total} tokens")
            for b, (start, end) in enumerate(zip(offsets, offsets[1:])):
                if not 0 <= end - start <= longest:
                    inputs.fail(f"{name}: sequence {b} has {end - start} tokens ({start} to {end}), "
                                f"not in [0, max_seqlen = {longest}]")


@dataclass(frozen=True)
class BatchShape:
    """What the kernels see of a call's batch, dense or packed (templates/.../common/sequence.hpp)."""

    batch: int
    seqlen_q: int  # packed: the longest query sequence
    seqlen_k: int
    total_q: int  # query rows per (batch entry, head) of the tensors: seqlen_q when dense
    total_k: int
    packed: PackedBatch | None

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, packed: PackedBatch | None) -> "BatchShape":
        """From (B, H, S, d) tensors, which for a packed batch are the (1, H, total, d) views."""
        if packed is None:
            return cls(q.shape[0], q.shape[2], k.shape[2], q.shape[2], k.shape[2], None)
        return cls(packed.batch, packed.max_seqlen_q, packed.max_seqlen_k, q.shape[2], k.shape[2], packed)

    def scores(self, heads_q: int) -> tuple[int, int, int, int]:
        """(B, H_q, S_q, S_k): the shape of the scores, and so of a bias and of dBias."""
        return self.batch, heads_q, self.seqlen_q, self.seqlen_k

    def is_empty(self) -> bool:
        """No query row or no key: nothing for a kernel to compute."""
        return self.batch == 0 or self.seqlen_q == 0 or self.seqlen_k == 0 or self.total_q == 0 \
            or self.total_k == 0

    @property
    def seqlen_q_rounded(self) -> int:
        """seqlen_q rounded up to DQ_ACCUM_ROW_ALIGN."""
        return -(-self.seqlen_q // DQ_ACCUM_ROW_ALIGN) * DQ_ACCUM_ROW_ALIGN

    @property
    def dq_accum_rows(self) -> int:
        """Rows per head of the fp32 dQ accumulator (common/sequence.hpp): dense, seqlen_q_rounded;
        packed, total_q + batch * DQ_ACCUM_ROW_ALIGN (sequence b from cu_seqlens_q[b] + b * align)."""
        return self.seqlen_q_rounded if self.packed is None else self.total_q + self.batch * DQ_ACCUM_ROW_ALIGN

    def params(self) -> dict[str, int]:
        """The params fields that describe the batch (FwdParams and BwdParams share them)."""
        return {
            "batch": self.batch, "seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k,
            "total_q": self.total_q, "total_k": self.total_k,
            "cu_seqlens_q": 0 if self.packed is None else self.packed.cu_seqlens_q.data_ptr(),
            "cu_seqlens_k": 0 if self.packed is None else self.packed.cu_seqlens_k.data_ptr(),
        }


def check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch) -> None:
    """Check the token tensors and the boundaries' dtype, shape and device (not their values)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        batched_view(name, t, TOKENS)
    for name, cu in (("cu_seqlens_q", packed.cu_seqlens_q), ("cu_seqlens_k", packed.cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            inputs.fail(f"{name} must be a 1-D torch.int32 tensor of batch + 1 offsets, got "
                        + (f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor)
                           else type(cu).__name__))
        if cu.device != q.device:
            inputs.fail(f"{name} is on {cu.device}, q on {q.device}")
        if not cu.is_contiguous():
            inputs.fail(f"{name} must be contiguous")
    if packed.cu_seqlens_q.numel() != packed.cu_seqlens_k.numel():
        inputs.fail(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                    f"{packed.cu_seqlens_q.numel()} and {packed.cu_seqlens_k.numel()}")
    for name, n in (("max_seqlen_q", packed.max_seqlen_q), ("max_seqlen_k", packed.max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            inputs.fail(f"{name} must be a non-negative int, got {n!r}")
    if q.shape[0] > _MAX_TOKENS or k.shape[0] > _MAX_TOKENS:
        inputs.fail(f"at most {_MAX_TOKENS} tokens per call, got {q.shape[0]} queries and {k.shape[0]} keys")


def batched_view(name: str, t: torch.Tensor, what: str) -> torch.Tensor:
    """as_batched(t) of a caller's token tensor (`what` "(total, H, d)") or lse ("(H, total)"), checked."""
    dims = what.count(",") + 1
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        inputs.fail(f"with cu_seqlens, {name} must be a {dims}-D {what} tensor, got "
                    + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
    return as_batched(t)


def as_batched(t: torch.Tensor) -> torch.Tensor:
    """The (1, H, total, d) view of a (total, H, d) token tensor (a (1, H, total) view of (H, total))."""
    return t.unsqueeze(0) if t.dim() == 2 else t.unsqueeze(0).transpose(1, 2)


def as_tokens(t: torch.Tensor) -> torch.Tensor:
    """The inverse of as_batched: (total, H, d) from (1, H, total, d), (H, total) from (1, H, total)."""
    return t[0] if t.dim() == 3 else t[0].transpose(0, 1)


def token_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Bool (total,): the tokens inside a sequence of `cu_seqlens` (computed on the device, no sync)."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    if cu_seqlens.numel() < 2:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return (tokens >= cu_seqlens[0]) & (tokens < cu_seqlens[-1])


def sequence_rows(rows: tuple[torch.Tensor | None, ...], packed: PackedBatch
                  ) -> tuple[tuple[torch.Tensor | None, ...], torch.Tensor]:
    """Per-token (1, H, total_q) tensors as per-sequence (batch, H, max_seqlen_q) ones (the layout of
    a dense batch's rows), and the bool (batch, 1, max_seqlen_q) of the rows that exist; gathered on
    the device, no sync."""
    cu = packed.cu_seqlens_q.long()
    index = cu[:-1, None] + torch.arange(packed.max_seqlen_q, device=cu.device)[None, :]
    valid = index < cu[1:, None]
    total = next(t for t in rows if t is not None).shape[2]
    index = index.clamp(max=max(total - 1, 0))
    gathered = tuple(None if t is None else t[0][:, index].transpose(0, 1) for t in rows)
    return gathered, valid[:, None, :]
