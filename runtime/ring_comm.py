"""How ring attention's slices move: every rank sends to the next rank and receives from the
previous one, while the current step computes.

A ring runs one or more ranks in this process (`ranks`): one over torch.distributed, all of them
in the single-process simulation. `shift(sends, recvs)` takes, per local rank, the tensors it sends
and the buffers it receives into (same shapes, in the same order), starts the transfer and returns
a handle; after its `wait()` the receive buffers hold the previous rank's tensors and the send
buffers may be written again. On CUDA tensors `wait()` orders the current stream after the
transfer and returns at once, so the host goes on queueing kernels.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist

Slices = Sequence[torch.Tensor]


class Pending(Protocol):
    def wait(self) -> None: ...


class Ring(Protocol):
    world_size: int
    ranks: tuple[int, ...]  # the ranks this process runs, in the order of shift's lists

    def shift(self, sends: Sequence[Slices], recvs: Sequence[Slices]) -> Pending: ...


class _Works:
    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class _Done:
    def wait(self) -> None:
        pass


class ProcessGroupRing:
    """This process's rank of a torch.distributed process group (NCCL, gloo, ...), moving tensors
    with batched point-to-point sends and receives. Sent tensors must be contiguous."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = dist.group.WORLD if group is None else group
        self.world_size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        self.ranks = (rank,)
        # P2POp takes global ranks (group_peer= is newer than torch 2.4).
        self._next = dist.get_global_rank(self.group, (rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(self.group, (rank - 1) % self.world_size)

    def shift(self, sends: Sequence[Slices], recvs: Sequence[Slices]) -> Pending:
        (send,), (recv,) = sends, recvs
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group) for t in recv]
        return _Works(dist.batch_isend_irecv(ops))


class SimulatedRing:
    """Every rank of a ring of `world_size` in this process: shift copies each rank's sends into the
    next rank's receive buffers (for single-process tests of the ring)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ranks = tuple(range(world_size))

    def shift(self, sends: Sequence[Slices], recvs: Sequence[Slices]) -> Pending:
        for rank, buffers in enumerate(recvs):
            for buffer, sent in zip(buffers, sends[rank - 1], strict=True):
                buffer.copy_(sent)
        return _Done()
