"""tools/window_tiles.py's per-warpgroup count of the hopper forward's key tiles, on cases small
enough to count by hand (no GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import window_tiles  # noqa: E402  (tools/ is a folder of scripts)


def test_a_diagonal_window_counted_by_hand() -> None:
    """S 256, window (0, 0), 192 x 128 tiles. Work tile 0 (rows 0-191) sees key tiles 0 and 1: its
    warpgroups' rows see tile 0, tile 0, tile 1 alone; work tile 1 (rows 192-255) sees tile 1, and
    its warpgroups past the sequence end compute its one tile anyway. Whole tiles: 2 + 2 + 2 and
    1 + 1 + 1; right edge: 1 + 1 + 2 and 1 + 1 + 1; both edges: 1 + 1 + 1 and 1 + 1 + 1."""
    skips = window_tiles.warpgroup_tiles(256, False, (0, 0), 192, 128)
    assert skips["right"] == pytest.approx((7 / 9, 3 / 3))
    assert skips["both"] == pytest.approx((6 / 9, 2 / 3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [128, 512, 4096])
def test_tiles_of_one_warpgroup_or_of_two_on_a_128_key_grid_skip_nothing(causal, window) -> None:
    """64-row tiles have one warpgroup; in 128 x 128 tiles the two warpgroups' edges, 64 rows
    apart, fall in the same key tile for windows of multiples of 128 keys."""
    for tile_m in (64, 128):
        skips = window_tiles.warpgroup_tiles(4096, causal, window_tiles.window_of(window, causal), tile_m, 128)
        assert skips == {"right": (1.0, 1.0), "both": (1.0, 1.0)}


def test_skipping_both_edges_never_computes_more_than_the_right_one() -> None:
    for window in ((100, 3), (3, 100), (250, 250), (-1, 40), (40, -1)):
        skips = window_tiles.warpgroup_tiles(1000, False, window, 192, 128)
        assert all(b <= r <= 1.0 for b, r in zip(skips["both"], skips["right"]))
