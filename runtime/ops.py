"""PyTorch integration: custom ops with fake kernels and autograd, and an SDPA drop-in.

`flashkiln::attention_forward` and `flashkiln::attention_backward` are opaque to torch.compile
(no graph breaks), have shape-only fake implementations for tracing, and the forward's autograd
formula calls the backward op. In eager mode the SDPA drop-in and varlen_attention run the same
plans through a plain autograd.Function, one call per direction, without the custom-op
dispatch's host time (and the forward alone where nothing can be differentiated); a dense call's
backward finds its plan on its forward's (backward.backward_after). Every launch goes on the
current stream, so both also work under CUDA-graph capture.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from . import inputs as checks
from .backward import attention_backward, backward_after
from .bias import additive, empty_bias_gradient
from .errors import InvalidInputError, UnsupportedError
from .forward import attention_forward, cached_plan
from .varlen import PackedBatch, as_batched, as_tokens


def _causal_arg(causal: str) -> Optional[str]:
    return None if causal == "none" else causal


def _packed(cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int,
            max_seqlen_k: int) -> Optional[PackedBatch]:
    """The ops' flat varlen arguments as a PackedBatch (None for a dense batch)."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise InvalidInputError("a packed batch needs both cu_seqlens_q and cu_seqlens_k")
    return PackedBatch(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _scores_shape(q: torch.Tensor, k: torch.Tensor, packed: Optional[PackedBatch]) -> tuple[int, int, int, int]:
    if packed is None:
        return (*q.shape[:3], k.shape[2])
    return packed.batch, q.shape[1], packed.max_seqlen_q, packed.max_seqlen_k


def _softcap_arg(softcap: Optional[float]) -> float:
    """A softcap as the ops' float (0.0: none), checked."""
    return checks.check_softcap(softcap) or 0.0


def _window(window_left: int, window_right: int) -> Optional[tuple[int, int]]:
    """The ops' window ints as attention_forward's window_size ((-1, -1): none)."""
    return None if window_left == window_right == -1 else (window_left, window_right)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
             sink: Optional[torch.Tensor], causal: str, scale: float, deterministic: Optional[bool],
             cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
             max_seqlen_q: int = 0, max_seqlen_k: int = 0, window_left: int = -1, window_right: int = -1,
             softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); `deterministic` is only carried to the backward. With cu_seqlens, a packed
    batch (flashkiln.varlen); window_left/right: window_size (-1, -1: none); softcap 0: none."""
    out, lse = attention_forward(q, k, v, causal=_causal_arg(causal), window_size=_window(window_left, window_right),
                                 softcap=softcap, scale=scale, bias=bias, sink=sink,
                                 packed=_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return out, lse


attention_forward_op = torch.library.custom_op("flashkiln::attention_forward", mutates_args=())(_forward)


@attention_forward_op.register_fake
def _(q, k, v, bias, sink, causal, scale, deterministic, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
      max_seqlen_k=0, window_left=-1, window_right=-1, softcap=0.0):
    if _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) is not None:
        q, k, v = (as_batched(t) for t in (q, k, v))
        checks.check_qkv(q, k, v)
        out = checks.empty_in_memory_order(q, v.shape[-1])
        return as_tokens(out), q.new_empty((q.shape[1], q.shape[2]), dtype=torch.float32)
    checks.check_qkv(q, k, v)
    return checks.empty_in_memory_order(q, v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)


def _gradients_or_none(dout, q, k, v, out, lse, dlse, bias, bias_grad, sink, sink_grad, causal, scale, deterministic,
                       cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
                       softcap) -> tuple:
    """(dq, dk, dv, dbias or None, dsink or None) of the backward op's arguments."""
    dq, dk, dv, *extra = attention_backward(dout, q, k, v, out, lse, dlse=dlse, causal=_causal_arg(causal),
                                            window_size=_window(window_left, window_right), softcap=softcap,
                                            scale=scale, bias=bias, bias_grad=bias_grad, sink=sink,
                                            sink_grad=sink_grad, deterministic=deterministic,
                                            packed=_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    dbias = extra.pop(0) if bias_grad else None
    return dq, dk, dv, dbias, extra.pop(0) if sink_grad else None


def _backward_grads(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], bias_grad: bool,
                    sink: Optional[torch.Tensor], sink_grad: bool, causal: str, scale: float,
                    deterministic: Optional[bool], cu_seqlens_q: Optional[torch.Tensor] = None,
                    cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                    window_left: int = -1, window_right: int = -1, softcap: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias, dsink); dbias and dsink are empty tensors unless asked for (an op returns tensors)."""
    dq, dk, dv, dbias, dsink = _gradients_or_none(dout, q, k, v, out, lse, dlse, bias, bias_grad, sink, sink_grad,
                                                  causal, scale, deterministic, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, window_left, window_right, softcap)
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias, q.new_empty(0) if dsink is None else dsink


attention_backward_op = torch.library.custom_op("flashkiln::attention_backward", mutates_args=())(_backward_grads)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, bias, bias_grad, sink, sink_grad, causal, scale, deterministic, cu_seqlens_q=None,
      cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, window_left=-1, window_right=-1, softcap=0.0):
    packed = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if packed is not None:
        q, k, v = (as_batched(t) for t in (q, k, v))
    dbias = empty_bias_gradient(bias, _scores_shape(q, k, packed), q) if bias_grad else q.new_empty(0)
    dsink = sink.new_empty(sink.shape) if sink_grad else q.new_empty(0)
    grads = tuple(checks.empty_gradient_like(t) for t in (q, k, v))
    return (*(grads if packed is None else (as_tokens(g) for g in grads)), dbias, dsink)


def _save(ctx, q, k, v, bias, sink, causal, scale, deterministic, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
          max_seqlen_k, window_left, window_right, softcap, out, lse) -> None:
    ctx.save_for_backward(q, k, v, bias, sink, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
    ctx.max_seqlen = (max_seqlen_q, max_seqlen_k)
    ctx.window, ctx.softcap = (window_left, window_right), softcap


def _gradients(ctx, dout, dlse, backward) -> tuple:
    """The gradients of q, k, v, bias and sink through `backward` (the backward op, or in eager
    mode _gradients_or_none: the same function without the op's placeholder outputs)."""
    q, k, v, bias, sink, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    bias_grad, sink_grad = bool(ctx.needs_input_grad[3]), bool(ctx.needs_input_grad[4])
    dq, dk, dv, dbias, dsink = backward(dout, q, k, v, out, lse, dlse, bias, bias_grad, sink, sink_grad, ctx.causal,
                                        ctx.scale, ctx.deterministic, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlen,
                                        *ctx.window, ctx.softcap)
    return dq, dk, dv, dbias if bias_grad else None, dsink if sink_grad else None


def _setup_context(ctx, inputs, output) -> None:
    _save(ctx, *inputs, *output)


def _backward(ctx, dout, dlse):
    return _gradients(ctx, dout, dlse, attention_backward_op) + (None,) * 10  # the op's other inputs


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _score_args(settings: tuple) -> tuple:
    """(causal, window_size, softcap, scale) of _attention's settings, as attention_forward takes them,
    in the order forward.cached_plan and backward.backward_after take them: passed by position, they
    cost less host time than keywords."""
    causal, scale, _, _, _, left, right, softcap = settings
    return _causal_arg(causal), _window(left, right), softcap, scale


class _EagerCall:
    """An eager call's arguments besides q, k, v, as attention_forward and attention_backward take
    them. Its optional tensors (bias, sink, cu_seqlens_q, cu_seqlens_k: those present, in that
    order) travel through autograd's apply beside q, k, v, so that autograd saves them with their
    version checks and apply looks at no argument that is None."""

    __slots__ = ("score_args", "deterministic", "has_bias", "has_sink", "max_seqlen")

    def __init__(self, settings: tuple, has_bias: bool, has_sink: bool):
        self.score_args = _score_args(settings)
        self.deterministic = settings[2]
        self.has_bias, self.has_sink = has_bias, has_sink
        self.max_seqlen = settings[3:5]

    @property
    def scores(self) -> dict:
        """score_args as attention_backward's keywords."""
        causal, window, softcap, scale = self.score_args
        return {"causal": causal, "window_size": window, "softcap": softcap, "scale": scale}

    def split(self, optional: Sequence[torch.Tensor]
              ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[PackedBatch]]:
        """(bias, sink, packed) of the optional tensors."""
        if not optional:
            return None, None, None
        bias = optional[0] if self.has_bias else None
        sink = optional[self.has_bias] if self.has_sink else None
        cu_seqlens = optional[self.has_bias + self.has_sink:]
        return bias, sink, _packed(*cu_seqlens, *self.max_seqlen) if cu_seqlens else None


class _EagerAttention(torch.autograd.Function):
    """The custom op's autograd in eager mode without torch's custom-op dispatch, which costs more
    host time per call than the kernels' own planned launches (docs/perf.md); torch.compile traces
    the custom ops instead (`_attention`). apply(call, q, k, v, *optional) (_EagerCall's) returns
    the output alone: the eager callers drop the LSE, and every input or output autograd tracks
    costs host time."""

    @staticmethod
    def forward(ctx, call: _EagerCall, q, k, v, *optional):
        bias, sink, packed = call.split(optional)
        plan = cached_plan(q, k, v, *call.score_args, bias, sink, packed)
        out, lse = plan.run(q, k, v, bias, sink, packed)
        ctx.call, ctx.plan = call, plan
        ctx.save_for_backward(q, k, v, out, lse, *optional)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *optional = ctx.saved_tensors
        call: _EagerCall = ctx.call
        if not optional:  # a dense call without bias or sink: three gradients, then the call's None
            return None, *backward_after(ctx.plan, dout, q, k, v, out, lse, *call.score_args, call.deterministic)
        bias, sink, packed = call.split(optional)
        wanted = ctx.needs_input_grad[4:4 + call.has_bias + call.has_sink]  # bias's, then sink's
        bias_grad = call.has_bias and wanted[0]
        sink_grad = call.has_sink and wanted[-1]
        dq, dk, dv, *extra = attention_backward(dout, q, k, v, out, lse, bias=bias, bias_grad=bias_grad, sink=sink,
                                                sink_grad=sink_grad, deterministic=call.deterministic,
                                                packed=packed, **call.scores)
        grads = [None, dq, dk, dv]  # call's, q's, k's, v's, then the optional tensors'
        if call.has_bias:
            grads.append(extra.pop(0) if bias_grad else None)
        if call.has_sink:
            grads.append(extra.pop(0) if sink_grad else None)
        return (*grads, *(None,) * (4 + len(optional) - len(grads)))  # cu_seqlens


def _op_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
               sink: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
               cu_seqlens_k: Optional[torch.Tensor], settings: tuple) -> tuple:
    """_attention's arguments in attention_forward_op's order."""
    causal, scale, deterministic, *rest = settings
    return q, k, v, bias, sink, causal, scale, deterministic, cu_seqlens_q, cu_seqlens_k, *rest


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
               sink: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
               cu_seqlens_k: Optional[torch.Tensor], settings: tuple) -> torch.Tensor:
    """The output, differentiable: the custom op under torch.compile, the same functions through a
    plain autograd.Function in eager mode (the forward alone when grad mode is off or no input
    requires grad). `settings`: the op's other arguments, in its order
    (causal, scale, deterministic, max_seqlen_q, max_seqlen_k, window_left, window_right, softcap)."""
    if torch.compiler.is_compiling():
        return attention_forward_op(*_op_inputs(q, k, v, bias, sink, cu_seqlens_q, cu_seqlens_k, settings))[0]
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (bias is not None and bias.requires_grad)
                                         or (sink is not None and sink.requires_grad))):
        # Nothing to differentiate (inference, evaluation): the forward alone, without autograd's
        # Function machinery, which costs about as much host time as the forward itself.
        packed = _packed(cu_seqlens_q, cu_seqlens_k, *settings[3:5])
        return cached_plan(q, k, v, *_score_args(settings), bias, sink, packed).run(q, k, v, bias, sink, packed)[0]
    call = _EagerCall(settings, bias is not None, sink is not None)
    if bias is None and sink is None and cu_seqlens_q is None and cu_seqlens_k is None:
        optional = ()
    else:
        optional = tuple(t for t in (bias, sink, cu_seqlens_q, cu_seqlens_k) if t is not None)
    return _EagerAttention.apply(call, q, k, v, *optional)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                                 *, deterministic: Optional[bool] = None, sink: Optional[torch.Tensor] = None,
                                 window_size: Optional[tuple[int, int]] = None,
                                 softcap: Optional[float] = None) -> torch.Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, differentiable.

    Supported: (N, H, L, E) or (N, L, E) inputs, attn_mask (a bool mask, True keeps, or an additive
    bias in the inputs' dtype, broadcastable to (N, H, L, S); with requires_grad its gradient
    comes back reduced to its shape), is_causal (top-left, as in PyTorch; unlike PyTorch it may
    be combined with attn_mask), scale, enable_gqa. Not supported (a clear error): dropout_p > 0.
    deterministic (flashkiln's own, keyword only) picks the bitwise-reproducible backward; by
    default it follows torch.are_deterministic_algorithms_enabled() when the backward runs (with
    an attn_mask the portable family's backward is always deterministic; the hopper family's
    follows the flag, the mask's gradient too: attention_backward says where). sink (flashkiln's own, keyword
    only): (H,) learned sink logits that join each row's softmax denominator (gpt-oss), differentiable.
    window_size (flashkiln's own, keyword only): (left, right), a sliding window as
    FlashAttention's (attention_forward; -1 unbounded, right = 0 with is_causal), None for none.
    softcap (flashkiln's own, keyword only): logit softcapping's cap (attention_forward's), None for none.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        checks.check_tensor(name, t)
    if dropout_p != 0.0:
        raise UnsupportedError(f"flashkiln.scaled_dot_product_attention: dropout_p={dropout_p} is not supported "
                               "(only 0.0); apply dropout outside attention or use torch's SDPA")
    three_d = query.dim() == 3
    if three_d:
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)  # (N, L, S): one mask per batch entry
    shape = query.shape
    if len(shape) != 4:
        raise InvalidInputError(f"query must be (N, H, L, E) or (N, L, E), got shape {tuple(shape)}")
    if not enable_gqa and shape[1] != key.shape[1]:
        raise InvalidInputError(f"query has {shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
                                "for grouped-query attention")
    scale = 1.0 / math.sqrt(shape[3]) if scale is None else scale
    # A bool mask becomes its additive bias here, once, not in both the forward and the backward.
    attn_mask = None if attn_mask is None else additive(attn_mask, query.dtype)
    out = _attention(query, key, value, attn_mask, sink, None, None,
                     ("top_left" if is_causal else "none", scale, deterministic, 0, 0,
                      *checks.window_pair(window_size), _softcap_arg(softcap)))
    return out.squeeze(1) if three_d else out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: Optional[str] = None, scale: Optional[float] = None,
                     bias: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None,
                     deterministic: Optional[bool] = None, window_size: Optional[tuple[int, int]] = None,
                     softcap: Optional[float] = None, validate: bool = False) -> torch.Tensor:
    """Attention over a packed batch of variable-length sequences, differentiable (flashkiln.varlen).

    q: (total_q, H_q, d_qk), k: (total_k, H_kv, d_qk), v: (total_k, H_kv, d_v); sequence b is
    tokens cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k
    and v (int32, batch + 1 offsets, as in flash_attn_varlen_func; zero-length sequences are
    fine), max_seqlen_q/k their longest lengths. causal: None, "top_left" or "bottom_right", per
    sequence. bias: additive, broadcastable to (batch, H_q, max_seqlen_q, max_seqlen_k), or a bool
    mask; sequence b reads bias[b, :, :len_q, :len_k]. sink: (H_q,) sink logits. window_size:
    (left, right), a sliding window per sequence (attention_forward's). softcap: logit
    softcapping's cap (attention_forward's). Returns
    (total_q, H_q, d_v); rows of tokens in no sequence are zeros (their gradients too).
    The offsets are not read on the host unless `validate` (then a sync: PackedBatch.validate).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t)
    if validate:
        PackedBatch(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k).validate(q.shape[0], k.shape[0])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    bias = None if bias is None else additive(bias, q.dtype)  # once (see scaled_dot_product_attention)
    out = _attention(q, k, v, bias, sink, cu_seqlens_q, cu_seqlens_k,
                     (causal or "none", scale, deterministic, max_seqlen_q, max_seqlen_k,
                      *checks.window_pair(window_size), _softcap_arg(softcap)))
    return out
