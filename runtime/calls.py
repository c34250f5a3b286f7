"""One call's checked tensors as the planners see them, and their roles in the parameter blocks.

A call object is what a family's planner plans from and what a cached plan runs on: `tensors()`
names each tensor by its role, the name of the parameter-block field that holds its address, so
that a plan made for one call can point its launches at the next call's tensors (launch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import descriptor, inputs
from .bias import KernelBias
from .varlen import BatchShape, PackedBatch


# The kernels whose tiles follow the visibility rule (common/visibility.hpp), and so a window.
VISIBILITY_KERNELS = ("fwd", "bwd", "bwd_dq", "bwd_dbias")
# The kernels that compute the scores, and so cap them (common/softcap.hpp).
SCORE_KERNELS = ("fwd", "bwd", "bwd_dbias")


def forward_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    bias: torch.Tensor | None, sink: torch.Tensor | None,
                    packed: PackedBatch | None) -> dict[str, torch.Tensor | None]:
    """A forward's tensors by role; `bias` is the tensor the kernels read (its address is the caller's
    when it is used in place)."""
    return {"q": q, "k": k, "v": v, "o": out, "lse": lse, "bias": bias, "sink": sink,
            "cu_seqlens_q": None if packed is None else packed.cu_seqlens_q,
            "cu_seqlens_k": None if packed is None else packed.cu_seqlens_k}


@dataclass(frozen=True)
class ForwardCall:
    """A forward's kernel-side tensors ((B, H, S, d), or (1, H, total, d) views of a packed batch)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    causal: str
    scale: float
    bias: KernelBias | None = None
    sink: torch.Tensor | None = None  # fp32 (H_q,)
    packed: PackedBatch | None = None
    window: tuple[int, int] | None = None  # (left, right), inputs.check_window's
    softcap: float | None = None  # the cap, inputs.check_softcap's

    @property
    def shape(self) -> BatchShape:
        return BatchShape.of(self.q, self.k, self.packed)

    def request(self, family: str) -> dict:
        """The functional fields (all but arch) of the forward kernel this call needs of `family`."""
        return descriptor.request(kernel="fwd", family=family, dtype=inputs.DTYPES[self.q.dtype], d_qk=self.q.shape[3],
                                  d_v=self.v.shape[3], causal=descriptor.kernel_causal(self.causal),
                                  bias="none" if self.bias is None else "additive", packed=self.packed is not None,
                                  window=self.window is not None, softcap=self.softcap is not None)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return forward_tensors(self.q, self.k, self.v, self.out, self.lse,
                               None if self.bias is None else self.bias.tensor, self.sink, self.packed)


@dataclass(frozen=True)
class BackwardCall:
    """A backward's kernel-side tensors (as ForwardCall's) and what it is asked for."""

    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    causal: str
    scale: float
    deterministic: bool
    bias: KernelBias | None = None
    bias_grad: bool = False
    packed: PackedBatch | None = None
    dlse: torch.Tensor | None = None
    sink: torch.Tensor | None = None  # fp32 (H_q,)
    # The main kernel sums p_sink * P * dP per key tile (dSink, and dBias of a row-summed key-constant bias).
    sink_parts: bool = False
    window: tuple[int, int] | None = None  # (left, right), inputs.check_window's
    softcap: float | None = None  # the cap, inputs.check_softcap's
    keys_complete: bool = True  # out and lse are of k's keys alone (attention_backward's partial_keys)

    @property
    def shape(self) -> BatchShape:
        return BatchShape.of(self.q, self.k, self.packed)

    def request(self, family: str) -> dict:
        """The functional fields (all but arch) of the main backward kernel this call needs of `family`."""
        return self.kernel_request("bwd", family, causal=self.causal, deterministic=self.deterministic,
                                   bias="none" if self.bias is None else "additive")

    def kernel_request(self, kernel: str, family: str, **fields) -> dict:
        """The functional fields (all but arch) of one of this call's kernels of `family`. The
        kernels that tile by the visibility rule (the main kernel and the dQ kernel) carry the
        call's window, the main kernel its softcap; the preprocess and postprocess work on rows
        alone."""
        if kernel in VISIBILITY_KERNELS:
            fields.setdefault("window", self.window is not None)
        if kernel in SCORE_KERNELS:
            fields.setdefault("softcap", self.softcap is not None)
        if "causal" in fields:
            fields["causal"] = descriptor.kernel_causal(fields["causal"])
        return descriptor.request(kernel=kernel, family=family, dtype=inputs.DTYPES[self.q.dtype],
                                  d_qk=self.q.shape[3], d_v=self.v.shape[3], **fields)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return backward_tensors(self.q, self.k, self.v, self.out, self.dout, self.lse, self.dq, self.dk, self.dv,
                                self.dlse, None if self.bias is None else self.bias.tensor,
                                self.sink if self.sink_parts else None, self.packed)


def backward_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                     lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                     dlse: torch.Tensor | None, bias: torch.Tensor | None, sink: torch.Tensor | None,
                     packed: PackedBatch | None) -> dict[str, torch.Tensor | None]:
    """A backward's tensors by role (`bias` the tensor the kernels read, `sink` where they sum its parts)."""
    return {"q": q, "k": k, "v": v, "o": out, "dout": dout, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dlse": dlse,
            "bias": bias, "sink": sink, "cu_seqlens_q": None if packed is None else packed.cu_seqlens_q,
            "cu_seqlens_k": None if packed is None else packed.cu_seqlens_k}
