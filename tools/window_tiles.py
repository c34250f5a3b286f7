"""How much of the tiles a windowed call visits its window covers: the ceiling of its rate per visible
pair against a full call's, before any cost of the masked tiles (no GPU; the runtime's mirror of the
kernels' visibility rule, flashkiln.visibility).

With --warpgroups, for forward tiles instead: the key tiles the hopper forward's 64-row consumer
warpgroups compute when each skips those its own rows cannot see past the window's right edge
(fwd_traits.hpp, kSkipHidden), and past both edges (kSkipHiddenLeft), over computing the work
tile's all: summed over warpgroups (the tensor and softmax work) and the most of one warpgroup per
work tile (the longest of them, which the others wait for at the tile's end).

Usage: tools/pyenv.sh python3 tools/window_tiles.py [--seqlen S] [--windows W ...] [--tiles KIND:MxN ...]
  [--warpgroups]
KIND fwd: a query tile walks the key tiles it sees (hopper/fwd_mainloop.hpp); bwd: a key tile walks
the query tiles that see it (hopper/bwd_schedule.hpp). Windows (W, W), causal (W, 0), as
tools/time_score_mods.py's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashkiln.visibility import needs_mask, visibility, visible_key_tiles, visiting_query_tiles

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench import window_of, window_visible_pairs  # noqa: E402  (bench/ is a folder of scripts, not a package)


def visited_tiles(seqlen: int, causal: bool, window: tuple[int, int], kind: str, tile_m: int,
                  tile_n: int) -> tuple[int, int]:
    """(tiles visited, of them masked) by one head of a square call."""
    rule = visibility("bottom_right" if causal else "none", seqlen, seqlen, window)
    m_tiles, n_tiles = -(-seqlen // tile_m), -(-seqlen // tile_n)
    if kind == "fwd":
        pairs = [(m, n) for m in range(m_tiles)
                 for n in range(*visible_key_tiles(rule, m * tile_m, (m + 1) * tile_m, tile_n, n_tiles))]
    else:
        pairs = [(m, n) for n in range(n_tiles)
                 for m in range(*visiting_query_tiles(rule, n, tile_m, tile_n, m_tiles))]
    masked = sum(needs_mask(rule, m * tile_m, n * tile_n, tile_m, tile_n) for m, n in pairs)
    return len(pairs), masked


def warpgroup_tiles(seqlen: int, causal: bool, window: tuple[int, int], tile_m: int,
                    tile_n: int) -> dict[str, tuple[float, float]]:
    """Per skip rule ("right", "both"): (key tiles summed over warpgroups, the most of one warpgroup
    summed over work tiles), each over the same with every warpgroup computing the whole work tile."""
    rule = visibility("bottom_right" if causal else "none", seqlen, seqlen, window)
    n_tiles = -(-seqlen // tile_n)
    totals = {rule_name: [0, 0] for rule_name in ("tile", "right", "both")}
    for row0 in range(0, seqlen, tile_m):
        first, end = visible_key_tiles(rule, row0, min(seqlen, row0 + tile_m), tile_n, n_tiles)
        if end <= first:
            continue
        counts = {rule_name: [] for rule_name in totals}
        for wg_row in range(row0, row0 + tile_m, 64):  # as fwd_mainloop.hpp's warpgroup_key_tiles
            own = visible_key_tiles(rule, wg_row, min(seqlen, wg_row + 64), tile_n, n_tiles)
            own_end = max(1, own.end - first)
            counts["tile"].append(end - first)
            counts["right"].append(own_end)
            counts["both"].append(own_end - min(max(own.first - first, 0), own_end - 1))
        for rule_name, c in counts.items():
            totals[rule_name][0] += sum(c)
            totals[rule_name][1] += max(c)
    base = totals["tile"]
    return {rule_name: (t[0] / base[0], t[1] / base[1]) for rule_name, t in totals.items() if rule_name != "tile"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 512, 4096])
    parser.add_argument("--tiles", nargs="+", default=["fwd:128x128", "bwd:64x128", "bwd:128x128"])
    parser.add_argument("--warpgroups", action="store_true", help="per-warpgroup skips of forward tiles")
    args = parser.parse_args()
    if args.warpgroups:
        def cell(kind: str, tile_m: int, tile_n: int, causal: bool, w: int) -> str:
            skips = warpgroup_tiles(args.seqlen, causal, window_of(w, causal), tile_m, tile_n)
            return ", ".join(f"{a:.3f} / {b:.3f}" for a, b in skips.values())
        _print_table(args, "right, both (summed / longest)", cell)
    else:
        def cell(kind: str, tile_m: int, tile_n: int, causal: bool, w: int) -> str:
            window = window_of(w, causal)
            tiles, masked = visited_tiles(args.seqlen, causal, window, kind, tile_m, tile_n)
            covered = window_visible_pairs(args.seqlen, args.seqlen, *window) / (tiles * tile_m * tile_n)
            return f"{covered:.3f} ({masked / tiles:.2f})"
        _print_table(args, "covered (masked)", cell)


def _print_table(args: argparse.Namespace, what: str, cell) -> None:
    """A markdown row per tile spec and causal mode, a cell(kind, tile_m, tile_n, causal, w) per window."""
    print("| tiles | causal | " + " | ".join(f"w {w}: {what}" for w in args.windows) + " |")
    print("|---|---|" + "---|" * len(args.windows))
    for spec in args.tiles:
        kind, shape = spec.split(":")
        tile_m, tile_n = (int(x) for x in shape.split("x"))
        for causal in (False, True):
            cells = [cell(kind, tile_m, tile_n, causal, w) for w in args.windows]
            print(f"| {spec} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
