"""Context parallelism: flashkiln's kernels inside ring attention over torch.distributed.

The public entry, context_parallel_attention, runs flashkiln.ring over this process's rank of a
process group with flashkiln's forward and backward as each step's op; shard_sequence and
unshard_sequence cut a whole sequence into the ranks' slices and put them back together.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from . import inputs
from .backward import attention_backward
from .forward import attention_forward
from .ring import RingConfig, StepOps, check_ring_inputs, ring_attention
from .ring_comm import ProcessGroupRing
from .ring_plan import chunks_of


def _causal_mode(causal: bool) -> str | None:
    return "bottom_right" if causal else None  # only on square blocks, where it equals top_left


def _forward_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, causal=_causal_mode(causal), scale=scale)


def _backward_step(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool, scale: float,
                   deterministic: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # out and lse are of the whole sequence's keys, not of this block's alone.
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, dlse=dlse, causal=_causal_mode(causal), scale=scale,
                                    deterministic=deterministic, partial_keys=True)
    return dq, dk, dv


FLASHKILN_STEPS = StepOps(_forward_step, _backward_step)


def _check_group(group: dist.ProcessGroup | None, device: torch.device) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        inputs.fail("context_parallel_attention needs torch.distributed: call "
                    "torch.distributed.init_process_group first")
    if group is not None and dist.get_rank(group) < 0:
        inputs.fail("this process is not a member of the given process group")
    if device.type != "cuda":
        inputs.fail(f"inputs must be CUDA tensors, got device {device}")
    if dist.get_backend(group) == "nccl" and device.index != torch.cuda.current_device():
        inputs.fail(f"the inputs are on {device} but the current CUDA device is {torch.cuda.current_device()}: "
                    "call torch.cuda.set_device(...) for NCCL")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               group: dist.ProcessGroup | None = None, causal: bool = False,
                               load_balance: bool = True, scale: float | None = None,
                               deterministic: bool | None = None,
                               return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence split across the ranks of `group` (ring attention), differentiable.

    q (B, H_q, S, d_qk), k (B, H_kv, S_k, d_qk), v (B, H_kv, S_k, d_v): this rank's slices of the
    sequence, as attention_forward takes them (fp16 or bf16 on the current CUDA device, any strides
    with a contiguous head dim, H_q a multiple of H_kv); every rank passes slices of one shape and
    every rank runs the backward. Cut them with shard_sequence, with the same `load_balance`.
    causal: the causal mask of the whole sequence (S_k == S; a query sees the keys at and before
    its position). load_balance: the slices hold head-tail chunk pairs (rank r: chunks r and
    2W-1-r of 2W), which gives every rank the same causal work; S must then be even under a causal
    mask. Without a causal mask the layout does not matter. scale defaults to 1/sqrt(d_qk).
    deterministic: a bitwise-reproducible backward for a fixed world size (default
    torch.are_deterministic_algorithms_enabled()). group: a process group of any backend
    with point-to-point sends (NCCL on GPUs); None for the default group.

    Returns this rank's output rows (q's memory order), and with return_lse also their fp32 LSE
    (B, H_q, S) over the whole sequence, differentiable as well.

    Memory: besides the kernels' own, one more K/V slice in flight (two at most, from world size 3),
    fp32 accumulators for the output (forward) and for dQ, dK and dV (backward), whose dK/dV
    sums also travel the ring. Wrong inputs raise InvalidInputError before anything is sent.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        inputs.check_tensor(name, t)
    inputs.check_qkv(q, k, v)
    inputs.check_flag("causal", causal)
    inputs.check_flag("load_balance", load_balance)
    inputs.check_flag("deterministic", deterministic, optional=True)
    inputs.check_flag("return_lse", return_lse)
    _, scale = inputs.check_causal_scale(None, scale, q.shape[3])
    config = RingConfig(causal, load_balance, scale, deterministic)
    check_ring_inputs([q], [k], [v], config, 1)
    _check_group(group, q.device)
    (out,), (lse,) = ring_attention(ProcessGroupRing(group), [q], [k], [v], config, FLASHKILN_STEPS)
    return (out, lse) if return_lse else out


def _chunk_count(world_size: int, load_balance: bool) -> int:
    return 2 * world_size if load_balance else world_size


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, load_balance: bool = True,
                   dim: int = 2) -> torch.Tensor:
    """`rank`'s slice of the whole sequence `x` along `dim` (2: (B, H, S, d) tensors and (B, H, S)
    LSEs) for context_parallel_attention: chunk `rank` of `world_size`, or with load_balance
    chunks rank and 2W-1-rank of 2W, concatenated. The length must divide into those chunks."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1 \
            or isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        inputs.fail(f"need 0 <= rank < world_size, got rank {rank!r} of {world_size!r}")
    count = _chunk_count(world_size, load_balance)
    length = x.shape[dim]
    if length % count:
        inputs.fail(f"a sequence of {length} does not cut into {count} equal chunks "
                    f"({world_size} ranks{', head-tail' if load_balance else ''}): pad it")
    size = length // count
    pieces = [x.narrow(dim, chunk * size, size) for chunk in chunks_of(rank, world_size, load_balance)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard_sequence(slices: Sequence[torch.Tensor], *, load_balance: bool = True, dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's slice, in rank order (say, from all_gather): the
    inverse of shard_sequence."""
    world_size = len(slices)
    per_rank = 2 if load_balance else 1
    if not world_size or len({s.shape[dim] for s in slices}) != 1 or slices[0].shape[dim] % per_rank:
        inputs.fail("unshard_sequence needs one slice per rank, all of one length that divides into "
                    f"{per_rank} chunk(s), got lengths {[s.shape[dim] for s in slices]}")
    ordered: list[torch.Tensor | None] = [None] * _chunk_count(world_size, load_balance)
    for rank, piece in enumerate(slices):
        parts = piece.split(piece.shape[dim] // per_rank, dim)
        for chunk, part in zip(chunks_of(rank, world_size, load_balance), parts):
            ordered[chunk] = part
    return torch.cat(ordered, dim)
