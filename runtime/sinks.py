"""Attention sinks: a learned logit per query head that joins every row's softmax denominator.

With sinks, `P_ij = exp(S_ij - LSE_i)` and `LSE_i = log(exp(sink_h) + sum_j exp(S_ij))`: the sink
takes probability mass `exp(sink_h - LSE_i)` and contributes no value (as in gpt-oss). The forward
returns this sink-inclusive LSE, so a row that sees no key gets O = 0 and LSE = sink_h (not -inf).
The backward's kernels recompute P from that LSE. dSink_h = -sum over (batch, i) of
p_sink * (delta_i - dLSE_i) with delta_i = rowsum(dO * O) = sum_j P_ij dP_ij; the kernels sum
p_sink * P * dP per key tile in fp32 (BwdParams::dsink_parts), so dSink does not inherit the
rounding of the forward's low-precision O, and the host adds the tiles in a fixed order
(deterministic) with the dLSE term (d LSE_i / d sink_h = p_sink).
"""
from __future__ import annotations

import torch

from . import inputs


def prepare_sink(sink: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Check `sink` against q (B, H_q, S_q, d) and give the dense fp32 (H_q,) tensor the kernel reads."""
    if not isinstance(sink, torch.Tensor):
        inputs.fail(f"sink must be a torch.Tensor or None, got {type(sink).__name__}")
    if tuple(sink.shape) != (q.shape[1],):
        inputs.fail(f"sink must have shape (H_q,) = ({q.shape[1]},), got {tuple(sink.shape)}")
    if sink.device != q.device:
        inputs.fail(f"sink is on {sink.device}, the inputs on {q.device}")
    if sink.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        inputs.fail(f"sink must be float32, float16 or bfloat16, got {sink.dtype}")
    return sink.detach().to(torch.float32).contiguous()


def sink_gradient(sink: torch.Tensor, sink_parts: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """dSink (H_q,) in sink's dtype from the kernel's (B, H_q, key tiles) sums of p_sink * P * dP,
    and, with the LSE's gradient `dlse`, its term over the forward's LSE (both (B, H_q, S_q)),
    summing over the query rows where the bool (S_q,) `rows` is True (all by default: a packed
    batch's rows outside its sequences hold no values)."""
    total = -sink_parts.sum(dim=(0, 2))
    if dlse is not None:
        terms = torch.exp(sink.detach().float()[None, :, None] - lse) * dlse
        if rows is not None:
            terms = torch.where(rows, terms, 0.0)
        total = total + terms.sum(dim=(0, 2))
    return total.to(sink.dtype)
