"""`generate`: specs -> rendered sources -> cubins (in parallel, cached) -> generated/ + manifest."""
from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

import flashkiln
from flashkiln.manifest import MANIFEST_NAME, KernelEntry, Manifest
from flashkiln.params import params_layout

from . import GENERATOR_VERSION
from .cache import CompileCache, atomic_write, cache_key
from .families import FAMILIES
from .nvrtc import CompileError, CompileResult, compile_cubin
from .render import render_unit, unit_key
from .specs import Variant, load_variants, spec_files
from .toolchain import REPO_ROOT, toolchain

DEFAULT_CACHE_DIR = REPO_ROOT / "build" / "nvrtc-cache"


class GenerateError(RuntimeError):
    """Some variants failed to compile; the message names each one with its NVRTC log."""


@dataclass(frozen=True)
class _Unit:
    """Variants compiled together into one cubin (see render.py)."""

    variants: tuple[Variant, ...]
    source: str
    key: str  # compile-cache key

    @property
    def arch(self) -> str:
        return self.variants[0].descriptor.arch

    @property
    def name(self) -> str:
        first = self.variants[0].descriptor
        dims = f"d{first.d_qk}" if first.d_qk == first.d_v else f"d{first.d_qk}x{first.d_v}"
        return f"{first.kernel}_{first.family}_{first.arch.replace('_', '')}_{dims}_{self.key[:8]}"


def _units(variants: list[Variant]) -> list[_Unit]:
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        groups.setdefault(unit_key(v.descriptor), []).append(v)
    tc = toolchain()
    units = []
    for members in groups.values():
        members.sort(key=lambda v: v.descriptor.name)
        source = render_unit([v.descriptor for v in members])
        units.append(_Unit(tuple(members), source, cache_key(source, tc.identity, members[0].descriptor.arch)))
    return sorted(units, key=lambda u: u.name)


def select(variants: list[Variant], pattern: str | None) -> list[Variant]:
    if not pattern:
        return variants
    regex = re.compile(pattern)
    return [v for v in variants if regex.search(v.descriptor.name)]


def _compile_all(units: list[_Unit], workers: int, progress: bool) -> dict[str, CompileResult]:
    """Compile every unit; collect all failures before raising, so one run shows every broken one."""
    tc = toolchain()
    results: dict[str, CompileResult] = {}
    failures: list[str] = []
    bar = tqdm(total=sum(len(u.variants) for u in units), desc="compiling", unit="variant", disable=not progress,
               file=sys.stderr)

    def done(unit: _Unit, outcome) -> None:
        try:
            results[unit.key] = outcome()
        except CompileError as exc:
            members = ", ".join(v.descriptor.name for v in unit.variants)
            failures.append(f"{exc}\n(unit {unit.name} holds: {members})")
        bar.update(len(unit.variants))

    if workers <= 1:
        for unit in units:
            done(unit, lambda: compile_cubin(unit.source, unit.name, tc.options(unit.arch)))
    else:
        # Largest units first, so that the last minutes do not run on one core.
        ordered = sorted(units, key=lambda u: -len(u.variants))
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(compile_cubin, u.source, u.name, tc.options(u.arch)): u for u in ordered}
            for future in as_completed(futures):
                done(futures[future], future.result)
    bar.close()
    if failures:
        raise GenerateError(f"{len(failures)} of {len(units)} compile unit(s) failed:\n\n" + "\n\n".join(failures))
    return results


def _specs_digest(specs_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(Path(specs_dir).rglob("*.yaml")):
        h.update(str(path.relative_to(specs_dir)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _remove_stale(out_dir: Path, keep: set[str]) -> None:
    for path in [*out_dir.glob("*.cubin"), *(out_dir / "src").glob("*.cu")]:
        if path.name not in keep:
            path.unlink()


def generate(specs_dir: Path, out_dir: Path, workers: int = os.cpu_count() or 1, pattern: str | None = None,
             cache_dir: Path = DEFAULT_CACHE_DIR, progress: bool = True) -> Manifest:
    start = time.perf_counter()
    variants = select(load_variants(Path(specs_dir)), pattern)
    tc = toolchain()
    cache = CompileCache(cache_dir)
    units = _units(variants)
    results = {u.key: r for u in units if (r := cache.get(u.key)) is not None}
    missing = [u for u in units if u.key not in results]
    compiled = _compile_all(missing, workers, progress) if missing else {}
    for key, result in compiled.items():
        cache.put(key, result)
    results.update(compiled)

    out_dir = Path(out_dir)
    (out_dir / "src").mkdir(parents=True, exist_ok=True)
    entries = []
    for unit in units:
        result = results[unit.key]
        cubin_name = f"{unit.name}.cubin"
        atomic_write(out_dir / cubin_name, result.cubin)
        atomic_write(out_dir / "src" / f"{unit.name}.cu", unit.source.encode())
        for variant in unit.variants:
            d = variant.descriptor
            family = FAMILIES[d.family]
            usage = result.resources(d.symbol)
            entries.append(KernelEntry(
                hash=d.hash, name=d.name, symbol=d.symbol, arch=d.arch, descriptor=d.as_dict(),
                cubin=cubin_name, sha256=hashlib.sha256(result.cubin).hexdigest(), cubin_bytes=len(result.cubin),
                threads=family.threads(d), smem_bytes=family.smem_bytes(d),
                params_layout=params_layout(d.kernel).digest, registers=usage.registers,
                spill_bytes=usage.spill_bytes, compile_seconds=round(result.seconds, 2), spec=variant.spec_file,
                nvrtc_version=tc.versions["nvrtc"], cutlass_version=tc.versions["nvidia-cutlass"],
                generator_version=GENERATOR_VERSION,
            ))
    build = {
        "flashkiln_version": flashkiln.__version__,
        "generator_version": GENERATOR_VERSION,
        "toolchain": tc.versions,
        "toolchain_identity": tc.identity[:16],
        "specs_digest": _specs_digest(Path(specs_dir)),
        "spec_files": [str(p.name) for p in spec_files(Path(specs_dir))],
        "filter": pattern,
    }
    manifest = Manifest(out_dir, build, tuple(sorted(entries, key=lambda e: e.name)))
    atomic_write(out_dir / MANIFEST_NAME, manifest.to_json().encode())
    _remove_stale(out_dir, {f"{u.name}.cubin" for u in units} | {f"{u.name}.cu" for u in units})
    elapsed = time.perf_counter() - start
    print(f"generated {len(entries)} variant(s) in {len(units)} cubin(s) into {out_dir} in {elapsed:.1f} s "
          f"({len(compiled)} unit(s) compiled, {len(units) - len(compiled)} from cache; "
          f"{sum(len(results[u.key].cubin) for u in units) / 2**20:.1f} MiB of cubins)")
    return manifest
