"""The additive score bias (`attn_mask`): checks, the layout the kernels read, and dBias.

Scores are `scale * q kᵀ + bias`. The bias broadcasts to (B, H_q, S_q, S_k) like
`F.scaled_dot_product_attention`'s attn_mask: broadcast dims become zero strides, never copies;
a boolean mask (True keeps) becomes a 0/-inf bias of its own shape. The kernels read the key dim
in 16-byte pieces, so rows must be 16-byte aligned and readable up to the next 16 bytes: a bias
that is not is copied into padded rows first. dBias is the score gradient dS, which the workspace
route already keeps in a dense (B, H_q, S_q, S_k) layout: a full bias's gradient is a view of it,
a broadcast one its sum over the broadcast dims (a fixed-order torch reduction, so deterministic).
The hopper backward reduces a broadcast bias's dS in its main kernel instead (`reduction`), so
that no dense dS exists: a bias broadcast over the rows gets each CTA's column sums (B, H_q, S_k),
one broadcast over batch entries or heads alone the sum of its sharing pairs' dS per tile from a
kernel of its own (TILES), or where the family keeps it in the main kernel an fp32 sum in its own
shape, which the CTAs that share a slice add to (in a fixed order when deterministic).

A bias constant along the keys (its key dim is 1: broadcast, or S_k = 1) needs no dS at all: a
row's dS sums to `mass_i * dLSE_i + p_i * delta_i` in exact arithmetic, where mass_i = sum_j P_ij,
p_i the sink's probability and delta_i = sum_j P_ij dP_ij (0 without a sink: shifting a row's
scores moves only its LSE). Summing rounded dS tiles instead turns the rounding of delta (from the
forward's bf16 O) into an error that grows with the rows summed; the closed form uses the kernel's
exact fp32 sums of p_i * P_ij * dP_ij (BwdParams::dsink_parts) where the rows are summed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import inputs
from .launch import ceil_div

_PIECE_BYTES = 16


@dataclass(frozen=True)
class KernelBias:
    tensor: torch.Tensor  # (B, H_q, S_q, S_k) view the kernels read: zero strides where it broadcasts
    shape: tuple[int, ...]  # the caller's shape: dBias comes back in it
    broadcast_dims: tuple[int, ...]  # dims of (B, H_q, S_q, S_k) that dBias sums over

    def stride_fields(self) -> dict[str, int]:
        return inputs.stride_fields("bias", self.tensor)

    @property
    def key_constant(self) -> bool:
        """The caller's bias has a key dim of 1: dBias has a closed form (key_constant_gradient)."""
        return _key_constant(self.shape)

    @property
    def rows_summed(self) -> bool:
        """dBias sums over the query rows (the caller's bias has a row dim of 1)."""
        return _as_4d(self.shape)[2] == 1


def _padded_row(elements: int, element_size: int = 2) -> int:
    """A row of `elements` rounded up to whole 16-byte pieces, in elements."""
    per_piece = _PIECE_BYTES // element_size
    return ceil_div(elements, per_piece) * per_piece


def _readable_in_pieces(t: torch.Tensor) -> bool:
    """16-byte pieces of every row lie inside t's storage (the last piece may run past S_k)."""
    if not inputs.is_kernel_layout(t):
        return False
    last_row_start = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape[:-1], t.stride()[:-1]))
    row_end = last_row_start + _padded_row(t.shape[-1], t.element_size())
    return row_end * t.element_size() <= t.untyped_storage().nbytes()


def prepare_bias(bias: torch.Tensor, scores: tuple[int, int, int, int], q: torch.Tensor) -> KernelBias:
    """Check `bias` against the scores' shape (B, H_q, S_q, S_k) and q's dtype and device, and give
    the view the kernels read."""
    full = tuple(scores)
    if not isinstance(bias, torch.Tensor):
        inputs.fail(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.device != q.device:
        inputs.fail(f"bias is on {bias.device}, the inputs on {q.device}")
    if bias.dtype != torch.bool and bias.dtype != q.dtype:
        inputs.fail(f"bias must be {q.dtype} (the inputs' dtype) or torch.bool, got {bias.dtype}")
    if bias.dim() > 4 or any(n not in (1, f) for n, f in zip(bias.shape[::-1], full[::-1])):
        inputs.fail(f"bias of shape {tuple(bias.shape)} does not broadcast to (B, H_q, S_q, S_k) = {full}")
    shape = tuple(bias.shape)
    bias = additive(bias, q.dtype)
    bias4 = bias[(None,) * (4 - bias.dim())]
    broadcast = _broadcast_dims(shape, full)
    if bias4.shape[3] != full[3]:
        bias4 = bias4.expand(*bias4.shape[:3], full[3])  # a per-row constant: materialized below
    if not _readable_in_pieces(bias4) or bias4.stride(3) != 1:
        padded = torch.empty((*bias4.shape[:3], _padded_row(full[3], bias4.element_size())), dtype=q.dtype,
                             device=q.device)
        bias4 = padded[..., :full[3]].copy_(bias4)
    return KernelBias(bias4.expand(full), shape, broadcast)


def additive(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`bias` as an additive bias: a bool mask (True keeps) becomes 0 / -inf in `dtype`, of its own
    shape; anything else is returned as it is (prepare_bias checks it)."""
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.bool:
        return bias
    return torch.zeros(bias.shape, dtype=dtype, device=bias.device).masked_fill_(~bias, float("-inf"))


def ds_row_elements(seqlen_k: int) -> int:
    """Elements per row of the (2-byte) dS workspace: S_k in whole 16-byte pieces (bwd_tiles.hpp)."""
    return _padded_row(seqlen_k)


# How a kernel that reduces dS itself (the hopper backward) gives dBias of a key-varying bias:
# every dS tile into the dense workspace (a full bias, whose dBias it is), column sums per (batch,
# head) (a bias broadcast over the rows), or one fp32 sum per slice of the bias (broadcast over
# batch entries or heads alone). TILES serves SUM's biases where a kernel of their own sums the
# sharing pairs' dS per tile (the hopper family's bwd_dbias): the bias's own planes in its type.
STORE, COLUMNS, SUM, TILES = "ds_workspace", "dbias_columns", "dbias_sum", "dbias_tiles"


def reduction(bias: KernelBias, packed: bool) -> str:
    """Which of STORE, COLUMNS and SUM serves dBias of `bias` (not key-constant). The CTAs of a
    packed batch's sequences visit different tiles, so that they cannot take turns on a bias
    shared by batch entries: those store dS, which torch sums."""
    dims = bias.broadcast_dims
    if 2 in dims:
        return COLUMNS
    if not dims or (packed and 0 in dims):
        return STORE
    return SUM


def sum_shape(bias: KernelBias) -> tuple[int, int, int, int]:
    """The SUM accumulator (and TILES's planes): the bias's (batch entries, heads, S_q) by S_k in
    8-element pieces."""
    b, hq, sq, sk = bias.tensor.shape
    return (1 if 0 in bias.broadcast_dims else b, 1 if 1 in bias.broadcast_dims else hq, sq, ds_row_elements(sk))


def workspace_planes(workspace: torch.Tensor, b: int, hq: int, sq: int, sk: int) -> torch.Tensor:
    """The STORE workspace as dS of (B, H_q, S_q, S_k) scores: rows padded to 16 bytes (what the
    kernels' planes are)."""
    return workspace.view(b, hq, sq, ds_row_elements(sk))[..., :sk]


def bias_gradient(scratch: dict[str, torch.Tensor | None], bias: KernelBias) -> torch.Tensor:
    """dBias in the bias's own shape from what the kernels left in `scratch` (`reduction`'s role,
    or the workspace route's dense dS): a view of the dense dS for a full bias, else the sum over
    the broadcast dims that the kernels have not already taken (fixed-order torch reductions)."""
    b, hq, sq, sk = bias.tensor.shape
    dtype = bias.tensor.dtype
    for role in (SUM, TILES):
        if scratch.get(role) is not None:
            return scratch[role][..., :sk].to(dtype).reshape(bias.shape)
    if scratch.get(COLUMNS) is not None:
        columns, dims = scratch[COLUMNS][:, :, None, :], tuple(d for d in bias.broadcast_dims if d < 2)
        return (columns.sum(dim=dims, keepdim=True) if dims else columns).to(dtype).reshape(bias.shape)
    ds = workspace_planes(scratch[STORE], b, hq, sq, sk)
    if bias.broadcast_dims:
        ds = ds.sum(dim=bias.broadcast_dims, keepdim=True, dtype=torch.float32).to(dtype)
    return ds.reshape(bias.shape)


def key_constant_gradient(bias: KernelBias, lse: torch.Tensor, delta: torch.Tensor, dlse: torch.Tensor | None,
                          sink: torch.Tensor | None, sink_parts: torch.Tensor | None,
                          valid: torch.Tensor | None) -> torch.Tensor:
    """dBias of a key-constant bias (see the module docstring) from per-row (B, H_q, S_q) fp32 lse,
    the kernels' delta (dLSE already subtracted) and dlse, rows outside `valid` (packed batches)
    counting nothing. `sink_parts` (B, H_q, tiles): the kernel's sums of p * P * dP, given with a sink."""
    neg_inf = torch.isneginf(lse)
    p = torch.zeros_like(lse) if sink is None else torch.exp(sink.to(lse.dtype)[None, :, None] - lse)
    rows = torch.zeros_like(lse)
    if dlse is not None:
        rows = torch.where(neg_inf, 0.0, 1.0 - p) * dlse
        delta = delta + dlse  # sum_j P_ij dP_ij, as the rounded O gives it
    exact_rows = sink is not None and bias.rows_summed
    if sink is not None and not exact_rows:
        rows = rows + p * delta
    if valid is not None:
        rows = torch.where(valid, rows, 0.0)
    if exact_rows:
        rows = rows.sum(dim=2, keepdim=True) + sink_parts.sum(dim=2, keepdim=True)
    dims = tuple(d for d in bias.broadcast_dims if d < 2 or (d == 2 and not exact_rows))
    if dims:
        rows = rows.sum(dim=dims, keepdim=True)
    return rows.to(bias.tensor.dtype).reshape(bias.shape)


def empty_bias_gradient(bias: torch.Tensor, scores: tuple[int, int, int, int], q: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor with the shape and strides bias_gradient gives (for the custom op's fake)."""
    if _key_constant(tuple(bias.shape)) or _broadcast_dims(tuple(bias.shape), scores):
        return q.new_empty(bias.shape)
    rows = q.new_empty((*scores[:3], ds_row_elements(scores[3])))
    return rows[..., :scores[3]].reshape(bias.shape)


def _as_4d(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1,) * (4 - len(shape)) + tuple(shape)


def _key_constant(shape: tuple[int, ...]) -> bool:
    return _as_4d(shape)[3] == 1


def _broadcast_dims(shape: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, ...]:
    """Dims of (B, H_q, S_q, S_k) along which a bias of `shape` broadcasts."""
    shape4 = _as_4d(shape)
    return tuple(i for i in range(4) if shape4[i] == 1 and full[i] != 1)
