"""Choosing among the tunings of one variant by the call's shape.

A tuning table may give a variant several tunings (tile sizes); each then becomes its own kernel
in the manifest, with a measured speed relative to the first one on equal work. Per call, the
runtime takes the tuning with the least estimated time: the (query, key) pairs it computes, which
counts the padding of partial tiles and of tiles cut by a causal diagonal, over its relative
speed. Short sequences are where tiles that divide them evenly win (S = 1024 in 160-key tiles
computes 1120 keys per row).

The count is per work tile: it leaves out that the hopper family's causal tiles of 192 x 128 and
128 x 80 skip, per consumer warpgroup, the key tiles its 64 rows cannot see (hopper/fwd_traits.hpp,
kSkipHidden). Counted, that would move d 64's choice to the 192-row tiles at bottom-right shapes
with S_q <= 256 and nowhere else in a sweep of S_q up to 2048 (S_k = S_q, S_q + 100, S_q - 50,
2 S_q).
"""
from __future__ import annotations

import functools

from .launch import ceil_div
from .manifest import KernelEntry
from .visibility import visibility, visible_key_tiles


# Under a causal mask the hopper family starts its grid of query tiles above row 0 by the
# padding rounded down to these rows (a consumer warpgroup's, so that a warpgroup's rows lie all
# above row 0 or none: hopper/fwd_epilogue.hpp), so that the partial tile is the first, shortest one.
# The runtime passes the shift to the kernel (HopperFwdParams.row_shift).
HOPPER_CAUSAL_SHIFT_ROWS = 64


def causal_row_shift(seqlen_q: int, tile_m: int, shift_rows: int) -> int:
    """Rows a causal grid of query tiles starts above row 0: the last tile's padding rounded down
    to a multiple of shift_rows (0: none)."""
    return (ceil_div(seqlen_q, tile_m) * tile_m - seqlen_q) // shift_rows * shift_rows if shift_rows else 0


@functools.lru_cache(maxsize=4096)
def computed_pairs(seqlen_q: int, seqlen_k: int, causal: str, tile_m: int, tile_n: int, shift_rows: int = 0,
                   window: tuple[int, int] | None = None) -> int:
    """(query, key) pairs a forward computes in whole tiles (flashkiln.visibility, the kernels' rule). With
    shift_rows, a causal grid of query tiles starts above row 0 by the padding rounded down to a
    multiple of shift_rows."""
    n_blocks = ceil_div(seqlen_k, tile_n)
    m_blocks = ceil_div(seqlen_q, tile_m)
    if causal == "none" and window is None:
        return m_blocks * tile_m * n_blocks * tile_n
    rule = visibility(causal, seqlen_q, seqlen_k, window)
    row_shift = causal_row_shift(seqlen_q, tile_m, shift_rows) if causal != "none" else 0
    pairs = 0
    for m_block in range(m_blocks):
        row0 = m_block * tile_m - row_shift
        keys = visible_key_tiles(rule, row0, min(seqlen_q, row0 + tile_m), tile_n, n_blocks)
        pairs += tile_m * max(keys.end - keys.first, 0) * tile_n
    return pairs


def choose(entries: list[KernelEntry], seqlen_q: int, seqlen_k: int,
           window: tuple[int, int] | None = None) -> KernelEntry:
    """The entry (tunings of one variant, the default first) with the least estimated time."""
    def cost(entry: KernelEntry) -> float:
        d = entry.descriptor
        shift_rows = HOPPER_CAUSAL_SHIFT_ROWS if d["family"] == "hopper" else 0
        pairs = computed_pairs(seqlen_q, seqlen_k, d["causal"], d["tile_m"], d["tile_n"], shift_rows, window)
        return pairs / entry.relative_speed
    return min(entries, key=cost)  # the first of equals: the default
