"""The portable family's planners: mma.sync kernels (templates/include/flashkiln/portable), sm_80 on.

Forward: one kernel, a CTA per (query tile, head, batch entry). Backward: a preprocess (delta and
zeroing the dQ accumulator), the main kernel (a CTA per key tile) and then the postprocess (dQ from
its fp32 accumulator) or, on the workspace route, the dQ kernel (flashkiln.dq_routes).
"""
from __future__ import annotations

import logging

import torch

from . import dq_routes, inputs
from .bias import ds_row_elements
from .calls import BackwardCall, ForwardCall
from .errors import UnsupportedError, VariantNotFoundError
from .launch import BackwardLaunches, KernelLaunch, ScratchSet, Target, ceil_div
from .manifest import KernelEntry
from .params import BwdParams, FwdParams
from .registry import KernelRegistry
from .varlen import BatchShape

NAME = "portable"
log = logging.getLogger("flashkiln")


def runs_on(capability: tuple[int, int]) -> str | None:
    """Why the family cannot run on `capability` (None: it can, given its variants): mma.sync of sm_80."""
    return None if capability >= (8, 0) else (f"the portable family needs compute capability 8.0 or later, this "
                                              f"GPU has {capability[0]}.{capability[1]}")


def plan_forward(call: ForwardCall, target: Target, registry: KernelRegistry,
                 scratch: ScratchSet) -> list[KernelLaunch]:
    """The forward kernel for the call's variant (its default tuning), its grid and parameters."""
    q, k, v, out = call.q, call.k, call.v, call.out
    shape = call.shape
    # Portable kernels read the sequence bounds at run time: their packed=false variants take packed batches.
    entry = registry.find({**call.request(NAME), "packed": False}, *target.limits)
    params = FwdParams(
        **inputs.stride_fields("q", q), **inputs.stride_fields("k", k), **inputs.stride_fields("v", v),
        **inputs.stride_fields("o", out), **(call.bias.stride_fields() if call.bias is not None else {}),
        heads_q=q.shape[1], heads_kv=k.shape[1], **shape.params(), **inputs.score_fields(call.scale, call.softcap),
        **inputs.reach_fields(call.window, call.causal),
    )
    grid = (ceil_div(shape.seqlen_q, entry.descriptor["tile_m"]), q.shape[1], shape.batch)
    return [KernelLaunch.planned(entry, grid, params, call.tensors())]


def ordered(call: BackwardCall) -> bool:
    """Whether the call takes a deterministic route here: when asked to, and always with a bias,
    whose only backward kernels are the deterministic variants (specs/portable.yaml)."""
    return call.deterministic or call.bias is not None


def backward_request(call: BackwardCall) -> dict:
    """The functional fields of the call's main backward kernel (ordered's variant)."""
    return {**call.request(NAME), "deterministic": ordered(call)}


def plan_backward(call: BackwardCall, target: Target, registry: KernelRegistry,
                  scratch: ScratchSet) -> BackwardLaunches:
    """Choose the route and kernels, take their scratch and pack the parameters. With a bias the main
    kernel is a deterministic one (the variants the specs generate for it); with `bias_grad` the
    route is the workspace one, whose dS tiles become dBias (a key-constant bias needs no dS:
    bias.key_constant_gradient).

    Scratch roles: delta (fp32 rowsum(dO * O) - dLSE, as lse), dq_accum (the atomic and ordered
    routes' fp32 dQ), dq_semaphore (the ordered route's per-query-tile counters), ds_workspace (the
    workspace route's dense dS), dk_accum and dv_accum (GQA: fp32 per-query-head dK and dV, summed
    over each group afterwards), dsink_parts (fp32 (B, H_q, key tiles) sums of p_sink * P * dP)."""
    q, k, v = call.q, call.k, call.v
    _, hq, _, dqk = q.shape
    _, hkv, _, dv_dim = v.shape
    shape = call.shape
    b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    has_bias = call.bias is not None
    deterministic = ordered(call)
    ds_needed = call.bias_grad and not call.bias.key_constant
    workspace_kernels = _workspace_kernels(call, shape, deterministic, ds_needed, target, registry)
    if workspace_kernels is not None:
        route, (main, dq_kernel) = "workspace", workspace_kernels
    else:
        route, dq_kernel = dq_routes.fallback_route(deterministic), None
        main = registry.find(backward_request(call), *target.limits)
    pre = registry.find(call.kernel_request("bwd_pre", NAME), *target.limits)
    tile_m, tile_n = main.descriptor["tile_m"], main.descriptor["tile_n"]
    sq_rounded, dq_accum_rows = shape.seqlen_q_rounded, shape.dq_accum_rows
    f32 = torch.float32
    layout_batches = q.shape[0]  # 1 for a packed batch: every sequence lives in entry 0
    scratch.take("delta", (layout_batches, hq, shape.total_q), f32)
    if hq != hkv:
        # Zeros for the keys of a packed batch that lie in no sequence.
        for role, dim in (("dk_accum", dqk), ("dv_accum", dv_dim)):
            scratch.take(role, (layout_batches, hq, shape.total_k, dim), f32, zeroed=call.packed is not None)
    else:
        scratch.absent("dk_accum")
        scratch.absent("dv_accum")
    if route == "workspace":
        scratch.absent("dq_accum")
        scratch.absent("dq_semaphore")
        # dBias reads every tile, also those no key tile visits (a causal mask or a window) and
        # those past a packed sequence's ends: they must be zeros.
        skips_tiles = call.causal != "none" or call.window is not None or call.packed is not None
        scratch.take("ds_workspace", (workspace_elements(shape, hq),), q.dtype, zeroed=ds_needed and skips_tiles)
    else:
        scratch.take("dq_accum", (layout_batches, hq, dq_accum_rows, dqk), f32)  # zeroed by the preprocess
        if route == "ordered":
            scratch.take("dq_semaphore", (b, hq, sq_rounded // tile_m), torch.int32, zeroed=True)
        else:
            scratch.absent("dq_semaphore")
        scratch.absent("ds_workspace")
    key_tiles = ceil_div(sk, tile_n)
    if call.sink_parts:  # zeros: the CTAs past a shorter packed sequence's key tiles write nothing
        scratch.take("dsink_parts", (b, hq, key_tiles), f32, zeroed=True)
    else:
        scratch.absent("dsink_parts")
    params = BwdParams(
        **(call.bias.stride_fields() if has_bias else {}),
        **inputs.stride_fields("q", q), **inputs.stride_fields("k", k), **inputs.stride_fields("v", v),
        **inputs.stride_fields("o", call.out), **inputs.stride_fields("do", call.dout),
        **inputs.stride_fields("dq", call.dq), **inputs.stride_fields("dk", call.dk),
        **inputs.stride_fields("dv", call.dv),
        heads_q=hq, heads_kv=hkv, **shape.params(), seqlen_q_rounded=sq_rounded, dq_accum_rows=dq_accum_rows,
        **inputs.score_fields(call.scale, call.softcap), **inputs.reach_fields(call.window, call.causal),
        keys_complete=int(call.keys_complete),
    )
    tensors = {**call.tensors(), **scratch.tensors}
    if dq_kernel is not None:
        last, last_grid = dq_kernel, (ceil_div(sq, tile_m), hq, b)
    else:
        last = registry.find(call.kernel_request("bwd_post", NAME), *target.limits)
        last_grid = (ceil_div(sq, last.descriptor["tile_m"]), hq, b)
    launches = [KernelLaunch.planned(pre, (ceil_div(sq_rounded, pre.descriptor["tile_m"]), hq, b), params, tensors),
                KernelLaunch.planned(main, (key_tiles, hq, b), params, tensors),
                KernelLaunch.planned(last, last_grid, params, tensors)]
    return BackwardLaunches(launches, route)


def workspace_elements(shape: BatchShape, hq: int) -> int:
    """dS workspace size: dense (B, H_q, S_q, S_k) with rows padded to 16 bytes (bwd_tiles.hpp)."""
    return shape.batch * hq * shape.seqlen_q * ds_row_elements(shape.seqlen_k)


def _workspace_kernels(call: BackwardCall, shape: BatchShape, deterministic: bool, required: bool, target: Target,
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
    if not strict and dq_routes.preferred_route(call.q.shape[3], deterministic) != "workspace":
        return None
    try:
        # The deterministic main kernel is the one that can store dS (even for a call that is not).
        main = registry.find(call.kernel_request("bwd", NAME, causal=call.causal, deterministic=True,
                                                 bias="none" if call.bias is None else "additive"), *target.limits)
        dq_kernel = registry.find(call.kernel_request("bwd_dq", NAME, causal=call.causal), *target.limits)
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
    size = workspace_elements(shape, call.q.shape[1]) * call.q.element_size()
    budget = dq_routes.workspace_budget_bytes()
    if not strict and size > budget:
        log.debug("flashkiln backward: dS workspace of %d MiB exceeds the budget of %d MiB (%s)",
                  size >> 20, budget >> 20, dq_routes.WORKSPACE_BUDGET_ENV)
        return None
    return main, dq_kernel
