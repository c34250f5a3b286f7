"""The attention backward: checks and planning (cached per call key), then the plan's run."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable, NamedTuple

import torch

from . import dq_routes, families, inputs
from .bias import KernelBias, bias_gradient, key_constant_gradient, prepare_bias
from .calls import BackwardCall, backward_tensors
from .forward import ForwardPlan
from .head_dims import kernel_dims, padded
from .launch import CallPlan, Target, allocate_all, load_kernels, run
from .plan_cache import PlanCache, packed_key, storage_key, tensor_key, value_key
from .registry import KernelRegistry, default_registry
from .sinks import prepare_sink, sink_gradient
from .varlen import (TOKENS, BatchShape, PackedBatch, as_batched, as_tokens, batched_view, check_packed,
                     sequence_rows, token_mask)

log = logging.getLogger("flashkiln")
PLANS = PlanCache()


class FreshGradients(NamedTuple):
    """How run's direct path makes gradients like the planning call's dq, dk, dv."""

    layouts: tuple  # (shape, strides) of dq, dk, dv
    dtype: torch.dtype
    device: torch.device
    # Deterministic algorithms were on at planning (the plan's key holds the flag), so torch would
    # fill fresh memory (inputs.kernel_written).
    filled: bool


@dataclass(frozen=True)
class BackwardPlan(CallPlan):
    """A backward call's plan (family None: no query row or no key)."""

    route: str | None  # how dQ is accumulated (flashkiln.dq_routes)
    deterministic: bool
    copies: bool  # some of q, k, v, out, dout need a copy in the kernels' layout
    grad_strides: tuple[tuple[int, ...], ...]  # of fresh dq, dk, dv (inputs.empty_gradient_like's rule)
    bias_grad: bool
    sink_grad: bool
    sink_parts: bool  # the main kernel sums p_sink * P * dP (BackwardCall.sink_parts)
    # Calls that need nothing but fresh gradients, scratch and the launches (a dense batch, no bias,
    # sink, padded head dims, layout copies or GQA sums) take run's direct path.
    fresh: FreshGradients | None = None

    def run(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, dlse: torch.Tensor | None, bias: torch.Tensor | None, sink: torch.Tensor | None,
            packed: PackedBatch | None, dq: torch.Tensor | None, dk: torch.Tensor | None,
            dv: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The call's gradients; its arguments passed the checks its plan was made with."""
        if self.fresh is not None and dq is None and dk is None and dv is None:
            dq, dk, dv, block = inputs.kernel_written(self.fresh.filled, self._fresh_buffers)
            dlse = None if dlse is None else dlse.contiguous()
            tensors = backward_tensors(q, k, v, out, dout, lse.contiguous(), dq, dk, dv, dlse, None, None, None)
            self.scratch_block.bind(block, tensors)
            run(self, tensors)
            return dq, dk, dv
        return self._run(dout, q, k, v, out, lse, dlse, bias, sink, packed, dq, dk, dv)

    def _fresh_buffers(self) -> tuple[torch.Tensor, ...]:
        """run's direct path: fresh dq, dk, dv and the scratch block."""
        (dq_layout, dk_layout, dv_layout), dtype, device, _ = self.fresh
        return (torch.empty_strided(*dq_layout, dtype=dtype, device=device),
                torch.empty_strided(*dk_layout, dtype=dtype, device=device),
                torch.empty_strided(*dv_layout, dtype=dtype, device=device), self.scratch_block.allocate(device))

    def _run(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, dlse: torch.Tensor | None, bias: torch.Tensor | None, sink: torch.Tensor | None,
             packed: PackedBatch | None, dq: torch.Tensor | None, dk: torch.Tensor | None,
             dv: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """run's full path: any call of the plan."""
        if packed is not None:
            q, k, v, out, dout = (as_batched(t) for t in (q, k, v, out, dout))
            lse = as_batched(lse)
            dlse = None if dlse is None else as_batched(dlse)
            dq, dk, dv = (None if t is None else as_batched(t) for t in (dq, dk, dv))
        with inputs.kernel_written_allocations():
            dq, dk, dv = _gradient_buffers((dq, dk, dv), (q, k, v), self.grad_strides, packed)
            scratch = allocate_all(self.scratch, q.device) if self.family is not None else {}
        kernel_bias = None if bias is None else prepare_bias(bias, self.scores, q)
        if self.family is None:
            # No query or no key: every gradient is zero (and possibly empty).
            extra = (torch.zeros(kernel_bias.shape, dtype=q.dtype, device=q.device),) if self.bias_grad else ()
            extra += (torch.zeros_like(sink),) if self.sink_grad else ()
            return (*_unbatched((dq.zero_(), dk.zero_(), dv.zero_()), packed), *extra)
        kernel_sink = None if sink is None else prepare_sink(sink, q)
        dlse = None if dlse is None else dlse.contiguous()
        lse = lse.contiguous()
        kernel_grads = (dq, dk, dv)
        if self.dims != (q.shape[3], v.shape[3]):  # flashkiln.head_dims: zero-padded copies, gradients copied back
            q, k, v = padded(q, self.dims[0]), padded(k, self.dims[0]), padded(v, self.dims[1])
            out, dout = padded(out, self.dims[1]), padded(dout, self.dims[1])
            allocate = torch.zeros if packed is not None else torch.empty
            kernel_grads = tuple(allocate(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        if self.copies:
            q, k, v, out, dout = (inputs.kernel_layout(t) for t in (q, k, v, out, dout))
        call = BackwardCall(dout, q, k, v, out, lse, *kernel_grads, self.causal, self.scale, self.deterministic,
                            kernel_bias, self.bias_grad, packed, dlse, kernel_sink, self.sink_parts, self.window,
                            self.softcap)
        run(self, {**call.tensors(), **scratch})
        if scratch.get("dk_accum") is not None:
            # GQA: fp32 sums per KV head that the kernels added into, or per-query-head gradients
            # summed over each group here (a fixed-order, deterministic reduction).
            layout_batches, hkv = k.shape[:2]
            group = q.shape[1] // hkv
            for grad, accum in ((kernel_grads[1], scratch["dk_accum"]), (kernel_grads[2], scratch["dv_accum"])):
                grad.copy_(accum if accum.shape[1] == hkv else
                           accum.view(layout_batches, hkv, group, *accum.shape[2:]).sum(2))
        if kernel_grads[0] is not dq:
            for grad, kernel_grad in zip((dq, dk, dv), kernel_grads):
                grad.copy_(kernel_grad[..., :grad.shape[-1]])
        extra = _score_gradients(scratch, kernel_bias if self.bias_grad else None, sink if self.sink_grad else None,
                                 kernel_sink, lse, dlse, packed, q.shape[2])
        return (*_unbatched((dq, dk, dv), packed), *extra)


def _key(dout, q, k, v, out, lse, dlse, causal, window_size, softcap, scale, bias, bias_grad, sink, sink_grad,
         deterministic, packed, partial_keys, registry, backend) -> Hashable | None:
    """The plan-cache key of a call (flashkiln.plan_cache), or None for one planned every time."""
    if bias is not None and bias.dtype == torch.bool:
        return None  # converted to an additive bias on every call
    # The route settings and torch's deterministic flag are read at planning: part of the key.
    return (tensor_key(dout), tensor_key(q), tensor_key(k), tensor_key(v), tensor_key(out), tensor_key(lse),
            tensor_key(dlse), causal, value_key(window_size), value_key(softcap), type(scale), scale,
            None if bias is None else storage_key(bias),
            type(bias_grad), bias_grad, tensor_key(sink), type(sink_grad), sink_grad, type(deterministic),
            deterministic, torch.are_deterministic_algorithms_enabled(), dq_routes.settings(), packed_key(packed),
            type(partial_keys), partial_keys, registry, backend)


def _check_backward_tensors(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            d_v: int) -> None:
    b, hq, sq, _ = q.shape
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (b, hq, sq, d_v) or t.dtype != q.dtype \
                or t.device != q.device:
            inputs.fail(f"{name} must be a {q.dtype} tensor of shape {(b, hq, sq, d_v)} on {q.device}, got "
                        + (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                           else type(t).__name__))
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (b, hq, sq) or lse.dtype != torch.float32 \
            or lse.device != q.device:
        inputs.fail(f"lse must be the forward's float32 tensor of shape {(b, hq, sq)} on {q.device}")


def _check_gradient_buffer(name: str, buffer: torch.Tensor, like: torch.Tensor,
                           readers: dict[str, torch.Tensor | None], written_in_place: bool) -> None:
    """`written_in_place`: the kernels write `buffer` itself (not a padded copy), so it needs their layout."""
    if not isinstance(buffer, torch.Tensor) or buffer.shape != like.shape or buffer.dtype != like.dtype \
            or buffer.device != like.device:
        inputs.fail(f"{name} must be a {like.dtype} tensor of shape {tuple(like.shape)} on {like.device}")
    if written_in_place and buffer.numel() and not inputs.is_kernel_layout(buffer):
        inputs.fail(f"{name} must have a contiguous head dim and 16-byte aligned strides and base, "
                    f"got strides {buffer.stride()}")
    inputs.check_output_buffer(name, buffer, readers)


def _check_lse_gradient(dlse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    if not isinstance(dlse, torch.Tensor) or dlse.shape != lse.shape or dlse.dtype != torch.float32 \
            or dlse.device != lse.device:
        inputs.fail(f"dlse must be a float32 tensor of lse's shape {tuple(lse.shape)} on {lse.device}, got "
                    + (f"{dlse.dtype} {tuple(dlse.shape)} on {dlse.device}" if isinstance(dlse, torch.Tensor)
                       else type(dlse).__name__))
    return dlse.contiguous()


def plan_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: torch.Tensor | None, causal: str | None,
                  window_size: tuple[int, int] | None, softcap: float | None, scale: float | None,
                  bias: torch.Tensor | None, bias_grad: bool, sink: torch.Tensor | None, sink_grad: bool,
                  deterministic: bool | None, packed: PackedBatch | None, dq: torch.Tensor | None,
                  dk: torch.Tensor | None, dv: torch.Tensor | None, partial_keys: bool,
                  registry: KernelRegistry | None, backend: str | None) -> BackwardPlan:
    """Every check of a backward call, in order, then its plan (attention_backward's arguments)."""
    families.check_backend(backend)
    inputs.check_flag("partial_keys", partial_keys)
    if packed is not None:
        check_packed(q, k, v, packed)
        q, k, v = (as_batched(t) for t in (q, k, v))
        out, dout = batched_view("out", out, TOKENS), batched_view("dout", dout, TOKENS)
        lse = batched_view("lse", lse, "(H_q, total_q)")
        dlse = None if dlse is None else batched_view("dlse", dlse, "(H_q, total_q)")
        dq, dk, dv = (None if t is None else batched_view(name, t, TOKENS)
                      for name, t in (("dq", dq), ("dk", dk), ("dv", dv)))
    inputs.check_qkv(q, k, v)
    shape = BatchShape.of(q, k, packed)
    causal_mode, scale, window, softcap = inputs.check_scores(causal, scale, window_size, softcap, q.shape[3])
    _check_backward_tensors(dout, q, out, lse, v.shape[3])
    if dlse is not None:
        dlse = _check_lse_gradient(dlse, lse)
    if q.device.type != "cuda":
        inputs.fail(f"inputs must be CUDA tensors, got device {q.device}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    # A bad $FLASHKILN_BACKWARD_ROUTE fails on every call.
    dq_routes.forced_route(deterministic)
    registry = registry or default_registry()
    target = Target.of(q)
    d_qk, d_v = q.shape[3], v.shape[3]
    dims = kernel_dims(d_qk, d_v, registry.head_dims("bwd", inputs.DTYPES[q.dtype], target.capability), "backward")
    if bias_grad and bias is None:
        inputs.fail("bias_grad=True needs the bias")
    scores = shape.scores(q.shape[1])
    kernel_bias = None if bias is None else prepare_bias(bias, scores, q)
    if bias_grad and bias.dtype == torch.bool:
        inputs.fail("a boolean mask has no gradient: pass bias_grad=False")
    if sink_grad and sink is None:
        inputs.fail("sink_grad=True needs the sink")
    kernel_sink = None if sink is None else prepare_sink(sink, q)
    readers = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dlse": dlse, "bias": bias,
               "sink": sink}
    _check_gradient_buffers((dq, dk, dv), (q, k, v), readers, written_in_place=dims == (d_qk, d_v))
    closed_form_dbias = bias_grad and kernel_bias.key_constant
    sink_parts = kernel_sink is not None and (sink_grad or (closed_form_dbias and kernel_bias.rows_summed))
    grad_strides = tuple(inputs.empty_gradient_like(t).stride() for t in (q, k, v))
    plan = dict(registry=registry, target=target, causal=causal_mode, window=window, softcap=softcap, scale=scale,
                deterministic=deterministic,
                scores=scores, dims=dims, grad_strides=grad_strides, bias_grad=bias_grad, sink_grad=sink_grad,
                sink_parts=sink_parts)
    if q.shape[1] == 0 or shape.is_empty():
        return BackwardPlan(family=None, route=None, launches=(), scratch=(), kernels=(), copies=False, **plan)
    with inputs.kernel_written_allocations():  # the gradients' layouts that run() makes
        if dims != (d_qk, d_v):
            q, k, v = padded(q, dims[0]), padded(k, dims[0]), padded(v, dims[1])
            out, dout = padded(out, dims[1]), padded(dout, dims[1])
            grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        else:
            grads = _gradient_buffers((dq, dk, dv), (q, k, v), grad_strides, None)
    kernel = tuple(inputs.kernel_layout(t) for t in (q, k, v, out, dout))
    copies = any(kt is not t for kt, t in zip(kernel, (q, k, v, out, dout)))
    q, k, v, out, dout = kernel
    call = BackwardCall(dout, q, k, v, out, lse.contiguous(), *grads, causal_mode, scale, deterministic, kernel_bias,
                        bias_grad, packed, dlse, kernel_sink, sink_parts, window, softcap, not partial_keys)
    with inputs.kernel_written_allocations():
        family, planned, scratch = families.plan("backward", call, backend, target, registry, q.device)
    log.debug("flashkiln backward: %s family, %s, dq route %s", family, planned.launches[1].entry.name,
              planned.route)
    launches = tuple(planned.launches)
    direct = (packed is None and bias is None and sink is None and dims == (d_qk, d_v) and not copies
              and dq is None and dk is None and dv is None and all(s.role != "dk_accum" for s in scratch.specs))
    return BackwardPlan(family=family, route=planned.route, launches=launches, scratch=tuple(scratch.specs),
                        kernels=load_kernels(registry, target, launches), copies=copies,
                        fresh=fresh_gradients(grads) if direct else None, **plan)


def fresh_gradients(grads: tuple[torch.Tensor, ...]) -> FreshGradients:
    """BackwardPlan.fresh: how the direct path makes gradients like the planning call's dq, dk, dv."""
    return FreshGradients(tuple((tuple(t.shape), t.stride()) for t in grads), grads[0].dtype, grads[0].device,
                          torch.are_deterministic_algorithms_enabled())


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, *, dlse: torch.Tensor | None = None, causal: str | None = None,
                       window_size: tuple[int, int] | None = None, softcap: float | None = None,
                       scale: float | None = None, bias: torch.Tensor | None = None, bias_grad: bool = False,
                       sink: torch.Tensor | None = None, sink_grad: bool = False, deterministic: bool | None = None,
                       packed: PackedBatch | None = None, dq: torch.Tensor | None = None,
                       dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                       partial_keys: bool = False, registry: KernelRegistry | None = None,
                       backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv) of attention_forward's `out` (and `lse`, for `dlse`) for the upstream
    gradient `dout`, then dbias when `bias_grad` (in the bias's own shape, summed over its broadcast
    dims), then dsink when `sink_grad`.

    q, k, v, causal, window_size, softcap, scale, bias and sink as given to the forward; out and lse are what it
    returned (with sinks, lse includes them, and the kernels need nothing else). dlse: the LSE's
    upstream gradient (fp32, lse's shape), or None for none (ring attention merges partial results
    through their LSEs, and so needs it). partial_keys: out and lse are of attention over more keys
    than k and v hold (a block of ring attention, flashkiln.ring), so the kernels take each row's
    delta from rowsum(dout * out) alone (where a call holds all of a row's keys, they otherwise
    recompute it from the unrounded P and dP, which is exact only then).
    dbias follows `deterministic` too: where the hopper family's main kernel sums the dS of the
    pairs that share a bias broadcast over batch entries or heads (packed batches, head dims 192/128
    and 256, and a bias shared by heads above head dim 64: hopper_family.dbias_kernel), they add in
    any order unless deterministic; every other dbias is deterministic either way. With a bias
    the portable family runs a deterministic route
    whatever `deterministic` says (its only biased kernels), and so does the hopper family for a
    call without a causal mask above head dim 128 that stores a full bias's dS as dbias (where that
    route measured faster, hopper_family.ordered); otherwise it follows `deterministic`.
    deterministic: bitwise-reproducible dq, and with GQA dk and dv (which the hopper family
    otherwise adds into fp32 sums per KV head in any order; without GQA they always are); default
    torch.are_deterministic_algorithms_enabled(). How dq is accumulated (flashkiln.dq_routes): in
    place by default; on the portable family, where it is faster, dS can be kept in a workspace of
    B * H_q * S_q * S_k elements and dq computed from it by a second kernel, if that fits
    $FLASHKILN_BACKWARD_WORKSPACE_MIB (default 0: off). dBias of a bias that varies along the keys
    keeps dS in that workspace on the portable family; the hopper family stores a full bias's dS
    there and reduces a broadcast one's in its kernel (flashkiln.bias). Gradients come back with
    their inputs' strides (contiguous where those strides are not 16-byte aligned), or in the
    buffers dq, dk, dv when given (which must not overlap themselves or an input). A query row that
    saw no key gets a zero dq row.

    packed: a packed variable-length batch, as given to the forward (flashkiln.varlen); every
    token tensor is then (total, H, d) and lse (H_q, total_q). Tokens that lie in no sequence get
    zero gradients, in given buffers too.

    backend: the kernel family, as attention_forward's (flashkiln.families); None takes the best
    that has backward kernels for the call (the hopper family, then the portable one: the hopper
    backward has head dims 64, 96, 128, 192/128 and 256). Plans are cached per call key
    (flashkiln.plan_cache): a repeated call runs only its launches.
    """
    key = None
    if dq is None and dk is None and dv is None:
        try:
            key = _key(dout, q, k, v, out, lse, dlse, causal, window_size, softcap, scale, bias, bias_grad, sink,
                       sink_grad, deterministic, packed, partial_keys, registry, backend)
        except (AttributeError, TypeError):  # not tensors (or unhashable): the checks say what is wrong
            key = None
    plan = None if key is None else PLANS.get(key)
    if plan is None:
        plan = plan_backward(dout, q, k, v, out, lse, dlse, causal, window_size, softcap, scale, bias, bias_grad,
                             sink, sink_grad, deterministic, packed, dq, dk, dv, partial_keys, registry, backend)
        if key is not None:
            PLANS.put(key, plan)
    return plan.run(dout, q, k, v, out, lse, dlse, bias, sink, packed, dq, dk, dv)


def backward_after(forward_plan: ForwardPlan, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: str | None,
                   window_size: tuple[int, int] | None, softcap: float | None, scale: float | None,
                   deterministic: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention_backward(dout, q, k, v, out, lse, ...) of a dense call without bias or sink, where q, k,
    v and these score arguments are those of a forward call that ran `forward_plan` (with the default
    registry and backend) and made out and lse itself: autograd's eager backward (flashkiln.ops).
    Such a call's plan depends on the forward's key and on dout, deterministic and the settings the
    backward reads at planning alone, so it is cached on the forward plan by those: the other five
    tensors' keys are not read again."""
    key = (tensor_key(dout), type(deterministic), deterministic, torch.are_deterministic_algorithms_enabled(),
           dq_routes.settings())
    plan = forward_plan.backward_plans.get(key)
    if plan is None:
        plan = plan_backward(dout, q, k, v, out, lse, None, causal, window_size, softcap, scale, None, False, None,
                             False, deterministic, None, None, None, None, False, None, None)
        forward_plan.backward_plans[key] = plan
    return plan.run(dout, q, k, v, out, lse, None, None, None, None, None, None, None)


def _check_gradient_buffers(buffers: tuple[torch.Tensor | None, ...], likes: tuple[torch.Tensor, ...],
                            readers: dict[str, torch.Tensor | None], written_in_place: bool) -> None:
    """The caller's dq, dk, dv buffers (None: made by the call) against their inputs and each other."""
    checked: dict[str, torch.Tensor] = {}
    for name, buffer, like in zip(("dq", "dk", "dv"), buffers, likes):
        if buffer is not None:
            _check_gradient_buffer(name, buffer, like, {**readers, **checked}, written_in_place)
            checked[name] = buffer


def _gradient_buffers(buffers: tuple[torch.Tensor | None, ...], likes: tuple[torch.Tensor, ...],
                      strides: tuple[tuple[int, ...], ...], packed: PackedBatch | None) -> list[torch.Tensor]:
    """dq, dk, dv: the caller's buffers (for a packed batch zeroed where no sequence is), or fresh ones
    with the plan's strides (their inputs' where those suit the kernels)."""
    grads = []
    for buffer, like, stride, cu in zip(buffers, likes, strides, ("cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k")):
        if buffer is None:
            buffer = torch.empty_strided(like.shape, stride, dtype=like.dtype, device=like.device)
            if packed is not None:
                buffer.zero_()  # the kernels write the tokens inside sequences only
        elif packed is not None:
            buffer.masked_fill_(~_token_rows(getattr(packed, cu), buffer), 0.0)
        grads.append(buffer)
    return grads


def _score_gradients(scratch: dict[str, torch.Tensor], bias: KernelBias | None, sink: torch.Tensor | None,
                     kernel_sink: torch.Tensor | None, lse: torch.Tensor, dlse: torch.Tensor | None,
                     packed: PackedBatch | None, total_q: int) -> tuple[torch.Tensor, ...]:
    """(dbias when `bias`,) then (dsink when `sink`,) from what the kernels left in `scratch`."""
    extra: tuple[torch.Tensor, ...] = ()
    if bias is not None and bias.key_constant:
        per_row, valid = (lse, scratch["delta"], dlse), None
        if packed is not None:
            per_row, valid = sequence_rows(per_row, packed)
        extra = (key_constant_gradient(bias, *per_row, kernel_sink, scratch.get("dsink_parts"), valid),)
    elif bias is not None:
        extra = (bias_gradient(scratch, bias),)
    if sink is not None:
        rows = None if packed is None else token_mask(packed.cu_seqlens_q, total_q)
        extra += (sink_gradient(sink, scratch["dsink_parts"], lse, dlse, rows),)
    return extra


def _token_rows(cu_seqlens: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Bool, broadcastable to a (1, H, total, d) gradient: its tokens that lie in a sequence."""
    return token_mask(cu_seqlens, grad.shape[2])[None, None, :, None]


def _unbatched(grads: tuple[torch.Tensor, ...], packed: PackedBatch | None) -> tuple[torch.Tensor, ...]:
    """The gradients in the callers' layout: (total, H, d) again for a packed batch."""
    return grads if packed is None else tuple(as_tokens(g) for g in grads)
