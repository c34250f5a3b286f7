"""Ring attention's step plan: what each rank computes at each step of the ring (pure, no torch).

The sequence is cut into chunks. Without load balancing rank r of W holds chunk r of W; with
head-tail ("zigzag") load balancing it holds chunks r and 2W-1-r of 2W, concatenated in that
order, so that under a causal mask every rank has the same work at every step. K/V slices move
to the next rank each step, so at step s rank r holds the slice of rank (r - s) mod W.

A causal block between two different chunks is either wholly visible (the key chunk comes first)
or wholly hidden; only a chunk against itself needs the mask, on a square block, where the
top-left and bottom-right alignments agree. Each step is one call on a contiguous rectangle of
(local query chunks) x (visiting key chunks), so it never needs more than one kernel launch.
"""
from __future__ import annotations

from dataclasses import dataclass

FULL, CAUSAL, SKIP = "full", "causal", "skip"


def chunks_of(rank: int, world_size: int, load_balance: bool) -> tuple[int, ...]:
    """The sequence chunks `rank` holds, in the order of its local slice."""
    return (rank, 2 * world_size - 1 - rank) if load_balance else (rank,)


def source_of(rank: int, world_size: int, step: int) -> int:
    """The rank whose K/V slice `rank` holds at `step`."""
    return (rank - step) % world_size


@dataclass(frozen=True)
class Step:
    """One rank's call at one step: its local query chunks [q_chunks) against the visiting K/V's
    local chunks [kv_chunks), under `mask` (FULL, CAUSAL on the square of the rank's own slice,
    or SKIP: nothing runs). `chunks`: how many chunks a local slice holds."""

    mask: str
    q_chunks: tuple[int, int]
    kv_chunks: tuple[int, int]
    chunks: int

    def q_rows(self, length: int) -> slice:
        """The rows of a local query slice of `length` rows that the call reads."""
        return _rows(self.q_chunks, length, self.chunks)

    def kv_rows(self, length: int) -> slice:
        return _rows(self.kv_chunks, length, self.chunks)


def _rows(chunks: tuple[int, int], length: int, count: int) -> slice:
    return slice(length * chunks[0] // count, length * chunks[1] // count)


def step_plan(rank: int, world_size: int, step: int, *, causal: bool, load_balance: bool) -> Step:
    """What `rank` computes at `step` (0 <= step < world_size)."""
    count = 2 if load_balance else 1
    whole = (0, count)
    if not causal:
        return Step(FULL, whole, whole, count)
    source = source_of(rank, world_size, step)
    if source == rank:
        return Step(CAUSAL, whole, whole, count)
    if not load_balance:
        return Step(FULL if source < rank else SKIP, whole, whole, count)
    # Head-tail: an earlier source's head chunk precedes both of ours and its tail follows both;
    # both chunks of a later source lie between our head and our tail.
    if source < rank:
        return Step(FULL, whole, (0, 1), count)
    return Step(FULL, (1, 2), whole, count)


def blocks(rank: int, world_size: int, step: int, *, causal: bool,
           load_balance: bool) -> list[tuple[int, int, str]]:
    """(query chunk, key chunk, mask) in sequence chunk numbers for every block of the step's call,
    as its mask treats it: the causal mask on the rank's own square shows a block whole where its
    key chunk comes first in the local slice, hides it where it comes later, and masks the diagonal."""
    plan = step_plan(rank, world_size, step, causal=causal, load_balance=load_balance)
    mine = chunks_of(rank, world_size, load_balance)
    theirs = chunks_of(source_of(rank, world_size, step), world_size, load_balance)
    out = []
    for a in range(*plan.q_chunks):
        for b in range(*plan.kv_chunks):
            mask = plan.mask
            if mask == CAUSAL:
                mask = FULL if b < a else CAUSAL if b == a else SKIP
            out.append((mine[a], theirs[b], mask))
    return out
