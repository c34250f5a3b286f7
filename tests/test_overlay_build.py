"""tools/overlay_build.py: a partial build laid over a full one loads as one build whose kernels
come from the partial build where it replaces them, by name or by --drop."""
from __future__ import annotations

import sys
from pathlib import Path

from flashkiln.manifest import Manifest
from test_registry import descriptor, kernel_entry, write_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import overlay_build  # noqa: E402  (tools/ is a folder of scripts)


def _builds(tmp_path: Path, partial_tile_n: int) -> tuple[Path, Path, list]:
    base_variants = [descriptor(d=d) for d in (64, 128, 256)]
    base = write_manifest(tmp_path / "full", [kernel_entry(d) for d in base_variants])
    partial = write_manifest(tmp_path / "probe", [kernel_entry(descriptor(d=128, tile_n=partial_tile_n))],
                             build={"nvrtc": "13.0", "probes": ["timeline"]})
    (partial / f"{descriptor(d=128, tile_n=partial_tile_n).name}.cubin").write_bytes(b"the probe's cubin")
    return base, partial, base_variants


def _kernels(out: Path) -> dict[str, bytes]:
    """Name -> the cubin's bytes, through the overlay's manifest (which lists each name once)."""
    entries = Manifest.load(out).kernels
    kernels = {k.name: (out / k.cubin).read_bytes() for k in entries}
    assert len(kernels) == len(entries)
    return kernels


def test_a_partial_build_replaces_the_kernels_of_its_names(tmp_path):
    base, partial, variants = _builds(tmp_path, partial_tile_n=64)  # the base's own tuning: the same name
    out = tmp_path / "overlay"
    assert overlay_build.overlay(base, partial, out) == (1, 1)
    kernels = _kernels(out)
    assert sorted(kernels) == sorted(d.name for d in variants)
    assert kernels[descriptor(d=128).name] == b"the probe's cubin"
    assert kernels[descriptor(d=64).name] == (base / f"{descriptor(d=64).name}.cubin").read_bytes()
    assert Manifest.load(out).build["probes"] == ["timeline"]


def test_drop_names_what_a_build_of_another_tuning_replaces(tmp_path):
    base, partial, _ = _builds(tmp_path, partial_tile_n=128)  # another tuning: another name
    probe = descriptor(d=128, tile_n=128).name
    out = tmp_path / "overlay"
    assert overlay_build.overlay(base, partial, out, drop=descriptor(d=128).name) == (1, 1)
    kernels = _kernels(out)
    assert descriptor(d=128).name not in kernels and kernels[probe] == b"the probe's cubin"
    assert len(kernels) == 3
    # Without --drop nothing of the base goes: both d 128 tunings stay listed.
    assert overlay_build.overlay(base, partial, tmp_path / "both") == (0, 1)
    assert len(_kernels(tmp_path / "both")) == 4
