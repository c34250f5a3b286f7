"""The attention forward: checks and planning (cached per call key), then the plan's run."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple

import torch

from . import families, inputs
from .bias import prepare_bias
from .calls import ForwardCall, forward_tensors
from .head_dims import kernel_dims, padded
from .launch import CallPlan, Target, allocate_all, load_kernels, run
from .plan_cache import PlanCache, packed_key, storage_key, tensor_key, value_key
from .registry import KernelRegistry, default_registry
from .sinks import prepare_sink
from .varlen import TOKENS, BatchShape, PackedBatch, as_batched, as_tokens, batched_view, check_packed, token_mask

log = logging.getLogger("flashkiln")
PLANS = PlanCache()


class FreshOutputs(NamedTuple):
    """How run's direct path makes outputs like the planning call's out and lse."""

    out_layout: tuple | None  # (shape, strides), None where out is a view of a permuted buffer
    lse_layout: tuple
    dtype: torch.dtype
    device: torch.device
    # Deterministic algorithms were on at planning (the plan's key holds the flag), so torch would
    # fill fresh memory (inputs.kernel_written).
    filled: bool


@dataclass(frozen=True)
class ForwardPlan(CallPlan):
    """A forward call's plan (family None: no query row)."""

    copies: tuple[bool, bool, bool]  # q, k, v need a copy in the kernels' layout
    # Calls that need nothing but fresh outputs, scratch and the launches (a dense batch, no bias,
    # sink, padded head dims or layout copies) take run's direct path.
    fresh: FreshOutputs | None = None

    @functools.cached_property
    def backward_plans(self) -> dict[Hashable, Any]:
        """Plans of the backward calls on outputs of this plan's calls (flashkiln.backward.backward_after),
        by what such a call adds to this plan's key."""
        return {}

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
            sink: torch.Tensor | None, packed: PackedBatch | None, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's outputs; its arguments passed the checks its plan was made with."""
        if self.fresh is not None and out is None and lse is None:
            out, lse, block = inputs.kernel_written(self.fresh.filled, self._fresh_buffers, q, v)
            tensors = forward_tensors(q, k, v, out, lse, None, None, None)
            if block is not None:
                self.scratch_block.bind(block, tensors)
            run(self, tensors)
            return out, lse
        return self._run(q, k, v, bias, sink, packed, out, lse)

    def _fresh_buffers(self, q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor | None]:
        """run's direct path: fresh out and lse, and the scratch block (None without scratch)."""
        out_layout, lse_layout, dtype, device, _ = self.fresh
        if out_layout is None:
            out = inputs.empty_in_memory_order(q, v.shape[3])
        else:
            out = torch.empty_strided(*out_layout, dtype=dtype, device=device)
        lse = torch.empty_strided(*lse_layout, dtype=torch.float32, device=device)
        return out, lse, self.scratch_block.allocate(device) if self.scratch else None

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
             sink: torch.Tensor | None, packed: PackedBatch | None, out: torch.Tensor | None,
             lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """run's full path: any call of the plan."""
        if packed is not None:
            q, k, v = as_batched(q), as_batched(k), as_batched(v)
            out = None if out is None else as_batched(out)
            lse = None if lse is None else as_batched(lse)
        b, hq, sq, _ = q.shape
        d_v = v.shape[3]
        given_out, given_lse = out, lse
        with inputs.kernel_written_allocations():  # (a packed batch's are filled outside its sequences)
            if out is None:
                out = inputs.empty_in_memory_order(q, d_v)
            if lse is None:
                lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
        if packed is not None:
            _fill_outside_sequences(packed, sq, (out, given_out, 0.0), (lse, given_lse, float("-inf")))
        if self.family is not None:
            kernel_out = out
            if self.dims != (q.shape[3], d_v):  # flashkiln.head_dims: zero-padded copies, O copied back
                q, k, v = padded(q, self.dims[0]), padded(k, self.dims[0]), padded(v, self.dims[1])
                kernel_out = (torch.zeros if packed is not None else torch.empty)((b, hq, sq, self.dims[1]),
                                                                                  dtype=q.dtype, device=q.device)
            if any(self.copies):
                q, k, v = (inputs.kernel_layout(t) for t in (q, k, v))
            kernel_bias = None if bias is None else prepare_bias(bias, self.scores, q).tensor
            kernel_sink = None if sink is None else prepare_sink(sink, q)
            tensors = forward_tensors(q, k, v, kernel_out, lse, kernel_bias, kernel_sink, packed)
            if self.scratch:
                tensors.update(allocate_all(self.scratch, q.device))
            run(self, tensors)
            if kernel_out is not out:
                out.copy_(kernel_out[..., :d_v])
        if packed is not None:
            out, lse = as_tokens(out), as_tokens(lse)
        return out, lse


def fresh_outputs(out: torch.Tensor, lse: torch.Tensor) -> FreshOutputs:
    """ForwardPlan.fresh: how the direct path makes outputs like the planning call's."""
    return FreshOutputs(None if out._base is not None else (tuple(out.shape), out.stride()),
                        (tuple(lse.shape), lse.stride()), out.dtype, out.device,
                        torch.are_deterministic_algorithms_enabled())


def _fill_outside_sequences(packed: PackedBatch, total_q: int, *fills: tuple) -> None:
    """Tokens in no sequence: O = 0 and LSE = -inf, as a row that sees no key (the kernels write
    the tokens inside sequences only). A fresh buffer is filled whole (a memset), a given one
    where no sequence is."""
    outside = None
    for buffer, caller_buffer, value in fills:
        if caller_buffer is None:
            buffer.fill_(value)
            continue
        if outside is None:
            outside = ~token_mask(packed.cu_seqlens_q, total_q)
        buffer.masked_fill_(outside.view(1, 1, -1, *(1,) * (buffer.dim() - 3)), value)


def _key(q, k, v, causal, window_size, softcap, scale, bias, sink, packed, registry,
         backend) -> Hashable | None:
    """The plan-cache key of a call (flashkiln.plan_cache), or None for one planned every time."""
    if bias is not None and bias.dtype == torch.bool:
        return None  # converted to an additive bias on every call
    # torch's deterministic flag is read at planning (fresh_outputs): part of the key.
    return (tensor_key(q), tensor_key(k), tensor_key(v), causal, value_key(window_size), value_key(softcap),
            type(scale), scale, None if bias is None else storage_key(bias), tensor_key(sink), packed_key(packed),
            torch.are_deterministic_algorithms_enabled(), registry, backend)


def plan_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str | None,
                 window_size: tuple[int, int] | None, softcap: float | None, scale: float | None,
                 bias: torch.Tensor | None,
                 sink: torch.Tensor | None, packed: PackedBatch | None, out: torch.Tensor | None,
                 lse: torch.Tensor | None, registry: KernelRegistry | None, backend: str | None) -> ForwardPlan:
    """Every check of a forward call, in order, then its plan (attention_forward's arguments)."""
    families.check_backend(backend)
    if packed is not None:
        check_packed(q, k, v, packed)
        out = None if out is None else batched_view("out", out, TOKENS)
        lse = None if lse is None else batched_view("lse", lse, "(H_q, total_q)")
        q, k, v = (as_batched(t) for t in (q, k, v))
    inputs.check_qkv(q, k, v)
    shape = BatchShape.of(q, k, packed)
    causal_mode, scale, window, softcap = inputs.check_scores(causal, scale, window_size, softcap, q.shape[3])
    scores = shape.scores(q.shape[1])
    kernel_bias = None if bias is None else prepare_bias(bias, scores, q)
    kernel_sink = None if sink is None else prepare_sink(sink, q)
    if q.device.type != "cuda":
        inputs.fail(f"inputs must be CUDA tensors, got device {q.device}")
    registry = registry or default_registry()
    target = Target.of(q)
    d_qk, d_v = q.shape[3], v.shape[3]
    dims = kernel_dims(d_qk, d_v, registry.head_dims("fwd", inputs.DTYPES[q.dtype], target.capability), "forward")
    given = {"out": out, "lse": lse}
    out = inputs.empty_in_memory_order(q, d_v) if out is None else out
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if lse is None else lse
    inputs.check_forward_outputs(q, out, lse, d_v, written_in_place=dims == (d_qk, d_v))
    readers = {"q": q, "k": k, "v": v, "bias": bias, "sink": sink}
    for name, buffer in given.items():
        if buffer is not None:
            inputs.check_output_buffer(name, buffer, {**readers, **{n: b for n, b in given.items() if n != name}})
    plan = dict(registry=registry, target=target, causal=causal_mode, window=window, softcap=softcap, scale=scale,
                scores=scores, dims=dims)
    if not (out.numel() and shape.batch and shape.seqlen_q):  # (no key is for the kernel: O = 0, LSE = -inf)
        return ForwardPlan(family=None, launches=(), scratch=(), kernels=(), copies=(False,) * 3, **plan)
    if dims != (d_qk, d_v):
        q, k, v = padded(q, dims[0]), padded(k, dims[0]), padded(v, dims[1])
        out = torch.empty((*q.shape[:3], dims[1]), dtype=q.dtype, device=q.device)
    kernel_qkv = tuple(inputs.kernel_layout(t) for t in (q, k, v))
    copies = tuple(kt is not t for kt, t in zip(kernel_qkv, (q, k, v)))
    q, k, v = kernel_qkv
    call = ForwardCall(q, k, v, out, lse, causal_mode, scale, kernel_bias, kernel_sink, packed, window, softcap)
    family, launches, scratch = families.plan("forward", call, backend, target, registry, q.device)
    log.debug("flashkiln forward: %s family, %s", family, launches[0].entry.name)
    direct = (all(buffer is None for buffer in given.values()) and packed is None and bias is None and sink is None
              and dims == (d_qk, d_v) and not any(copies))
    return ForwardPlan(family=family, launches=tuple(launches), scratch=tuple(scratch.specs),
                       kernels=load_kernels(registry, target, tuple(launches)), copies=copies,
                       fresh=fresh_outputs(out, lse) if direct else None, **plan)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: str | None = None,
                      window_size: tuple[int, int] | None = None, softcap: float | None = None,
                      scale: float | None = None, bias: torch.Tensor | None = None,
                      sink: torch.Tensor | None = None, packed: PackedBatch | None = None,
                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      registry: KernelRegistry | None = None,
                      backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward: softmax(scale * q kᵀ + bias, causal mask) v and its log-sum-exp.

    q: (B, H_q, S_q, d_qk), k: (B, H_kv, S_k, d_qk), v: (B, H_kv, S_k, d_v), fp16 or bf16 on one
    CUDA device, any strides with a contiguous head dim (others are copied first); H_q a multiple
    of H_kv (GQA/MQA). causal: None, "top_left" (key j visible to query i iff j <= i) or
    "bottom_right" (iff j <= i + S_k - S_q). window_size: (left, right), a sliding window as
    FlashAttention's: query i sees key j iff i + S_k - S_q - left <= j <= i + S_k - S_q + right
    (with causal="top_left", i - left <= j <= i), -1 for an unbounded side, right = 0 under a
    causal mask; None for none (flashkiln.visibility). softcap: a cap c > 0 for logit softcapping,
    as FlashAttention's: each scaled score z becomes c * tanh(z / c) before the bias, the sink and
    the mask; None or 0 for none. scale defaults to 1/sqrt(d_qk). bias: an additive
    score bias broadcastable to (B, H_q, S_q, S_k) in the inputs' dtype, or a bool mask (True
    keeps), as F.scaled_dot_product_attention's attn_mask (flashkiln.bias). sink: (H_q,) sink logits
    that join each row's softmax denominator; the LSE includes them (flashkiln.sinks).
    Returns out (B, H_q, S_q, d_v), in q's memory order, and lse (B, H_q, S_q) in fp32 (natural
    log; -inf for a query that sees no key, whose output row is 0). `out` and `lse` may be given
    preallocated. backend: "hopper" (the sm_90a TMA/wgmma family; raises UnsupportedError or
    VariantNotFoundError for what it cannot run), "portable", or None: hopper where it can run the
    call, portable otherwise (flashkiln.families). No autograd here: see
    flashkiln.scaled_dot_product_attention.

    packed: a packed variable-length batch (flashkiln.varlen): q (total_q, H_q, d_qk), k and v
    (total_k, H_kv, d), out (total_q, H_q, d_v) and lse (H_q, total_q); causal masks and a bias
    (broadcastable to (B, H_q, max_seqlen_q, max_seqlen_k), sequence b reading the top-left
    corner of entry b) apply per sequence.

    Plans are cached per call key (flashkiln.plan_cache): a repeated call runs only its launch.
    """
    if out is None and lse is None:
        plan = cached_plan(q, k, v, causal, window_size, softcap, scale, bias, sink, packed, registry, backend)
    else:  # given buffers: planned every time (flashkiln.plan_cache)
        plan = plan_forward(q, k, v, causal, window_size, softcap, scale, bias, sink, packed, out, lse, registry,
                            backend)
    return plan.run(q, k, v, bias, sink, packed, out, lse)


def cached_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str | None = None,
                window_size: tuple[int, int] | None = None, softcap: float | None = None,
                scale: float | None = None, bias: torch.Tensor | None = None, sink: torch.Tensor | None = None,
                packed: PackedBatch | None = None, registry: KernelRegistry | None = None,
                backend: str | None = None) -> ForwardPlan:
    """The plan of an attention_forward call that makes its own out and lse, from the plan cache
    (planned and stored on a miss); raises what the call would."""
    try:
        key = _key(q, k, v, causal, window_size, softcap, scale, bias, sink, packed, registry, backend)
    except (AttributeError, TypeError):  # not tensors (or unhashable): the checks say what is wrong
        key = None
    plan = None if key is None else PLANS.get(key)
    if plan is None:
        plan = plan_forward(q, k, v, causal, window_size, softcap, scale, bias, sink, packed, None, None, registry,
                            backend)
        if key is not None:
            PLANS.put(key, plan)
    return plan
