"""Which keys a query sees, and which tiles meet: the Python mirror of the kernels' one rule,
templates/include/flashkiln/common/visibility.hpp (same names, same semantics, same integer
arithmetic; tests/test_visibility_gpu.py checks the two agree on a GPU).

Query row i of a sequence sees key j iff 0 <= j < seqlen_k and j <= i + offset under a causal
mask (offset: 0 for top_left, seqlen_k - seqlen_q for bottom_right); the left edge is
unbounded, so key-tile ranges start at tile 0 and query-tile ranges end at the last tile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

CAUSAL_MODES = ("none", "top_left", "bottom_right")


class TileRange(NamedTuple):
    """Tiles [first, end) along one axis: empty where end <= first."""

    first: int
    end: int


@dataclass(frozen=True)
class Visibility:
    """The rule for one sequence (built by `visibility`)."""

    causal: str  # one of CAUSAL_MODES
    seqlen_k: int
    offset: int  # the right edge's shift: row i sees keys up to i + offset

    @property
    def right_edge(self) -> bool:
        return self.causal != "none"


def visibility(causal: str, seqlen_q: int, seqlen_k: int) -> Visibility:
    if causal not in CAUSAL_MODES:
        raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
    return Visibility(causal, seqlen_k, seqlen_k - seqlen_q if causal == "bottom_right" else 0)


def first_hidden_column(v: Visibility, row: int, col0: int) -> int:
    """The first key column from col0, counted from col0, that `row` does not see: the sequence
    end, or the right edge where that comes first."""
    limit = v.seqlen_k - col0
    if v.right_edge:
        limit = min(limit, row + v.offset + 1 - col0)
    return limit


def needs_mask(v: Visibility, row0: int, col0: int, tile_n: int) -> bool:
    """Whether the pair of the query tile from row0 and the tile_n keys from col0 hides any key
    from any of its rows (the tile's first row has the lowest right edge)."""
    past_end = col0 + tile_n > v.seqlen_k
    past_right_edge = v.right_edge and col0 + tile_n - 1 > row0 + v.offset
    return past_end or past_right_edge


def visible_key_tiles(v: Visibility, row_begin: int, row_end: int, tile_n: int, n_tiles: int) -> TileRange:
    """The key tiles (tile_n keys from key 0; n_tiles cover the sequence) in which rows
    [row_begin, row_end) see a key. The end comes from the last row, row_end - 1, alone (an empty
    range gives that row's), and rows past the sequence end count where the caller passes them."""
    end = n_tiles
    if v.right_edge:
        last_visible = row_end - 1 + v.offset
        end = 0 if last_visible < 0 else min(end, last_visible // tile_n + 1)
    return TileRange(0, end)


def visiting_query_tiles(v: Visibility, n_block: int, tile_m: int, tile_n: int, m_tiles: int) -> TileRange:
    """The query tiles (tile_m rows from row 0, whole tiles: rows past the sequence end count;
    m_tiles cover the sequence) with a row that sees a key of key tile n_block. The dual of
    visible_key_tiles: key tile n lies in visible_key_tiles(m * tile_m, (m + 1) * tile_m) iff
    query tile m lies in visiting_query_tiles(n)."""
    first = 0
    if v.right_edge:
        first_row = n_block * tile_n - v.offset
        first = 0 if first_row <= 0 else first_row // tile_m
    return TileRange(first, m_tiles)
