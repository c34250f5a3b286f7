"""The work estimate behind the choice among a variant's tunings (CPU only)."""
from __future__ import annotations

import itertools

import pytest

from flashkiln.tile_choice import causal_row_shift, computed_pairs


def pairs_by_visible_tiles(sq: int, sk: int, causal: str, tile_m: int, tile_n: int, shift_rows: int) -> int:
    """Every (query block, key block) tile holding a visible pair, counted whole (O(S^2) reference).
    shift_rows: a causal grid starts above row 0 by the padding rounded down to a multiple of it."""
    offset = sk - sq if causal == "bottom_right" else 0
    first = -(-sq % tile_m // shift_rows * shift_rows) if shift_rows and causal != "none" else 0
    tiles = 0
    for m0, n0 in itertools.product(range(first, sq, tile_m), range(0, sk, tile_n)):
        rows = range(max(m0, 0), min(m0 + tile_m, sq))
        if causal == "none" or any(n0 <= i + offset for i in rows):  # key n0 is the tile's first
            tiles += 1
    return tiles * tile_m * tile_n


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (100, 100), (256, 1000), (1000, 256), (300, 7), (7, 300)])
@pytest.mark.parametrize("tile_m, tile_n", [(128, 160), (192, 128), (64, 64)])
@pytest.mark.parametrize("shift_rows", [0, 64])
def test_computed_pairs_counts_the_tiles_with_a_visible_pair(causal, sq, sk, tile_m, tile_n, shift_rows):
    assert computed_pairs(sq, sk, causal, tile_m, tile_n, shift_rows) == pairs_by_visible_tiles(
        sq, sk, causal, tile_m, tile_n, shift_rows)


def test_causal_padding_of_tall_tiles_at_short_sequences():
    # S = 1024, top-left causal: 525k visible pairs; 192-row tiles compute half as many again as 128-row ones.
    assert computed_pairs(1024, 1024, "top_left", 128, 128) == 128 * 128 * 36
    assert computed_pairs(1024, 1024, "top_left", 192, 128) > 1.3 * computed_pairs(1024, 1024, "top_left", 128, 128)
    # With the partial tile first (rows -128..63, one key tile) its padding costs 8x less.
    assert computed_pairs(1024, 1024, "top_left", 192, 128, shift_rows=64) == 192 * 128 * 27


def test_causal_row_shift_is_the_padding_in_whole_shift_rows():
    assert causal_row_shift(1024, 192, 64) == 128  # 6 tiles of 192 rows pad 128
    assert causal_row_shift(1000, 192, 64) == 128  # padding 152
    assert causal_row_shift(1000, 128, 64) == 0    # padding 24
    assert causal_row_shift(1024, 128, 64) == 0
    assert causal_row_shift(1000, 192, 0) == 0     # no shift asked
