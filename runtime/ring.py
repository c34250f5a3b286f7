"""Ring attention (context parallelism) over any attention op and any ring (flashkiln.ring_comm).

Forward: each rank keeps its query slice; K/V slices travel around the ring, the next one in
flight while the current step runs its call (flashkiln.ring_plan); the partial outputs merge into
fp32 accumulators through their LSEs (flashkiln.lse_merge). Backward: the ring is replayed with
the merged O and LSE (and the LSE's gradient), which make each step's gradients exact pieces of
the whole: dQ adds up locally in fp32; dK and dV add up in fp32 buffers that travel one step
behind the K/V slice they belong to and reach its owner after the last step.

Every sum runs in a fixed order for a fixed world size, so with a deterministic backward op the
results are bitwise reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import inputs
from .lse_merge import merge_into
from .ring_comm import Pending, Ring
from .ring_plan import CAUSAL, SKIP, step_plan

# forward(q, k, v, causal, scale) -> (out, lse); the causal mask is only ever asked for on a square
# block (top-left and bottom-right alike). backward(dout, q, k, v, out, lse, dlse, causal, scale,
# deterministic) -> (dq, dk, dv), with out, lse (and dlse, or None) given from outside.
ForwardOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]
BackwardOp = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StepOps:
    """The attention op each ring step runs on one (query rows, key rows) block. Its results must
    be fresh tensors: the ring accumulates into them."""

    forward: ForwardOp
    backward: BackwardOp


@dataclass(frozen=True)
class RingConfig:
    causal: bool
    load_balance: bool  # the slices hold head-tail chunk pairs (flashkiln.ring_plan)
    scale: float
    deterministic: bool | None  # passed to the backward op (None: its default)


def check_ring_inputs(qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                      config: RingConfig, local_ranks: int) -> None:
    """What the ring itself needs of the local slices, checked before anything moves."""
    if not (len(qs) == len(ks) == len(vs) == local_ranks):
        inputs.fail(f"one q, k and v per local rank ({local_ranks}), got {len(qs)}, {len(ks)}, {len(vs)}")
    for name, slices in (("q", qs), ("k", ks), ("v", vs)):
        for t in slices:
            inputs.check_tensor(name, t)
            if t.dim() != 4:
                inputs.fail(f"{name} must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
        if len({(tuple(t.shape), t.dtype, t.device) for t in slices}) > 1:
            inputs.fail(f"every rank's {name} slice must have the same shape, dtype and device")
    q, k, v = qs[0], ks[0], vs[0]
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        inputs.fail(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit together")
    if config.causal and q.shape[2] != k.shape[2]:
        inputs.fail(f"causal context parallelism needs query and key slices of one length, got {q.shape[2]} "
                    f"and {k.shape[2]}")
    if config.causal and config.load_balance and q.shape[2] % 2:
        inputs.fail(f"load-balanced causal slices hold two equal chunks: the local sequence length "
                    f"({q.shape[2]}) must be even")


class _Rotating:
    """One rank's visiting slices and the buffers the next ones arrive in. At most two sets live:
    the current and the incoming; a sent set is reused once its transfer is done, except the
    caller's own tensors, which are never written."""

    def __init__(self, first: tuple[torch.Tensor, ...], writable: bool) -> None:
        self.current = first
        self._spare: tuple[torch.Tensor, ...] | None = None
        self._writable = writable

    def incoming(self) -> tuple[torch.Tensor, ...]:
        if self._spare is None:
            self._spare = tuple(torch.empty_like(t) for t in self.current)
        return self._spare

    def advance(self) -> None:
        self.current, self._spare = self.incoming(), self.current if self._writable else None
        self._writable = True


def _shift(ring: Ring, slices: list[_Rotating]) -> Pending:
    return ring.shift([s.current for s in slices], [s.incoming() for s in slices])


def _arrive(pending: Pending | None, slices: list[_Rotating]) -> None:
    if pending is not None:
        pending.wait()
        for s in slices:
            s.advance()


def _accumulator(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Step 0's result as the fp32 accumulator (fp64 for fp64 inputs): step 0 is the rank's own
    K/V slice, which every query row meets (flashkiln.ring_plan)."""
    return part.to(torch.promote_types(like.dtype, torch.float32))


def ring_forward(ring: Ring, qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                 config: RingConfig, ops: StepOps) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: the output (q's dtype and memory order) and the LSE of its queries over the
    whole sequence (fp32; fp64 for fp64 inputs)."""
    kv = [_Rotating((k.contiguous(), v.contiguous()), writable=False) for k, v in zip(ks, vs)]
    outs, lses = [None] * len(qs), [None] * len(qs)  # step 0 makes them
    for step in range(ring.world_size):
        pending = _shift(ring, kv) if step + 1 < ring.world_size else None
        for i, (q, slices, rank) in enumerate(zip(qs, kv, ring.ranks)):
            plan = step_plan(rank, ring.world_size, step, causal=config.causal, load_balance=config.load_balance)
            if plan.mask == SKIP:
                continue
            k, v = slices.current
            rows, keys = plan.q_rows(q.shape[2]), plan.kv_rows(k.shape[2])
            part_out, part_lse = ops.forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], plan.mask == CAUSAL,
                                             config.scale)
            if step == 0:
                outs[i], lses[i] = _accumulator(part_out, q), _accumulator(part_lse, q)
            else:
                merge_into(outs[i][:, :, rows], lses[i][:, :, rows], part_out, part_lse)
        _arrive(pending, kv)
    results = [inputs.empty_in_memory_order(q, out.shape[3]).copy_(out) for q, out in zip(qs, outs)]
    return results, lses


def ring_backward(ring: Ring, douts: Sequence[torch.Tensor], qs: Sequence[torch.Tensor],
                  ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                  lses: Sequence[torch.Tensor], dlses: Sequence[torch.Tensor | None], config: RingConfig,
                  ops: StepOps) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per local rank: dq, dk, dv of ring_forward's outputs (outs, lses) for the upstream gradients
    douts and dlses (None: the LSE was not used), with their inputs' strides."""
    world = ring.world_size
    kv = [_Rotating((k.contiguous(), v.contiguous()), writable=False) for k, v in zip(ks, vs)]
    dqs = [None] * len(qs)
    # The visiting slice's dK and dV sums: started from the rank's own slice at step 0, then
    # received from the previous rank, one shift behind the K/V slice they belong to.
    dkv = [None] * len(qs)
    douts = [inputs.kernel_layout(d) for d in douts]  # once, not per step
    dkv_pending: Pending | None = None
    for step in range(world):
        kv_pending = _shift(ring, kv) if step + 1 < world else None
        parts = []
        for i, (q, dout, out, lse, dlse, slices, rank) in enumerate(zip(qs, douts, outs, lses, dlses, kv,
                                                                          ring.ranks)):
            plan = step_plan(rank, world, step, causal=config.causal, load_balance=config.load_balance)
            if plan.mask == SKIP:
                parts.append(None)
                continue
            k, v = slices.current
            rows, keys = plan.q_rows(q.shape[2]), plan.kv_rows(k.shape[2])
            part_dq, part_dk, part_dv = ops.backward(
                dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
                None if dlse is None else dlse[:, :, rows], plan.mask == CAUSAL, config.scale, config.deterministic)
            if step == 0:
                dqs[i] = _accumulator(part_dq, q)
                dkv[i] = _Rotating((_accumulator(part_dk, q), _accumulator(part_dv, q)), writable=True)
            else:
                dqs[i][:, :, rows].add_(part_dq)
            parts.append((keys, part_dk, part_dv))
        if step > 0:
            _arrive(dkv_pending, dkv)  # this step's sums, from the previous rank
            for sums, part in zip(dkv, parts):
                if part is not None:
                    keys, part_dk, part_dv = part
                    sums.current[0][:, :, keys].add_(part_dk)
                    sums.current[1][:, :, keys].add_(part_dv)
        if world > 1:  # on to the next rank; after the last step that is the slice's owner
            dkv_pending = _shift(ring, dkv)
        _arrive(kv_pending, kv)
    _arrive(dkv_pending, dkv)
    dq_out = [inputs.empty_gradient_like(q).copy_(dq) for q, dq in zip(qs, dqs)]
    dk_out = [inputs.empty_gradient_like(k).copy_(sums.current[0]) for k, sums in zip(ks, dkv)]
    dv_out = [inputs.empty_gradient_like(v).copy_(sums.current[1]) for v, sums in zip(vs, dkv)]
    return dq_out, dk_out, dv_out


class _RingFunction(torch.autograd.Function):
    """ring_forward and ring_backward through autograd; the tensors are every local rank's q, then
    k, then v, and the outputs every local rank's out, then lse."""

    @staticmethod
    def forward(ctx, ring: Ring, config: RingConfig, ops: StepOps, *qkv: torch.Tensor):
        ctx.set_materialize_grads(False)  # an unused LSE gives dlse None, not zeros
        n = len(ring.ranks)
        qs, ks, vs = qkv[:n], qkv[n:2 * n], qkv[2 * n:]
        outs, lses = ring_forward(ring, qs, ks, vs, config, ops)
        ctx.save_for_backward(*qkv, *outs, *lses)
        ctx.ring, ctx.config, ctx.ops = ring, config, ops
        return (*outs, *lses)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        n = len(ctx.ring.ranks)
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[i * n:(i + 1) * n] for i in range(5))
        douts = [torch.zeros_like(out) if d is None else d for d, out in zip(grads[:n], outs)]
        dqs, dks, dvs = ring_backward(ctx.ring, douts, qs, ks, vs, outs, lses, grads[n:], ctx.config, ctx.ops)
        return (None, None, None, *dqs, *dks, *dvs)


def ring_attention(ring: Ring, qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                   config: RingConfig, ops: StepOps) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Differentiable ring attention of the local ranks' slices (q (B, H_q, S, d_qk), k and v
    (B, H_kv, S_k, d)): per local rank its output and its rows' LSE over the whole sequence. Every
    rank of the ring must call it, with slices of one shape, and run its backward."""
    check_ring_inputs(qs, ks, vs, config, len(ring.ranks))
    n = len(ring.ranks)
    results = _RingFunction.apply(ring, config, ops, *qs, *ks, *vs)
    return list(results[:n]), list(results[n:])
