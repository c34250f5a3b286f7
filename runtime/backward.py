"""The attention backward: checks, kernel choice, workspaces, the three launches, GQA reduction."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from . import dq_routes, inputs
from .bias import KernelBias, bias_gradient, ds_row_elements, key_constant_gradient, prepare_bias
from .errors import UnsupportedError, VariantNotFoundError
from .head_dims import kernel_dims, padded
from .launch import KernelLaunch, Target, ceil_div, request, run
from .manifest import KernelEntry
from .params import DQ_ACCUM_ROW_ALIGN, BwdParams
from .registry import KernelRegistry, default_registry
from .sinks import prepare_sink, sink_gradient
from .varlen import (TOKENS, BatchShape, PackedBatch, as_batched, as_tokens, batched_view, check_packed,
                     sequence_rows, token_mask)

log = logging.getLogger("flashkiln")

@dataclass(frozen=True)
class BackwardPlan:
    launches: list[KernelLaunch]  # preprocess, main, then postprocess or (workspace route) the dQ kernel
    route: str  # how dQ is accumulated: one of dq_routes.ROUTES

    # fp32 per-query-head dK/dV that the host sums over each GQA group (None without GQA).
    dk_accum: torch.Tensor | None
    dv_accum: torch.Tensor | None
    scratch: "BackwardScratch"


@dataclass(frozen=True)
class BackwardScratch:
    """What the kernels use besides the gradients: alive as long as the plan; the stream orders the
    memory's reuse after the kernels. None where the route does not use it."""

    delta: torch.Tensor  # fp32, as lse: rowsum(dO * O) - dLSE
    dq_accum: torch.Tensor | None  # fp32 dQ accumulator (atomic and ordered routes)
    semaphore: torch.Tensor | None  # int32 per query tile (ordered route)
    ds_workspace: torch.Tensor | None  # dense dS (workspace route)
    sink_parts: torch.Tensor | None  # fp32 (B, H_q, key tiles): sums of p_sink * P * dP


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


def plan_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: str, scale: float,
                  deterministic: bool, capability: tuple[int, int], device_memory: int,
                  registry: KernelRegistry, bias: KernelBias | None = None, bias_grad: bool = False,
                  packed: PackedBatch | None = None, dlse: torch.Tensor | None = None,
                  sink: torch.Tensor | None = None, sink_parts: bool = False) -> BackwardPlan:
    """Choose the route and kernels, allocate their workspaces and pack the parameters (inputs already
    checked; for a packed batch, their (1, H, total, d) views). `device_memory` (bytes) sets the
    default workspace budget. With a bias the main kernel is a deterministic one (the variants the
    specs generate for it); with `bias_grad` the route is the workspace one, whose dS tiles become
    dBias (a key-constant bias needs no dS: bias.key_constant_gradient). `dlse`: the LSE's upstream
    gradient, or None; `sink` (the forward's fp32 sinks) with `sink_parts`: the main kernel sums
    p_sink * P * dP per key tile (for dSink)."""
    _, hq, _, dqk = q.shape
    _, hkv, _, dv_dim = v.shape
    shape = BatchShape.of(q, k, packed)
    b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    dtype = inputs.DTYPES[q.dtype]
    has_bias = bias is not None
    deterministic = deterministic or has_bias
    ds_needed = bias_grad and not bias.key_constant
    workspace_kernels = _workspace_kernels(q, shape, dv_dim, causal, deterministic, has_bias, ds_needed,
                                           capability, device_memory, registry)
    if workspace_kernels is not None:
        route, (main, dq_kernel) = "workspace", workspace_kernels
    else:
        route, dq_kernel = dq_routes.fallback_route(deterministic), None
        main = registry.find(request("bwd", dtype, dqk, dv_dim, causal, deterministic, has_bias), capability)
    pre = registry.find(request("bwd_pre", dtype, dqk, dv_dim), capability)
    tile_m, tile_n = main.descriptor["tile_m"], main.descriptor["tile_n"]
    sq_rounded = ceil_div(sq, DQ_ACCUM_ROW_ALIGN) * DQ_ACCUM_ROW_ALIGN
    # Dense: (B, H_q, sq_rounded); packed: (1, H_q, total_q + B * align) (sequence.hpp).
    dq_accum_rows = sq_rounded if packed is None else shape.total_q + b * DQ_ACCUM_ROW_ALIGN
    f32 = dict(dtype=torch.float32, device=q.device)
    grouped = hq != hkv
    layout_batches = q.shape[0]  # 1 for a packed batch: every sequence lives in entry 0
    with inputs.kernel_written_allocations():
        delta = torch.empty((layout_batches, hq, shape.total_q), **f32)
        # fp32 per-query-head dK and dV for GQA, summed over each group afterwards (zeros for the
        # keys of a packed batch that lie in no sequence).
        per_head = torch.zeros if packed is not None else torch.empty
        dk_accum = per_head((layout_batches, hq, shape.total_k, dqk), **f32) if grouped else None
        dv_accum = per_head((layout_batches, hq, shape.total_k, dv_dim), **f32) if grouped else None
        if route == "workspace":
            dq_accum = semaphore = None
            # dBias reads every tile, also those no key tile visits (causal) and those past a
            # packed sequence's ends: they must be zeros.
            allocate = torch.zeros if ds_needed and (causal != "none" or packed is not None) else torch.empty
            workspace = allocate(_workspace_elements(shape, hq), dtype=q.dtype, device=q.device)
        else:
            dq_accum = torch.empty((layout_batches, hq, dq_accum_rows, dqk), **f32)  # zeroed by the preprocess
            semaphore = torch.zeros((b, hq, sq_rounded // tile_m), dtype=torch.int32, device=q.device) \
                if route == "ordered" else None
            workspace = None
    key_tiles = ceil_div(sk, tile_n)
    # Zeros: the CTAs past a shorter packed sequence's key tiles write nothing.
    parts = torch.zeros((b, hq, key_tiles), **f32) if sink_parts else None
    address = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    params = BwdParams(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(), dout=dout.data_ptr(),
        lse=lse.data_ptr(), delta=delta.data_ptr(), dq_accum=address(dq_accum), dq=dq.data_ptr(),
        dk=dk.data_ptr(), dv=dv.data_ptr(), dk_accum=address(dk_accum), dv_accum=address(dv_accum),
        dq_semaphore=address(semaphore), ds_workspace=address(workspace), dlse=address(dlse),
        sink=address(sink if sink_parts else None), dsink_parts=address(parts),
        bias=0 if bias is None else bias.tensor.data_ptr(), **(bias.stride_fields() if bias is not None else {}),
        **inputs.stride_fields("q", q), **inputs.stride_fields("k", k), **inputs.stride_fields("v", v),
        **inputs.stride_fields("o", out), **inputs.stride_fields("do", dout), **inputs.stride_fields("dq", dq),
        **inputs.stride_fields("dk", dk), **inputs.stride_fields("dv", dv),
        heads_q=hq, heads_kv=hkv, **shape.params(), seqlen_q_rounded=sq_rounded, dq_accum_rows=dq_accum_rows,
        scale=scale, scale_log2=scale * math.log2(math.e),
    )
    launches = [
        KernelLaunch(pre, (ceil_div(sq_rounded, pre.descriptor["tile_m"]), hq, b), params),
        KernelLaunch(main, (key_tiles, hq, b), params),
    ]
    if dq_kernel is not None:
        launches.append(KernelLaunch(dq_kernel, (ceil_div(sq, tile_m), hq, b), params))
    else:
        post = registry.find(request("bwd_post", dtype, dqk, dv_dim), capability)
        launches.append(KernelLaunch(post, (ceil_div(sq, post.descriptor["tile_m"]), hq, b), params))
    return BackwardPlan(launches, route, dk_accum, dv_accum, BackwardScratch(delta, dq_accum, semaphore, workspace,
                                                                             parts))


def _workspace_elements(shape: BatchShape, hq: int) -> int:
    """dS workspace size: dense (B, H_q, S_q, S_k) with rows padded to 16 bytes (bwd_tiles.hpp)."""
    return shape.batch * hq * shape.seqlen_q * ds_row_elements(shape.seqlen_k)


def _workspace_kernels(q: torch.Tensor, shape: BatchShape, d_v: int, causal: str, deterministic: bool,
                       has_bias: bool, required: bool, capability: tuple[int, int], device_memory: int,
                       registry: KernelRegistry) -> tuple[KernelEntry, KernelEntry] | None:
    """(main kernel, dQ kernel) of the workspace route when the call takes it, else None.

    `required` (dBias) or forced by $FLASHKILN_BACKWARD_ROUTE, it is taken or fails; otherwise it
    is taken where it is the faster route (dq_routes.preferred_route), within the workspace
    budget, and when the spec generated both kernels with the same tiles."""
    forced = dq_routes.forced_route(deterministic)
    if forced not in (None, "workspace"):
        if required:
            raise UnsupportedError(f"{dq_routes.ROUTE_ENV}={forced}: dBias comes from the workspace route's dS tiles")
        return None
    strict = required or forced == "workspace"
    if not strict and dq_routes.preferred_route(q.shape[3], deterministic) != "workspace":
        return None
    dtype, dqk = inputs.DTYPES[q.dtype], q.shape[3]
    try:
        # The deterministic main kernel is the one that can store dS (even for a call that is not).
        main = registry.find(request("bwd", dtype, dqk, d_v, causal, True, has_bias), capability)
        dq_kernel = registry.find(request("bwd_dq", dtype, dqk, d_v, causal), capability)
    except VariantNotFoundError:
        if strict:
            raise
        log.debug("flashkiln backward: no deterministic bwd and bwd_dq kernels for the workspace route")
        return None
    tiles = (main.descriptor["tile_m"], main.descriptor["tile_n"])
    if (dq_kernel.descriptor["tile_m"], dq_kernel.descriptor["tile_n"]) != tiles:
        message = f"{dq_kernel.name} does not share the tiles {tiles} of {main.name}"
        if strict:
            raise UnsupportedError(f"the workspace route cannot run: {message}")
        log.debug("flashkiln backward: %s", message)
        return None
    size = _workspace_elements(shape, q.shape[1]) * q.element_size()
    budget = dq_routes.workspace_budget_bytes(device_memory)
    if not strict and size > budget:
        log.debug("flashkiln backward: dS workspace of %d MiB exceeds the budget of %d MiB (%s)",
                  size >> 20, budget >> 20, dq_routes.WORKSPACE_BUDGET_ENV)
        return None
    return main, dq_kernel


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


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, *, dlse: torch.Tensor | None = None, causal: str | None = None,
                       scale: float | None = None, bias: torch.Tensor | None = None, bias_grad: bool = False,
                       sink: torch.Tensor | None = None, sink_grad: bool = False, deterministic: bool | None = None,
                       packed: PackedBatch | None = None, dq: torch.Tensor | None = None,
                       dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                       registry: KernelRegistry | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv) of attention_forward's `out` (and `lse`, for `dlse`) for the upstream
    gradient `dout`, then dbias when `bias_grad` (in the bias's own shape, summed over its broadcast
    dims), then dsink when `sink_grad`.

    q, k, v, causal, scale, bias and sink as given to the forward; out and lse are what it
    returned (with sinks, lse includes them, and the kernels need nothing else). dlse: the LSE's
    upstream gradient (fp32, lse's shape), or None for none (ring attention merges partial results
    through their LSEs, and so needs it).
    With a bias, the backward runs a deterministic route, and dbias is deterministic too.
    deterministic: bitwise-reproducible dq (dk, dv are always); default
    torch.are_deterministic_algorithms_enabled(). How dq is accumulated (flashkiln.dq_routes):
    where it is faster, dS is kept in a workspace of B * H_q * S_q * S_k elements (rounded up to
    whole tiles) and dq computed from it by a second kernel, if that fits
    $FLASHKILN_BACKWARD_WORKSPACE_MIB (default: 1/16 of the GPU's memory). Gradients come back with
    their inputs' strides (contiguous where those strides are not 16-byte aligned), or in the
    buffers dq, dk, dv when given (which must not overlap themselves or an input). A query row that
    saw no key gets a zero dq row.

    packed: a packed variable-length batch, as given to the forward (flashkiln.varlen); every
    token tensor is then (total, H, d) and lse (H_q, total_q). Tokens that lie in no sequence get
    zero gradients, in given buffers too.
    """
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
    causal_mode, scale = inputs.check_causal_scale(causal, scale, q.shape[3])
    _check_backward_tensors(dout, q, out, lse, v.shape[3])
    if dlse is not None:
        dlse = _check_lse_gradient(dlse, lse)
    if q.device.type != "cuda":
        inputs.fail(f"inputs must be CUDA tensors, got device {q.device}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    dq_routes.forced_route(deterministic or bias is not None)  # a bad $FLASHKILN_BACKWARD_ROUTE fails on every call
    registry = registry or default_registry()
    target = Target.of(q)
    d_qk, d_v = q.shape[3], v.shape[3]
    dims = kernel_dims(d_qk, d_v, registry.head_dims("bwd", inputs.DTYPES[q.dtype], target.capability), "backward")
    if bias_grad and bias is None:
        inputs.fail("bias_grad=True needs the bias")
    kernel_bias = None if bias is None else prepare_bias(bias, shape.scores(q.shape[1]), q)
    if bias_grad and bias.dtype == torch.bool:
        inputs.fail("a boolean mask has no gradient: pass bias_grad=False")
    if sink_grad and sink is None:
        inputs.fail("sink_grad=True needs the sink")
    kernel_sink = None if sink is None else prepare_sink(sink, q)
    readers = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dlse": dlse, "bias": bias,
               "sink": sink}
    dq, dk, dv = _gradient_buffers((dq, dk, dv), (q, k, v), readers, packed, written_in_place=dims == (d_qk, d_v))
    hq = q.shape[1]
    if hq == 0 or shape.is_empty():
        # No query or no key: every gradient is zero (and possibly empty).
        extra = (torch.zeros(kernel_bias.shape, dtype=q.dtype, device=q.device),) if bias_grad else ()
        extra += (torch.zeros_like(sink),) if sink_grad else ()
        return (*_unbatched((dq.zero_(), dk.zero_(), dv.zero_()), packed), *extra)
    kernel_grads = (dq, dk, dv)
    if dims != (d_qk, d_v):  # flashkiln.head_dims: zero-padded copies, gradients copied back
        q, k, v = padded(q, dims[0]), padded(k, dims[0]), padded(v, dims[1])
        out, dout = padded(out, dims[1]), padded(dout, dims[1])
        allocate = torch.zeros if packed is not None else torch.empty
        kernel_grads = tuple(allocate(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    q, k, v, out, dout = (inputs.kernel_layout(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    closed_form_dbias = bias_grad and kernel_bias.key_constant
    sink_parts = kernel_sink is not None and (sink_grad or (closed_form_dbias and kernel_bias.rows_summed))
    plan = plan_backward(dout, q, k, v, out, lse, *kernel_grads, causal_mode, scale, deterministic,
                         target.capability, target.memory, registry, kernel_bias, bias_grad, packed, dlse,
                         kernel_sink, sink_parts)
    log.debug("flashkiln backward: %s, dq route %s", plan.launches[1].entry.name, plan.route)
    run(registry, target, plan.launches)
    if plan.dk_accum is not None:
        # GQA: sum each group's per-query-head gradients (a fixed-order, deterministic reduction).
        layout_batches, hkv = k.shape[:2]
        group = hq // hkv
        kernel_grads[1].copy_(plan.dk_accum.view(layout_batches, hkv, group, *plan.dk_accum.shape[2:]).sum(2))
        kernel_grads[2].copy_(plan.dv_accum.view(layout_batches, hkv, group, *plan.dv_accum.shape[2:]).sum(2))
    if dims != (d_qk, d_v):
        for grad, kernel_grad in zip((dq, dk, dv), kernel_grads):
            grad.copy_(kernel_grad[..., :grad.shape[-1]])
    extra = _score_gradients(plan.scratch, kernel_bias if bias_grad else None, sink if sink_grad else None,
                             kernel_sink, lse, dlse, packed, shape.total_q)
    return (*_unbatched((dq, dk, dv), packed), *extra)


def _gradient_buffers(buffers: tuple[torch.Tensor | None, ...], likes: tuple[torch.Tensor, ...],
                      readers: dict[str, torch.Tensor | None], packed: PackedBatch | None,
                      written_in_place: bool) -> list[torch.Tensor]:
    """dq, dk, dv: the caller's buffers, checked (and for a packed batch zeroed where no sequence is,
    once every check has passed), or fresh ones with their inputs' strides."""
    grads, given = [], []
    for name, buffer, like, cu in zip(("dq", "dk", "dv"), buffers, likes,
                                      ("cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k")):
        if buffer is None:
            with inputs.kernel_written_allocations():
                buffer = inputs.empty_gradient_like(like)
            if packed is not None:
                buffer.zero_()  # the kernels write the tokens inside sequences only
        else:
            _check_gradient_buffer(name, buffer, like, {**readers, **dict(zip(("dq", "dk"), grads))},
                                   written_in_place)
            if packed is not None:
                given.append((buffer, getattr(packed, cu)))
        grads.append(buffer)
    for buffer, cu_seqlens in given:
        buffer.masked_fill_(~_token_rows(cu_seqlens, buffer), 0.0)
    return grads


def _score_gradients(scratch: BackwardScratch, bias: KernelBias | None, sink: torch.Tensor | None,
                     kernel_sink: torch.Tensor | None, lse: torch.Tensor, dlse: torch.Tensor | None,
                     packed: PackedBatch | None, total_q: int) -> tuple[torch.Tensor, ...]:
    """(dbias when `bias`,) then (dsink when `sink`,) from what the kernels left in `scratch`."""
    extra: tuple[torch.Tensor, ...] = ()
    if bias is not None and bias.key_constant:
        per_row, valid = (lse, scratch.delta, dlse), None
        if packed is not None:
            per_row, valid = sequence_rows(per_row, packed)
        extra = (key_constant_gradient(bias, *per_row, kernel_sink, scratch.sink_parts, valid),)
    elif bias is not None:
        extra = (bias_gradient(scratch.ds_workspace, bias),)
    if sink is not None:
        rows = None if packed is None else token_mask(packed.cu_seqlens_q, total_q)
        extra += (sink_gradient(sink, scratch.sink_parts, lse, dlse, rows),)
    return extra


def _token_rows(cu_seqlens: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Bool, broadcastable to a (1, H, total, d) gradient: its tokens that lie in a sequence."""
    return token_mask(cu_seqlens, grad.shape[2])[None, None, :, None]


def _unbatched(grads: tuple[torch.Tensor, ...], packed: PackedBatch | None) -> tuple[torch.Tensor, ...]:
    """The gradients in the callers' layout: (total, H, d) again for a packed batch."""
    return grads if packed is None else tuple(as_tokens(g) for g in grads)
