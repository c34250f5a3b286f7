"""Choosing among the tunings of one variant by the call's shape.

A tuning table may give a variant several tunings (tile sizes); each then becomes its own kernel
in the manifest, with a measured speed relative to the first one on equal work. Per call, the
runtime takes the tuning with the least estimated time: the (query, key) pairs it computes, which
counts the padding of partial tiles and of tiles cut by a causal diagonal, over its relative
speed. Short sequences are where tiles that divide them evenly win (S = 1024 in 160-key tiles
computes 1120 keys per row).
"""
from __future__ import annotations

import functools

from .launch import ceil_div
from .manifest import KernelEntry


@functools.lru_cache(maxsize=4096)
def computed_pairs(seqlen_q: int, seqlen_k: int, causal: str, tile_m: int, tile_n: int) -> int:
    """(query, key) pairs a forward computes in whole tiles; the kernels' key_tiles rule."""
    n_blocks = ceil_div(seqlen_k, tile_n)
    if causal == "none":
        return ceil_div(seqlen_q, tile_m) * tile_m * n_blocks * tile_n
    offset = seqlen_k - seqlen_q if causal == "bottom_right" else 0
    pairs = 0
    for m_block in range(ceil_div(seqlen_q, tile_m)):
        last_visible = min(seqlen_q, (m_block + 1) * tile_m) - 1 + offset
        if last_visible >= 0:
            pairs += tile_m * min(n_blocks, last_visible // tile_n + 1) * tile_n
    return pairs


def choose(entries: list[KernelEntry], seqlen_q: int, seqlen_k: int) -> KernelEntry:
    """The entry (tunings of one variant, the default first) with the least estimated time."""
    def cost(entry: KernelEntry) -> float:
        d = entry.descriptor
        return computed_pairs(seqlen_q, seqlen_k, d["causal"], d["tile_m"], d["tile_n"]) / entry.relative_speed
    return min(entries, key=cost)  # the first of equals: the default
