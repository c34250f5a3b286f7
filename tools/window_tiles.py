"""How much of the tiles a windowed call visits its window covers: the ceiling of its rate per visible
pair against a full call's, before any cost of the masked tiles (no GPU; the runtime's mirror of the
kernels' visibility rule, flashkiln.visibility).

Usage: tools/pyenv.sh python3 tools/window_tiles.py [--seqlen S] [--windows W ...] [--tiles KIND:MxN ...]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 512, 4096])
    parser.add_argument("--tiles", nargs="+", default=["fwd:128x128", "bwd:64x128", "bwd:128x128"])
    args = parser.parse_args()
    print("| tiles | causal | " + " | ".join(f"w {w}: covered (masked)" for w in args.windows) + " |")
    print("|---|---|" + "---|" * len(args.windows))
    for spec in args.tiles:
        kind, shape = spec.split(":")
        tile_m, tile_n = (int(x) for x in shape.split("x"))
        for causal in (False, True):
            cells = []
            for w in args.windows:
                window = window_of(w, causal)
                tiles, masked = visited_tiles(args.seqlen, causal, window, kind, tile_m, tile_n)
                covered = window_visible_pairs(args.seqlen, args.seqlen, *window) / (tiles * tile_m * tile_n)
                cells.append(f"{covered:.3f} ({masked / tiles:.2f})")
            print(f"| {spec} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
