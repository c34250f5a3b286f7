"""Build tuning candidates of the portable forward for the benchmark to compare (CPU only).

Each candidate set becomes its own spec directory (same functional variants, another tuning
table) generated into build/sweep/<label>; `bench.py --extra-kernel-dir <label>=build/sweep/<label>`
times them beside the default tuning.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from flashkiln.generator.build import generate

# (tile_m, tile_n, warps, stages) per head dim, other than the tuning table's choice (the sweep of
# 2026-11-30, docs/perf.md, picked the table's current rows from these plus FA2's defaults).
CANDIDATES = {
    64: {"c1": (128, 128, 8, 1), "c2": (128, 64, 4, 2), "c3": (64, 64, 4, 1)},
    128: {"c1": (128, 32, 4, 1), "c2": (128, 64, 4, 1), "c3": (128, 128, 8, 1), "c4": (64, 64, 4, 1)},
    256: {"c1": (128, 64, 8, 1), "c2": (128, 32, 8, 1), "c3": (128, 64, 8, 2)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=Path("build/sweep"))
    parser.add_argument("-j", "--jobs", type=int, default=2)
    args = parser.parse_args()
    labels = sorted({label for per_dim in CANDIDATES.values() for label in per_dim})
    for label in labels:
        dims = {d: c[label] for d, c in CANDIDATES.items() if label in c}
        specs = args.root / f"specs-{label}"
        (specs / "tuning").mkdir(parents=True, exist_ok=True)
        (specs / "portable.yaml").write_text(yaml.safe_dump({
            "family": "portable", "tuning": "tuning/portable.yaml",
            "variants": [{"kernel": ["fwd"], "arch": ["sm_90a"], "dtype": ["bf16"], "head_dims": sorted(dims),
                          "causal": ["none", "top_left"]}],
        }))
        (specs / "tuning" / "portable.yaml").write_text(yaml.safe_dump({"fwd": {"sm_90a": {
            d: dict(zip(("tile_m", "tile_n", "warps", "stages"), c)) for d, c in dims.items()}}}))
        generate(specs, args.root / label, args.jobs)


if __name__ == "__main__":
    main()
