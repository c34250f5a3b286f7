"""Reference attention in plain PyTorch and the comparison rules of shared/CONVENTIONS.md."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch


def seed_of(*parts: object) -> int:
    """A test case's input seed, derived from its parameters (stable across runs and machines)."""
    return zlib.crc32(repr(parts).encode())


def repro_line(file: str, test: str, **kw) -> str:
    """How to rerun one failing case, printed with every assertion message."""
    return f"repro: pytest -q 'tests/{file}::{test}'  ({', '.join(f'{k}={v!r}' for k, v in kw.items())})"


def check_window(window: object) -> tuple[int, int] | None:
    """The reference's own reading of a window_size: (left, right) ints >= -1 (-1: unbounded on that
    side), or None for no window; (-1, -1) is no window too. Anything else is a test bug."""
    if window is None:
        return None
    assert isinstance(window, tuple) and len(window) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in window), f"bad window {window!r}"
    return None if window == (-1, -1) else window


def visible_mask(sq: int, sk: int, causal: str | None, device: torch.device, *,
                 window: tuple[int, int] | None = None) -> torch.Tensor | None:
    """(S_q, S_k) bool, True where key j is visible to query i; None when everything is.

    window (FlashAttention's window_size): (left, right), -1 unbounded on that side; row i sees key j
    iff i + off - left <= j <= i + off + right, off = S_k - S_q (bottom-right alignment) unless
    causal is "top_left" (then 0). A causal mask sets right to 0. None or (-1, -1): no window.
    """
    window = check_window(window)
    if causal is None and window is None:
        return None
    offset = 0 if causal == "top_left" else sk - sq
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    if window is None:
        return j <= i + offset
    left, right = window
    if causal is not None:
        right = 0
    mask = torch.ones((sq, sk), dtype=torch.bool, device=device)
    if right >= 0:
        mask = mask & (j <= i + offset + right)
    if left >= 0:
        mask = mask & (j >= i + offset - left)
    return mask


@dataclass(frozen=True)
class Reference:
    out: torch.Tensor  # (B, H_q, S_q, d_v)
    lse: torch.Tensor  # (B, H_q, S_q), fp32; -inf where a row sees no key
    empty_rows: torch.Tensor  # (B, H_q, S_q) bool: rows that see no key
    lse_graph: torch.Tensor  # the LSE in the compute dtype, differentiable (for dLSE)


def as_additive(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True keeps) as a 0/-inf bias; an additive bias in `dtype`."""
    if bias is None:
        return None
    if bias.dtype == torch.bool:
        return torch.zeros(bias.shape, dtype=dtype, device=bias.device).masked_fill(~bias, float("-inf"))
    return bias if bias.dtype == dtype else bias.to(dtype)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str | None, scale: float | None,
                        compute_dtype: torch.dtype, bias: torch.Tensor | None = None,
                        sink: torch.Tensor | None = None, *, window: tuple[int, int] | None = None,
                        softcap: float | None = None) -> Reference:
    """softmax(scale q kᵀ + bias) v computed in `compute_dtype` (fp32 for REF32, the input dtype for
    REFLP); `bias` broadcasts to the scores, a bool mask keeps where True; `window`: a sliding
    window (left, right) as visible_mask's, or None; `softcap` c: the scaled scores z become
    c * tanh(z / c) before the bias and the mask (FlashAttention's order).

    Rows that see no key follow the convention (O = 0, LSE = -inf) instead of PyTorch's NaN.
    """
    hq, hkv = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (t if t.dtype == compute_dtype else t.to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + as_additive(bias, compute_dtype)
    mask = visible_mask(q.shape[2], k.shape[2], causal, q.device, window=window)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    keys_lse = torch.logsumexp(scores.detach().float(), dim=-1)
    empty = torch.isneginf(keys_lse) if k.shape[2] else torch.ones_like(keys_lse, dtype=torch.bool)
    # A row that sees nothing gets finite scores before the softmax (no NaN, also in autograd) and
    # its output is then zeroed, which zeroes its gradients too.
    scores = scores.masked_fill(empty[..., None], 0.0)
    if sink is not None:
        # The sink is one more column of the softmax, with no value (dropped after it).
        column = sink.to(compute_dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        lse = torch.logsumexp(torch.cat([scores.detach().float().masked_fill(empty[..., None], float("-inf")),
                                         column.detach().float()], dim=-1), dim=-1)
        probs = probs.masked_fill(empty[..., None], 0.0)
        # A row that sees no key has LSE = its sink.
        lse_graph = torch.where(empty, column[..., 0], torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1))
        return Reference(torch.matmul(probs, v), lse, empty, lse_graph)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)
    out = out.masked_fill(empty[..., None], 0.0)
    lse = keys_lse.masked_fill(empty, float("-inf"))
    lse_graph = torch.logsumexp(scores, dim=-1).masked_fill(empty, float("-inf"))
    return Reference(out, lse, empty, lse_graph)


@dataclass(frozen=True)
class GradReference:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None = None  # in the bias's shape, when a float bias was given
    dsink: torch.Tensor | None = None


def attention_grad_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                             causal: str | None, scale: float | None, compute_dtype: torch.dtype,
                             bias: torch.Tensor | None = None, sink: torch.Tensor | None = None,
                             dlse: torch.Tensor | None = None, *,
                             window: tuple[int, int] | None = None,
                             softcap: float | None = None) -> GradReference:
    """dq, dk, dv (and dbias for a float bias) of attention_reference(...).out for upstream gradient
    `dout`, and of its LSE for `dlse` when given (autograd in `compute_dtype`); `window` and
    `softcap` as attention_reference's."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    bias_leaf = None
    if bias is not None:
        bias_leaf = bias if bias.dtype == torch.bool else bias.detach().to(compute_dtype).requires_grad_()
    sink_leaf = None if sink is None else sink.detach().to(compute_dtype).requires_grad_()
    ref = attention_reference(*leaves, causal, scale, compute_dtype, bias_leaf, sink_leaf, window=window,
                              softcap=softcap)
    if dlse is None:
        ref.out.backward(dout.to(compute_dtype))
    else:
        torch.autograd.backward([ref.out, ref.lse_graph], [dout.to(compute_dtype), dlse.to(compute_dtype)])
    dbias = bias_leaf.grad if bias_leaf is not None and bias_leaf.dtype != torch.bool else None
    return GradReference(*(t.grad for t in leaves), dbias, None if sink_leaf is None else sink_leaf.grad)


def fa_style_check(name: str, got: torch.Tensor, ref32: torch.Tensor, reflp: torch.Tensor, k: float,
                   repro: str, floor: float = 1e-5) -> None:
    """Rule FA-style(k): max|got - REF32| <= k * max|REFLP - REF32| + floor, on finite reference values;
    where the reference is infinite (-inf LSE) `got` must equal it exactly."""
    got, ref32, reflp = got.float(), ref32.float(), reflp.float()
    assert not torch.isnan(got).any(), f"{name}: {int(torch.isnan(got).sum())} NaN values\n{repro}"
    finite = torch.isfinite(ref32)
    assert torch.equal(got[~finite], ref32[~finite]), f"{name}: infinite reference entries not reproduced\n{repro}"
    assert torch.isfinite(got[finite]).all(), f"{name}: Inf values where the reference is finite\n{repro}"
    if not finite.any():
        return
    err = (got[finite] - ref32[finite]).abs().max().item()
    base = (reflp[finite] - ref32[finite]).abs().max().item()
    bound = k * base + floor
    assert err <= bound, (f"{name}: max|y - REF32| = {err:.3g} exceeds {k} * max|REFLP - REF32| ({base:.3g}) "
                          f"+ {floor:g} = {bound:.3g}\n{repro}")


# Floor of the FA-style rule for gradients. delta = rowsum(dO * O) uses the forward's rounded O
# (as FlashAttention does), so a gradient that is exactly 0 in exact math (a single visible key:
# dS = 0) comes out at the 1e-5 level, while the low-precision reference is then exactly 0 too.
GRAD_FLOOR = 1e-4


def check_grads_against(grads, ref32: GradReference, reflp: GradReference, repro: str) -> None:
    """FA-style(3) on dq, dk and dv, then on dbias and dsink where the references have them (in
    that order in `grads`)."""
    names = [n for n in ("dq", "dk", "dv", "dbias", "dsink") if getattr(ref32, n) is not None][:len(grads)]
    assert len(names) == len(grads), f"{len(grads)} gradients for references {names}\n{repro}"
    for name, got in zip(names, grads):
        r32, rlp = getattr(ref32, name), getattr(reflp, name)
        assert got.shape == r32.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(r32.shape)}\n{repro}"
        fa_style_check(name, got, r32, rlp, 3, repro, floor=GRAD_FLOOR)
