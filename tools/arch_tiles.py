"""Build the portable family's tiles of every other arch for sm_90a, so that each tile
configuration that ships for a GPU out of reach runs on the H200 (tests/test_arch_tiles_gpu.py).

For each arch the portable tuning table (specs/tuning/portable.yaml) has rows for, other than
sm_90a (archs with equal rows once), this writes a spec directory whose tuning table is that
arch's rows retargeted to sm_90a (bf16, every head dim, the forward and every backward route,
with and without a bias), then runs `generate` into <out>/<arch>/kernels. Usage (here, CPU only):

    .venv/bin/python tools/arch_tiles.py --out build/arch-tiles [-j 2]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from flashkiln.generator.build import generate
from flashkiln.generator.toolchain import REPO_ROOT

TUNING = REPO_ROOT / "specs" / "tuning" / "portable.yaml"
TARGET = "sm_90a"
SPEC = """# {arch}'s portable tiles built for sm_90a by tools/arch_tiles.py (test-only).
family: portable
tuning: tuning/portable.yaml
variants:
  - kernel: [fwd]
    arch: [sm_90a]
    dtype: [bf16]
    head_dims: &dims {dims}
    causal: [none, bottom_right]
    bias: [none, additive]
  - kernel: [bwd]
    arch: [sm_90a]
    dtype: [bf16]
    head_dims: *dims
    causal: [none, bottom_right]
    deterministic: [false, true]
  - kernel: [bwd]
    arch: [sm_90a]
    dtype: [bf16]
    head_dims: *dims
    causal: [none, bottom_right]
    bias: [additive]
    deterministic: [true]
  - kernel: [bwd_pre, bwd_post]
    arch: [sm_90a]
    dtype: [bf16]
    head_dims: *dims
    causal: [none]
  - kernel: [bwd_dq]
    arch: [sm_90a]
    dtype: [bf16]
    head_dims: *dims
    causal: [none, bottom_right]
"""


def other_tilings(table: dict) -> dict[str, list[str]]:
    """The archs with portable tuning rows besides sm_90a, those with equal rows together (sm_86
    and sm_120 share theirs): the first arch of each group names it."""
    groups: dict[str, list[str]] = {}
    for arch in dict.fromkeys(a for rows in table.values() for a in rows if a != TARGET):
        rows = repr([table[kernel].get(arch) for kernel in table])
        groups.setdefault(rows, []).append(arch)
    return {archs[0]: archs for archs in groups.values()}


def write_spec(table: dict, arch: str, directory: Path) -> None:
    """`arch`'s rows of every kernel as sm_90a rows, and the spec that builds them."""
    (directory / "tuning").mkdir(parents=True, exist_ok=True)
    retargeted = {kernel: {TARGET: rows[arch]} for kernel, rows in table.items()}
    (directory / "tuning" / "portable.yaml").write_text(yaml.safe_dump(retargeted, sort_keys=False))
    dims = [[int(x) for x in str(key).split("x")] if "x" in str(key) else int(key) for key in table["fwd"][arch]]
    (directory / "portable.yaml").write_text(SPEC.format(arch=arch, dims=dims))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "arch-tiles")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    args = parser.parse_args()
    table = yaml.safe_load(TUNING.read_text())
    for arch, archs in other_tilings(table).items():
        print(f"{arch}'s tiles (also {', '.join(archs[1:])}'s)" if archs[1:] else f"{arch}'s tiles")
        specs = args.out / arch / "specs"
        write_spec(table, arch, specs)
        generate(specs, args.out / arch / "kernels", workers=args.jobs, progress=False)


if __name__ == "__main__":
    main()
