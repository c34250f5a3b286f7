"""Lay a partial build over a full one, for A/B runs and probes on a GPU machine without rebuilding
the rest: OUT holds BASE's kernels less those whose variant names match --drop (by default the
names that PARTIAL builds), plus all of PARTIAL's. BASE's files are linked into OUT, PARTIAL's cubins
copied under OUT/<PARTIAL's folder name>/, and the manifest's build records the probes of both
builds (tools/bwd_timeline.py reads them).

A partial build from other tunings has other hashes, so other names: --drop then names the
variants it replaces (a regex matched against the whole name).

Usage: python3 tools/overlay_build.py BASE PARTIAL OUT [--drop REGEX]   (then FLASHKILN_KERNEL_DIR=OUT)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

MANIFEST = "manifest.json"


def overlay(base: Path, partial: Path, out: Path, drop: str | None = None) -> tuple[int, int]:
    """Writes OUT (see the module docstring); returns (BASE's kernels dropped, PARTIAL's added)."""
    base_manifest = json.loads((base / MANIFEST).read_text())
    partial_manifest = json.loads((partial / MANIFEST).read_text())
    added = partial_manifest["kernels"]
    replaced = ({k["name"] for k in added} if drop is None
                else {k["name"] for k in base_manifest["kernels"] if re.fullmatch(drop, k["name"])})
    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.name not in (MANIFEST, "src", partial.name) and not (out / item.name).exists():
            os.symlink(item.resolve(), out / item.name)
    folder = out / partial.name
    folder.mkdir(exist_ok=True)
    for entry in added:
        shutil.copy(partial / entry["cubin"], folder / entry["cubin"])
    kept = [k for k in base_manifest["kernels"] if k["name"] not in replaced]
    build = dict(base_manifest["build"])
    probes = sorted(set(build.get("probes", [])) | set(partial_manifest["build"].get("probes", [])))
    if probes:
        build["probes"] = probes
    manifest = {**base_manifest, "build": build,
                "kernels": kept + [{**k, "cubin": f"{partial.name}/{k['cubin']}"} for k in added]}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return len(base_manifest["kernels"]) - len(kept), len(added)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("partial", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--drop", help="the names of BASE's variants that PARTIAL replaces (default: its own names)")
    args = parser.parse_args()
    dropped, added = overlay(args.base, args.partial, args.out, args.drop)
    print(f"{args.out}: {args.base}'s kernels less {dropped}, plus {added} from {args.partial}")


if __name__ == "__main__":
    main()
