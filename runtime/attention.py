"""Python API of the attention forward: argument checks, kernel choice, launch."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .descriptor import HEAD_DIMS
from .errors import InvalidInputError
from .manifest import KernelEntry
from .params import FwdParams
from .registry import KernelRegistry, default_registry

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_CAUSAL = {None: "none", "top_left": "top_left", "bottom_right": "bottom_right"}
_MAX_GRID_YZ = 65535  # grid.y carries heads, grid.z the batch
_ALIGN_BYTES = 16  # the kernels move 16-byte vectors


@dataclass(frozen=True)
class ForwardLaunch:
    """Everything one forward launch needs: chosen kernel, grid and packed parameters."""

    entry: KernelEntry
    grid: tuple[int, int, int]
    params: FwdParams


def _fail(message: str) -> None:
    raise InvalidInputError(message)


def _is_kernel_layout(t: torch.Tensor) -> bool:
    """Head dim contiguous; every other stride (of a dim longer than 1) and the base 16-byte aligned."""
    elems = _ALIGN_BYTES // t.element_size()
    strides_ok = all(s % elems == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    return t.stride(-1) == 1 and strides_ok and t.data_ptr() % _ALIGN_BYTES == 0


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when the kernels can read it in place, else a fresh contiguous copy."""
    if t.numel() == 0 or _is_kernel_layout(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            _fail(f"{name} must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            _fail(f"{name} has dtype {t.dtype}; flashkiln supports torch.float16 and torch.bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        _fail(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    (b, hq, _, dqk), (bk, hkv, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    if not (b == bk == bv):
        _fail(f"batch sizes differ: q {b}, k {bk}, v {bv}")
    if (hkv, sk) != (hv, sv):
        _fail(f"k and v must have the same heads and seqlen, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        _fail(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if dk != dqk:
        _fail(f"q and k head dims differ: {dqk} vs {dk}")
    for name, d in (("q/k", dqk), ("v", dv)):
        if d not in HEAD_DIMS:
            _fail(f"{name} head dim {d} is not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
    if hq > _MAX_GRID_YZ or b > _MAX_GRID_YZ:
        _fail(f"at most {_MAX_GRID_YZ} heads and {_MAX_GRID_YZ} batch entries per call, got {hq} and {b}")
    if max(q.shape[2], sk) >= 2**31:
        _fail("sequence lengths must be below 2**31")


def _check_causal_scale(causal: str | None, scale: float | None, d_qk: int) -> tuple[str, float]:
    if causal not in _CAUSAL:
        _fail(f"causal must be None, 'top_left' or 'bottom_right', got {causal!r}")
    if scale is None:
        return _CAUSAL[causal], 1.0 / math.sqrt(d_qk)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        _fail(f"scale must be a finite positive number, got {scale!r}")
    return _CAUSAL[causal], float(scale)


def _check_outputs(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, d_v: int) -> None:
    b, hq, sq, _ = q.shape
    if tuple(out.shape) != (b, hq, sq, d_v) or out.dtype != q.dtype or out.device != q.device:
        _fail(f"out must be a {q.dtype} tensor of shape {(b, hq, sq, d_v)} on {q.device}, "
              f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if out.numel() and not _is_kernel_layout(out):
        _fail(f"out must have a contiguous head dim and 16-byte aligned strides and base, got strides {out.stride()}")
    if tuple(lse.shape) != (b, hq, sq) or lse.dtype != torch.float32 or lse.device != q.device:
        _fail(f"lse must be a float32 tensor of shape {(b, hq, sq)} on {q.device}, "
              f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    if not lse.is_contiguous():
        _fail("lse must be contiguous")


def _empty_like_layout(q: torch.Tensor, d_v: int) -> torch.Tensor:
    """O in q's memory order: (B, S, H, D) storage when q is a permuted (B, S, H, D) tensor."""
    b, hq, sq, _ = q.shape
    if q.stride(1) < q.stride(2):
        return torch.empty((b, sq, hq, d_v), dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty((b, hq, sq, d_v), dtype=q.dtype, device=q.device)


def plan_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 causal: str, scale: float, capability: tuple[int, int], registry: KernelRegistry) -> ForwardLaunch:
    """Choose the kernel and pack its parameters; q, k, v, out and lse are already checked."""
    b, hq, sq, dqk = q.shape
    _, hkv, sk, dv = v.shape
    request = {"kernel": "fwd", "family": "portable", "dtype": _DTYPES[q.dtype], "d_qk": dqk, "d_v": dv,
               "causal": causal, "bias": "none", "deterministic": False}
    entry = registry.find(request, capability)
    tile_m = entry.descriptor["tile_m"]
    params = FwdParams(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(), lse=lse.data_ptr(),
        q_batch_stride=q.stride(0), q_head_stride=q.stride(1), q_row_stride=q.stride(2),
        k_batch_stride=k.stride(0), k_head_stride=k.stride(1), k_row_stride=k.stride(2),
        v_batch_stride=v.stride(0), v_head_stride=v.stride(1), v_row_stride=v.stride(2),
        o_batch_stride=out.stride(0), o_head_stride=out.stride(1), o_row_stride=out.stride(2),
        batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk,
        scale=scale, scale_log2=scale * math.log2(math.e),
    )
    return ForwardLaunch(entry, (-(-sq // tile_m), hq, b), params)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: str | None = None,
                      scale: float | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      registry: KernelRegistry | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward: softmax(scale * q kᵀ, causal mask) v and its log-sum-exp.

    q: (B, H_q, S_q, d_qk), k: (B, H_kv, S_k, d_qk), v: (B, H_kv, S_k, d_v), fp16 or bf16 on one
    CUDA device, any strides with a contiguous head dim (others are copied first); H_q a multiple
    of H_kv (GQA/MQA). causal: None, "top_left" (key j visible to query i iff j <= i) or
    "bottom_right" (iff j <= i + S_k - S_q). scale defaults to 1/sqrt(d_qk).
    Returns out (B, H_q, S_q, d_v), in q's memory order, and lse (B, H_q, S_q) in fp32 (natural
    log; -inf for a query that sees no key, whose output row is 0). `out` and `lse` may be given
    preallocated. No autograd.
    """
    _check_qkv(q, k, v)
    causal_mode, scale = _check_causal_scale(causal, scale, q.shape[3])
    if q.device.type != "cuda":
        _fail(f"inputs must be CUDA tensors, got device {q.device}")
    d_v = v.shape[3]
    out = _empty_like_layout(q, d_v) if out is None else out
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if lse is None else lse
    _check_outputs(q, out, lse, d_v)
    if out.numel() == 0:
        return out, lse
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    registry = registry or default_registry()
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(device)
    launch = plan_forward(q, k, v, out, lse, causal_mode, scale, capability, registry)
    with torch.cuda.device(device):
        registry.launch(launch.entry, device, capability, launch.grid, launch.params,
                        torch.cuda.current_stream(device).cuda_stream)
    return out, lse
