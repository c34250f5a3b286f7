"""Which keys a query sees, and which tiles meet: the Python mirror of the kernels' one rule,
templates/include/flashkiln/common/visibility.hpp (same names, same semantics, same integer
arithmetic; tests/test_visibility_gpu.py checks the two agree on a GPU).

Query row i of a sequence sees key j iff 0 <= j < seqlen_k and i + offset - span <= j <= i + offset,
each edge only where it exists: the right one under a causal mask or a window (offset: 0 for
top_left, seqlen_k - seqlen_q for bottom_right, plus the window's `right` without a causal mask),
the left one under a window (span: its left + right). A window is FlashAttention's window_size:
row i aligned with key i + seqlen_k - seqlen_q (top_left: key i), `left` keys below and `right`
above it visible, -1 unbounded, and a causal mask sets `right` to 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

CAUSAL_MODES = ("none", "top_left", "bottom_right")
# An unbounded window side's reach (visibility.hpp, kUnboundedReach): past every key of every row
# of sequences below 2^28 rows.
UNBOUNDED_REACH = 1 << 29


class TileRange(NamedTuple):
    """Tiles [first, end) along one axis: empty where end <= first."""

    first: int
    end: int


@dataclass(frozen=True)
class Visibility:
    """The rule for one sequence (built by `visibility`)."""

    causal: str  # one of CAUSAL_MODES
    window: bool
    seqlen_k: int
    offset: int  # the right edge's shift: row i sees keys up to i + offset
    span: int  # the left edge's distance below the right one: row i sees keys from i + offset - span

    @property
    def right_edge(self) -> bool:
        return self.causal != "none" or self.window

    @property
    def left_edge(self) -> bool:
        return self.window


def visibility(causal: str, seqlen_q: int, seqlen_k: int, window: Optional[tuple[int, int]] = None) -> Visibility:
    """The rule of one sequence; `window` (left, right), negative for an unbounded side, or None."""
    if causal not in CAUSAL_MODES:
        raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
    align = 0 if causal == "top_left" else seqlen_k - seqlen_q
    if window is None:
        return Visibility(causal, False, seqlen_k, 0 if causal == "none" else align, 0)
    left, right = window
    right = 0 if causal != "none" else UNBOUNDED_REACH if right < 0 else right
    left = UNBOUNDED_REACH if left < 0 else left
    return Visibility(causal, True, seqlen_k, align + right, left + right)


def first_hidden_column(v: Visibility, row: int, col0: int) -> int:
    """The first key column from col0, counted from col0, that `row` does not see: the sequence
    end, or the right edge where that comes first."""
    limit = v.seqlen_k - col0
    if v.right_edge:
        limit = min(limit, row + v.offset + 1 - col0)
    return limit


def first_visible_column(v: Visibility, row: int, col0: int) -> int:
    """The first key column from col0, counted from col0, that `row` sees unless it lies at or past
    first_hidden_column (0 or less: the row sees from col0 on)."""
    return row + v.offset - v.span - col0 if v.left_edge else 0


def needs_mask(v: Visibility, row0: int, col0: int, tile_m: int, tile_n: int) -> bool:
    """Whether the pair of the tile_m query rows from row0 and the tile_n keys from col0 hides any
    key from any of its rows (the first row has the lowest right edge, the last the highest left)."""
    past_end = col0 + tile_n > v.seqlen_k
    past_right_edge = v.right_edge and col0 + tile_n - 1 > row0 + v.offset
    before_left_edge = v.left_edge and col0 < row0 + tile_m - 1 + v.offset - v.span
    return past_end or past_right_edge or before_left_edge


def visible_key_tiles(v: Visibility, row_begin: int, row_end: int, tile_n: int, n_tiles: int) -> TileRange:
    """The key tiles (tile_n keys from key 0; n_tiles cover the sequence) in which rows
    [row_begin, row_end) see a key. The end comes from the last row, row_end - 1, the first from
    row_begin, each alone (an empty range gives those rows'), and rows past the sequence end count
    where the caller passes them."""
    first, end = 0, n_tiles
    if v.right_edge:
        last_visible = row_end - 1 + v.offset
        end = 0 if last_visible < 0 else min(end, last_visible // tile_n + 1)
    if v.left_edge:
        first_visible = row_begin + v.offset - v.span
        first = 0 if first_visible <= 0 else n_tiles if first_visible >= v.seqlen_k else first_visible // tile_n
    return TileRange(first, end)


def visiting_query_tiles(v: Visibility, n_block: int, tile_m: int, tile_n: int, m_tiles: int) -> TileRange:
    """The query tiles (tile_m rows from row 0, whole tiles: rows past the sequence end count;
    m_tiles cover the sequence) with a row that sees a key of key tile n_block. The dual of
    visible_key_tiles: key tile n lies in visible_key_tiles(m * tile_m, (m + 1) * tile_m) iff
    query tile m lies in visiting_query_tiles(n)."""
    first, end = 0, m_tiles
    if v.right_edge:
        first_row = n_block * tile_n - v.offset
        first = 0 if first_row <= 0 else first_row // tile_m
    if v.left_edge:
        last_row = min(n_block * tile_n + tile_n, v.seqlen_k) - 1 - v.offset + v.span
        end = 0 if last_row < 0 else min(end, last_row // tile_m + 1)
    return TileRange(first, end)
