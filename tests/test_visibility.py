"""flashkiln.visibility (the mirror of common/visibility.hpp) against the per-element definition:
query i sees key j iff 0 <= j < S_k and, under a causal mask, j <= i (top_left) or
j <= i + S_k - S_q (bottom_right); under a window (left, right), also
a - left <= j <= a + right with a = i + S_k - S_q (top_left: a = i), a negative side unbounded,
and right = 0 under a causal mask (FlashAttention's window_size)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from flashkiln.launch import ceil_div
from flashkiln.tile_choice import causal_row_shift, computed_pairs
from flashkiln.visibility import (CAUSAL_MODES, first_hidden_column, first_visible_column, needs_mask, visibility,
                                  visible_key_tiles, visiting_query_tiles)

LENGTHS = (1, 2, 7, 17, 113, 128, 129)
SHAPES = list(itertools.product(LENGTHS, LENGTHS))  # S_q < S_k, S_q == S_k and S_q > S_k
# (tile_m, tile_n): the kernels' tiles, and tiles smaller than a short sequence, with unequal sides,
# or one key short of dividing a length (7, 17).
TILES = ((16, 16), (64, 64), (64, 128), (128, 64), (128, 80), (128, 128), (192, 128), (16, 48), (32, 8), (48, 18))
MARGIN = 200  # rows above 0 and past S_q that the tiles may reach (the hopper grid's row shift)
# No window, then windows: both sides, a zero window, one side unbounded, wider than every length.
WINDOWS = (None, (30, 10), (0, 0), (17, -1), (-1, 5), (1000, 1000))


def visible(causal: str, sq: int, sk: int, window: tuple[int, int] | None = None) -> tuple[np.ndarray, int]:
    """The visibility matrix of rows [-MARGIN, sq + MARGIN) (row i at index i + MARGIN), keys [0, sk)."""
    rows = np.arange(-MARGIN, sq + MARGIN)[:, None]
    keys = np.arange(sk)[None, :]
    seen = np.ones((rows.size, sk), dtype=bool)
    if causal == "top_left":
        seen &= keys <= rows
    elif causal == "bottom_right":
        seen &= keys <= rows + (sk - sq)
    if window is not None:
        aligned = rows if causal == "top_left" else rows + (sk - sq)
        left, right = window
        if left >= 0:
            seen &= keys >= aligned - left
        if right >= 0:
            seen &= keys <= aligned + right
    return seen, MARGIN


# Every causal mode, window and pair of lengths.
EVERY_RULE = pytest.mark.parametrize("causal, sq, sk, window", [
    (causal, sq, sk, window) for window in WINDOWS for causal in CAUSAL_MODES for sq, sk in SHAPES])


def rule(causal: str, sq: int, sk: int, window: tuple[int, int] | None):
    """The element rule's matrix, its row base, and the mirror's Visibility for one case."""
    return (*visible(causal, sq, sk, window), visibility(causal, sq, sk, window))


def any_seen(seen: np.ndarray, base: int, rows: range, keys: range) -> bool:
    return bool(seen[rows.start + base:rows.stop + base, keys.start:keys.stop].any())


@EVERY_RULE
def test_column_limits_hide_exactly_the_unseen_columns(causal, sq, sk, window):
    seen, base, v = rule(causal, sq, sk, window)
    for col0 in sorted({0, 16, 64, 80, 112, 128} & set(range(sk))):
        cols = np.arange(192)
        for row in range(-20, sq + 20):
            in_seq = col0 + cols < sk
            expected = np.zeros(cols.size, dtype=bool)
            expected[in_seq] = seen[row + base, col0 + cols[in_seq]]
            first, limit = first_visible_column(v, row, col0), first_hidden_column(v, row, col0)
            assert np.array_equal((cols >= first) & (cols < limit), expected), (row, col0, first, limit)


@EVERY_RULE
def test_tile_rules_match_the_element_rule(causal, sq, sk, window):
    seen, base, v = rule(causal, sq, sk, window)
    for tile_m, tile_n in TILES:
        n_tiles, m_tiles = ceil_div(sk, tile_n), ceil_div(sq, tile_m)
        key_tiles = [range(n * tile_n, min((n + 1) * tile_n, sk)) for n in range(n_tiles)]
        shifts = range(0, tile_m, 64) if tile_m > 64 else (0,)
        # Query tiles from row0 = m * tile_m - shift: the portable grid (0) and the hopper's shifts.
        for shift, m in itertools.product(shifts, range(m_tiles)):
            row0 = m * tile_m - shift
            for n, keys in enumerate(key_tiles):
                # Every row, and every key of the key tile (past the sequence end too, which is hidden).
                hidden = not seen[row0 + base:row0 + tile_m + base, keys.start:keys.start + tile_n].all() or \
                    keys.start + tile_n > sk
                assert needs_mask(v, row0, keys.start, tile_m, tile_n) == hidden, (row0, n, tile_m, tile_n)
            # Row ranges of the tile: whole, cut at the sequence end (forward), and warpgroups' 64 rows.
            ranges = {(row0, row0 + tile_m), (row0, min(sq, row0 + tile_m))}
            ranges |= {(r, min(sq, r + 64)) for r in range(row0, row0 + tile_m, 64)}
            for row_begin, row_end in ranges:
                if row_end <= row_begin:
                    continue
                rows = range(row_begin, row_end)
                expected = [n for n, keys in enumerate(key_tiles) if any_seen(seen, base, rows, keys)]
                got = visible_key_tiles(v, row_begin, row_end, tile_n, n_tiles)
                assert list(range(*got)) == expected, (row_begin, row_end, tile_m, tile_n)
        # Whole query tiles from row 0 (padding rows past S_q included), as the backward visits them.
        for n, keys in enumerate(key_tiles):
            expected = [m for m in range(m_tiles)
                        if any_seen(seen, base, range(m * tile_m, (m + 1) * tile_m), keys)]
            got = visiting_query_tiles(v, n, tile_m, tile_n, m_tiles)
            assert list(range(*got)) == expected, (n, tile_m, tile_n)


@EVERY_RULE
def test_key_and_query_tile_ranges_are_duals(causal, sq, sk, window):
    """The backward's key-tile CTAs visit query tile m iff its dQ kernel (or ordered dQ turn) counts them."""
    v = visibility(causal, sq, sk, window)
    for tile_m, tile_n in TILES:
        n_tiles, m_tiles = ceil_div(sk, tile_n), ceil_div(sq, tile_m)
        for m, n in itertools.product(range(m_tiles), range(n_tiles)):
            keys = visible_key_tiles(v, m * tile_m, (m + 1) * tile_m, tile_n, n_tiles)
            queries = visiting_query_tiles(v, n, tile_m, tile_n, m_tiles)
            assert (keys.first <= n < keys.end) == (queries.first <= m < queries.end), (m, n, tile_m, tile_n)


def test_empty_row_range_gives_the_last_rows_tiles():
    """The hopper's warpgroup whose rows all lie past the sequence end computes the last row's tiles."""
    v = visibility("top_left", 100, 100)
    assert visible_key_tiles(v, 128, 100, 64, 2) == visible_key_tiles(v, 99, 100, 64, 2) == (0, 2)


@pytest.mark.parametrize("causal", CAUSAL_MODES)
@pytest.mark.parametrize("sq, sk", SHAPES)
@pytest.mark.parametrize("tile_m, tile_n, shift_rows", [(128, 128, 0), (192, 128, 64), (128, 80, 64), (64, 64, 0)])
def test_tile_choice_counts_the_forwards_key_tiles(causal, sq, sk, tile_m, tile_n, shift_rows):
    """tile_choice.computed_pairs is the sum of visible_key_tiles over the forward's query tiles."""
    v = visibility(causal, sq, sk)
    shift = causal_row_shift(sq, tile_m, shift_rows) if causal != "none" else 0
    pairs = 0
    for m in range(ceil_div(sq, tile_m)):
        row0 = m * tile_m - shift
        keys = visible_key_tiles(v, row0, min(sq, row0 + tile_m), tile_n, ceil_div(sk, tile_n))
        pairs += tile_m * (keys.end - keys.first) * tile_n
    assert pairs == computed_pairs(sq, sk, causal, tile_m, tile_n, shift_rows)


def test_visibility_rejects_unknown_modes():
    with pytest.raises(ValueError, match="causal must be one of"):
        visibility("causal", 4, 4)
