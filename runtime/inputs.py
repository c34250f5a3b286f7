"""Argument checks and memory layouts shared by the forward and backward APIs.

Every problem a caller can cause is an InvalidInputError raised here, before anything launches.
"""
from __future__ import annotations

import math
from typing import Callable, TypeVar

import torch

from .errors import InvalidInputError
from .head_dims import MAX_HEAD_DIM
from .visibility import UNBOUNDED_REACH

T = TypeVar("T")

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
CAUSAL_MODES = {None: "none", "top_left": "top_left", "bottom_right": "bottom_right"}
_MAX_GRID_YZ = 65535  # grid.y carries heads, grid.z the batch
_ALIGN_BYTES = 16  # the kernels move 16-byte vectors


def fail(message: str) -> None:
    raise InvalidInputError(message)


def check_flag(name: str, value: object, optional: bool = False) -> None:
    """A bool argument (or None, where `optional`), not a truthy stand-in."""
    if not isinstance(value, bool) and not (optional and value is None):
        fail(f"{name} must be {'None or ' if optional else ''}a bool, got {value!r}")


def has_kernel_strides(t: torch.Tensor) -> bool:
    """Head dim contiguous and every other stride (of a dim longer than 1) a multiple of 16 bytes."""
    elems = _ALIGN_BYTES // t.element_size()
    return t.stride(-1) == 1 and all(s % elems == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def is_kernel_layout(t: torch.Tensor) -> bool:
    """The kernels can read or write `t` in place: kernel strides and a 16-byte aligned base."""
    return has_kernel_strides(t) and t.data_ptr() % _ALIGN_BYTES == 0


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Two of t's elements share memory (a zero stride, or strides that interleave)."""
    extent = 1  # elements spanned by the dims taken so far, from the smallest stride up
    for size, stride in sorted(((n, abs(s)) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda x: x[1]):
        if stride < extent:
            return True
        extent += (size - 1) * stride
    return False


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    first = t.data_ptr()
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1) * t.element_size()
    return first, last + t.element_size()


def check_output_buffer(name: str, buffer: torch.Tensor, readers: dict[str, torch.Tensor | None]) -> None:
    """An output the kernels write must not overlap itself nor any tensor the call reads: they run
    concurrently, so either would make the result depend on the order of their memory accesses."""
    if buffer.numel() == 0:
        return
    if has_internal_overlap(buffer):
        fail(f"{name} has overlapping elements (strides {buffer.stride()}): pass a buffer whose elements are "
             "distinct")
    start, end = _byte_span(buffer)
    for other_name, other in readers.items():
        if other is None or other.numel() == 0 or other.device != buffer.device:
            continue
        other_start, other_end = _byte_span(other)
        if start < other_end and other_start < end:
            fail(f"{name} shares memory with {other_name}: pass a separate buffer")


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when the kernels can read it in place, else a fresh contiguous copy."""
    if t.numel() == 0 or is_kernel_layout(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            fail(f"{name} must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            fail(f"{name} has dtype {t.dtype}; flashkiln supports torch.float16 and torch.bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        fail(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        fail(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    (b, hq, _, dqk), (bk, hkv, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    if not (b == bk == bv):
        fail(f"batch sizes differ: q {b}, k {bk}, v {bv}")
    if (hkv, sk) != (hv, sv):
        fail(f"k and v must have the same heads and seqlen, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        fail(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if dk != dqk:
        fail(f"q and k head dims differ: {dqk} vs {dk}")
    for name, d in (("q/k", dqk), ("v", dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            fail(f"{name} head dim {d} is not supported: flashkiln computes head dims from 1 to {MAX_HEAD_DIM} "
                 "(one that was not generated runs on the next larger generated kernel)")
    if hq > _MAX_GRID_YZ or b > _MAX_GRID_YZ:
        fail(f"at most {_MAX_GRID_YZ} heads and {_MAX_GRID_YZ} batch entries per call, got {hq} and {b}")
    if max(q.shape[2], sk) >= 2**31:
        fail("sequence lengths must be below 2**31")


def check_causal_scale(causal: str | None, scale: float | None, d_qk: int) -> tuple[str, float]:
    if causal not in CAUSAL_MODES:
        fail(f"causal must be None, 'top_left' or 'bottom_right', got {causal!r}")
    if scale is None:
        return CAUSAL_MODES[causal], 1.0 / math.sqrt(d_qk)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        fail(f"scale must be a finite positive number, got {scale!r}")
    return CAUSAL_MODES[causal], float(scale)


def check_window(window_size: object, causal: str) -> tuple[int, int] | None:
    """A call's window: window_size (left, right), -1 for an unbounded side, as FlashAttention's
    (flashkiln.visibility). A causal mask sets `right` to 0, as FlashAttention's causal=True does;
    a window that bounds nothing is None (the call needs no window kernel)."""
    if window_size is None:
        return None
    left, right = window_pair(window_size)
    if causal != "none":
        right = 0
    if left < 0 and (right < 0 or causal != "none"):
        return None
    return left, right


def check_scores(causal: str | None, scale: float | None, window_size: object, softcap: object,
                 d_qk: int) -> tuple[str, float, tuple[int, int] | None, float | None]:
    """A call's score arguments, checked: (causal mode, scale, window, softcap)."""
    causal_mode, scale = check_causal_scale(causal, scale, d_qk)
    return causal_mode, scale, check_window(window_size, causal_mode), check_softcap(softcap)


def window_pair(window_size: object) -> tuple[int, int]:
    """window_size checked as a pair of ints, each -1 or at least 0 ((-1, -1) for None); a side
    reaching UNBOUNDED_REACH keys or more, past every sequence below 2^28 rows, is unbounded (-1)."""
    if window_size is None:
        return -1, -1
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in window_size)):
        fail(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if any(x < -1 for x in window_size):
        fail(f"window_size sides must be -1 (unbounded) or at least 0, got {tuple(window_size)}")
    left, right = (-1 if x >= UNBOUNDED_REACH else x for x in window_size)
    return left, right


def check_softcap(softcap: object) -> float | None:
    """A logit softcap's cap: a finite positive number, or None (and 0, FlashAttention's "off") for none."""
    if softcap is None or (not isinstance(softcap, bool) and isinstance(softcap, (int, float)) and softcap == 0):
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
            or softcap < 0:
        fail(f"softcap must be a finite positive number (or None or 0: none), got {softcap!r}")
    return float(softcap)


def score_fields(scale: float, softcap: float | None) -> dict[str, float]:
    """A parameter block's score scaling: scale and scale_log2 (the softmax's, base 2), and with a
    softcap those of the capped logit, the cap itself, and softcap_scale = scale / cap, by which
    the raw scores enter its tanh (common/softcap.hpp)."""
    if softcap is None:
        return {"scale": scale, "scale_log2": scale * math.log2(math.e), "softcap_scale": 0.0}
    return {"scale": softcap, "scale_log2": softcap * math.log2(math.e), "softcap_scale": scale / softcap}


def reach_fields(window: tuple[int, int] | None, causal: str) -> dict[str, int]:
    """A parameter block's reach (common/visibility.hpp, Reach): the window ((-1, -1): none), and
    the alignment, which the causal kernels take at run time (descriptor.kernel_causal)."""
    left, right = window or (-1, -1)
    return {"window_left": left, "window_right": right, "top_left": int(causal == "top_left")}


def check_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_forward_outputs(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, d_v: int,
                          written_in_place: bool = True) -> None:
    """`written_in_place`: the kernel writes `out` itself (not a padded copy), so it needs their layout."""
    b, hq, sq, _ = q.shape
    check_tensor("out", out)
    check_tensor("lse", lse)
    if tuple(out.shape) != (b, hq, sq, d_v) or out.dtype != q.dtype or out.device != q.device:
        fail(f"out must be a {q.dtype} tensor of shape {(b, hq, sq, d_v)} on {q.device}, "
             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if written_in_place and out.numel() and not is_kernel_layout(out):
        fail(f"out must have a contiguous head dim and 16-byte aligned strides and base, got strides {out.stride()}")
    if tuple(lse.shape) != (b, hq, sq) or lse.dtype != torch.float32 or lse.device != q.device:
        fail(f"lse must be a float32 tensor of shape {(b, hq, sq)} on {q.device}, "
             f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    if not lse.is_contiguous():
        fail("lse must be contiguous")


def empty_in_memory_order(q: torch.Tensor, d_v: int) -> torch.Tensor:
    """O in q's memory order: (B, S, H, D) storage when q is a permuted (B, S, H, D) tensor."""
    b, hq, sq, _ = q.shape
    if q.stride(1) < q.stride(2):
        return torch.empty((b, sq, hq, d_v), dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty((b, hq, sq, d_v), dtype=q.dtype, device=q.device)


class kernel_written_allocations:  # noqa: N801 (used as a context manager, like a function)
    """Allocations inside are buffers the kernels write in full before anything reads them.

    Under torch.use_deterministic_algorithms(True), torch.empty fills new memory with NaN so that
    reads of uninitialized memory reproduce; for these buffers that fill is only a memset (the
    backward's dS workspace alone can be gigabytes), so it is switched off while they are made.
    (A class, not a generator: it is on every backward's path.)
    """

    def __enter__(self) -> None:
        self._flag = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False

    def __exit__(self, *exc: object) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = self._flag


def kernel_written(filled: bool, make: Callable[..., T], *args: object) -> T:
    """make(*args), under kernel_written_allocations where `filled` (torch would fill fresh memory:
    deterministic algorithms were on when the caller's plan was made); without the switch otherwise,
    since the switch itself costs host time on the straight paths."""
    if filled:
        with kernel_written_allocations():
            return make(*args)
    return make(*args)


def empty_gradient_like(t: torch.Tensor) -> torch.Tensor:
    """A gradient buffer with `t`'s strides when those are dense and kernel-aligned, else contiguous.

    Decided from shapes and strides alone (a fresh allocation is aligned), so the custom ops' fake
    implementations give the same strides as the real ones, also under symbolic shapes.
    """
    grad = torch.empty_like(t, memory_format=torch.preserve_format)
    return grad if has_kernel_strides(grad) else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def stride_fields(prefix: str, t: torch.Tensor) -> dict[str, int]:
    """The (batch, head, row) strides of a (B, H, S, D) tensor as params fields."""
    return {f"{prefix}_batch_stride": t.stride(0), f"{prefix}_head_stride": t.stride(1),
            f"{prefix}_row_stride": t.stride(2)}
