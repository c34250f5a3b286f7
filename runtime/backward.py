"""The attention backward: checks, kernel choice, workspaces, the three launches, GQA reduction."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from . import inputs
from .launch import KernelLaunch, Target, ceil_div, request, run
from .params import BwdParams
from .registry import KernelRegistry, default_registry

log = logging.getLogger("flashkiln")


@dataclass(frozen=True)
class BackwardPlan:
    launches: list[KernelLaunch]  # preprocess, main, postprocess
    # How dQ is accumulated: "atomic" (unordered fp32 atomics) or "ordered" (key tiles add in
    # order, behind a per-query-tile semaphore: bitwise reproducible).
    route: str
    # fp32 per-query-head dK/dV that the host sums over each GQA group (None without GQA).
    dk_accum: torch.Tensor | None
    dv_accum: torch.Tensor | None
    # Scratch the kernels use (delta, dQ accumulator, semaphores): alive as long as the plan; the
    # stream orders the memory's reuse after the kernels.
    workspaces: tuple[torch.Tensor | None, ...]


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
                  deterministic: bool, capability: tuple[int, int], registry: KernelRegistry) -> BackwardPlan:
    """Choose the kernels, allocate their workspaces and pack the parameters (inputs already checked)."""
    b, hq, sq, dqk = q.shape
    _, hkv, sk, dv_dim = v.shape
    dtype = inputs.DTYPES[q.dtype]
    main = registry.find(request("bwd", dtype, dqk, dv_dim, causal, deterministic), capability)
    pre = registry.find(request("bwd_pre", dtype, dqk, dv_dim), capability)
    post = registry.find(request("bwd_post", dtype, dqk, dv_dim), capability)
    tile_m, tile_n = main.descriptor["tile_m"], main.descriptor["tile_n"]
    sq_rounded = ceil_div(sq, tile_m) * tile_m
    f32 = dict(dtype=torch.float32, device=q.device)
    delta = torch.empty((b, hq, sq), **f32)
    dq_accum = torch.empty((b, hq, sq_rounded, dqk), **f32)  # zeroed by the preprocess
    semaphore = torch.zeros((b, hq, sq_rounded // tile_m), dtype=torch.int32, device=q.device) \
        if deterministic else None
    grouped = hq != hkv
    dk_accum = torch.empty((b, hq, sk, dqk), **f32) if grouped else None
    dv_accum = torch.empty((b, hq, sk, dv_dim), **f32) if grouped else None
    address = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    params = BwdParams(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(), dout=dout.data_ptr(),
        lse=lse.data_ptr(), delta=delta.data_ptr(), dq_accum=dq_accum.data_ptr(), dq=dq.data_ptr(),
        dk=dk.data_ptr(), dv=dv.data_ptr(), dk_accum=address(dk_accum), dv_accum=address(dv_accum),
        dq_semaphore=address(semaphore),
        **inputs.stride_fields("q", q), **inputs.stride_fields("k", k), **inputs.stride_fields("v", v),
        **inputs.stride_fields("o", out), **inputs.stride_fields("do", dout), **inputs.stride_fields("dq", dq),
        **inputs.stride_fields("dk", dk), **inputs.stride_fields("dv", dv),
        batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, seqlen_q_rounded=sq_rounded,
        scale=scale, scale_log2=scale * math.log2(math.e),
    )
    launches = [
        KernelLaunch(pre, (ceil_div(sq_rounded, pre.descriptor["tile_m"]), hq, b), params),
        KernelLaunch(main, (ceil_div(sk, tile_n), hq, b), params),
        KernelLaunch(post, (ceil_div(sq, post.descriptor["tile_m"]), hq, b), params),
    ]
    return BackwardPlan(launches, "ordered" if deterministic else "atomic", dk_accum, dv_accum,
                        (delta, dq_accum, semaphore))


def _check_gradient_buffer(name: str, buffer: torch.Tensor, like: torch.Tensor) -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.shape != like.shape or buffer.dtype != like.dtype \
            or buffer.device != like.device:
        inputs.fail(f"{name} must be a {like.dtype} tensor of shape {tuple(like.shape)} on {like.device}")
    if buffer.numel() and not inputs.is_kernel_layout(buffer):
        inputs.fail(f"{name} must have a contiguous head dim and 16-byte aligned strides and base, "
                    f"got strides {buffer.stride()}")


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, *, causal: str | None = None, scale: float | None = None,
                       deterministic: bool | None = None, dq: torch.Tensor | None = None,
                       dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                       registry: KernelRegistry | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention_forward's `out` for the upstream gradient `dout`.

    q, k, v, causal and scale as given to the forward; out and lse are what it returned.
    deterministic: bitwise-reproducible dq (dk, dv are always); default
    torch.are_deterministic_algorithms_enabled(). Gradients come back with their inputs' strides
    (contiguous where those strides are not 16-byte aligned), or in the buffers dq, dk, dv when
    given. A query row that saw no key gets a zero dq row.
    """
    inputs.check_qkv(q, k, v)
    causal_mode, scale = inputs.check_causal_scale(causal, scale, q.shape[3])
    _check_backward_tensors(dout, q, out, lse, v.shape[3])
    if q.device.type != "cuda":
        inputs.fail(f"inputs must be CUDA tensors, got device {q.device}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    grads = []
    for name, buffer, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if buffer is None:
            buffer = inputs.empty_gradient_like(like)
        _check_gradient_buffer(name, buffer, like)
        grads.append(buffer)
    dq, dk, dv = grads
    b, hq, sq, _ = q.shape
    if b * hq == 0 or sq == 0 or k.shape[2] == 0:
        # No query or no key: every gradient is zero (and possibly empty).
        return dq.zero_(), dk.zero_(), dv.zero_()
    q, k, v, out, dout = (inputs.kernel_layout(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    registry = registry or default_registry()
    target = Target.of(q)
    plan = plan_backward(dout, q, k, v, out, lse, dq, dk, dv, causal_mode, scale, deterministic,
                         target.capability, registry)
    log.debug("flashkiln backward: %s, dq route %s", plan.launches[1].entry.name, plan.route)
    run(registry, target, plan.launches)
    if plan.dk_accum is not None:
        # GQA: sum each group's per-query-head gradients (a fixed-order, deterministic reduction).
        hkv = k.shape[1]
        group = hq // hkv
        dk.copy_(plan.dk_accum.view(b, hkv, group, *plan.dk_accum.shape[2:]).sum(2))
        dv.copy_(plan.dv_accum.view(b, hkv, group, *plan.dv_accum.shape[2:]).sum(2))
    return dq, dk, dv
