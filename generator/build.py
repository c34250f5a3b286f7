"""`generate`: specs -> rendered sources -> cubins (in parallel, cached) -> generated/ + manifest."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from flashkiln.archs import ARCHS
from flashkiln.version import __version__
from flashkiln.manifest import MANIFEST_NAME, KernelEntry, Manifest
from flashkiln.params import params_layout

from . import GENERATOR_VERSION
from flashkiln.files import atomic_write

from .cache import CompileCache, cache_key
from .families import FAMILIES
from .nvrtc import CompileError, CompileResult, compile_cubin
from .render import render_unit, unit_key
from .specs import Variant, load_variants, spec_files
from .toolchain import REPO_ROOT, toolchain

DEFAULT_CACHE_DIR = REPO_ROOT / "build" / "nvrtc-cache"


class GenerateError(RuntimeError):
    """Some variants failed to compile; the message names each one with its NVRTC log."""


@dataclass(frozen=True)
class CompileUnit:
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


def make_unit(members: list[Variant], probes: tuple[str, ...] = ()) -> CompileUnit:
    """Variants of one unit_key rendered together (with `probes`, render.PROBES), with their
    compile-cache key."""
    members = sorted(members, key=lambda v: v.descriptor.name)
    source = render_unit([v.descriptor for v in members], probes)
    return CompileUnit(tuple(members), source, cache_key(source, toolchain().identity, members[0].descriptor.arch))


def _units(variants: list[Variant], probes: tuple[str, ...]) -> list[CompileUnit]:
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        groups.setdefault(unit_key(v.descriptor), []).append(v)
    return sorted((make_unit(members, probes) for members in groups.values()), key=lambda u: u.name)


@dataclass(frozen=True)
class Selection:
    """Which variants a build takes: those of the default set (or with `full`, of the full set: specs.py)
    for `archs` (None: every arch the specs list), with names matching `pattern` and not `exclude`,
    then shard i of n."""

    pattern: str | None = None
    exclude: str | None = None
    shard: tuple[int, int] | None = None  # (index, count), 0 <= index < count
    archs: tuple[str, ...] | None = None
    full: bool = False

    def variants(self, variants: list[Variant]) -> list[Variant]:
        if self.archs is not None:
            listed = [a for a in ARCHS if any(v.descriptor.arch == a for v in variants)]
            unknown = [a for a in self.archs if a not in listed]
            if unknown:
                raise ValueError(f"archs {', '.join(unknown)}: the specs list kernels for {', '.join(listed)} only "
                                 "(an arch of their own needs its `arch:` in specs/*.yaml and a tuning row)")
        keep = re.compile(self.pattern) if self.pattern else None
        drop = re.compile(self.exclude) if self.exclude else None
        return [v for v in variants if (self.full or not v.full_only)
                and (self.archs is None or v.descriptor.arch in self.archs)
                and (keep is None or keep.search(v.descriptor.name))
                and not (drop and drop.search(v.descriptor.name))]

    def units(self, units: list[CompileUnit]) -> list[CompileUnit]:
        """Shards split whole compile units, deterministically: the same specs give the same split on
        every machine (ordered by descriptor fields, not by anything the toolchain computes)."""
        if self.shard is None:
            return units
        index, count = self.shard
        ordered = sorted(units, key=lambda u: repr(unit_key(u.variants[0].descriptor)))
        return sorted(ordered[index::count], key=lambda u: u.name)

    def describe(self) -> dict:
        return {"set": "full" if self.full else "default", "filter": self.pattern, "exclude": self.exclude,
                "shard": None if self.shard is None else f"{self.shard[0]}/{self.shard[1]}",
                "archs": None if self.archs is None else list(self.archs)}


def parse_archs(text: str) -> tuple[str, ...]:
    """'sm_80,sm_90a' -> ('sm_80', 'sm_90a'): the archs a build takes (Selection.archs)."""
    archs = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    if not archs:
        raise ValueError(f"--archs {text!r}: expected a comma-separated list such as sm_80,sm_90a")
    return archs


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' -> (i, n) with 0 <= i < n."""
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if not match or not int(match.group(1)) < int(match.group(2)):
        raise ValueError(f"--shard takes i/n with 0 <= i < n, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def plan_units(specs_dir: Path, selection: Selection = Selection(), probes: tuple[str, ...] = ()) -> list[CompileUnit]:
    """The compile units a build would compile (rendered, keyed), without compiling anything."""
    return selection.units(_units(selection.variants(load_variants(Path(specs_dir))), probes))


def _compile_all(units: list[CompileUnit], workers: int, progress: bool) -> dict[str, CompileResult]:
    """Compile every unit; collect all failures before raising, so one run shows every broken one."""
    tc = toolchain()
    results: dict[str, CompileResult] = {}
    failures: list[str] = []
    bar = tqdm(total=sum(len(u.variants) for u in units), desc="compiling", unit="variant", disable=not progress,
               file=sys.stderr)

    def done(unit: CompileUnit, outcome) -> None:
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


def _report(units: list[CompileUnit], results: dict[str, CompileResult], compiled: dict[str, CompileResult]) -> None:
    """Per compile unit: its variants, compile time (or cached) and cubin size; then MiB per arch."""
    per_arch: dict[str, int] = {}
    for unit in units:
        result = results[unit.key]
        per_arch[unit.arch] = per_arch.get(unit.arch, 0) + len(result.cubin)
        how = f"{result.seconds:6.1f} s" if unit.key in compiled else "  cached"
        print(f"  {unit.name}: {len(unit.variants)} variant(s), {how}, {len(result.cubin) / 2**10:7.0f} KiB")
        for v in unit.variants:
            print(f"      {v.descriptor.name}")
    print("  cubins per arch: " + ", ".join(f"{a} {n / 2**20:.1f} MiB" for a, n in sorted(per_arch.items())))


def kernel_entry(variant: Variant, result: CompileResult, cubin_name: str) -> KernelEntry:
    """The manifest entry of one variant of a compiled unit (`make generate` and the JIT alike)."""
    tc = toolchain()
    d = variant.descriptor
    family = FAMILIES[d.family]
    usage = result.resources(d.symbol)
    return KernelEntry(
        hash=d.hash, name=d.name, symbol=d.symbol, arch=d.arch, descriptor=d.as_dict(),
        cubin=cubin_name, sha256=hashlib.sha256(result.cubin).hexdigest(), cubin_bytes=len(result.cubin),
        threads=family.threads(d), smem_bytes=family.smem_bytes(d),
        params_layout=params_layout(d.kernel, d.family).digest, registers=usage.registers,
        spill_bytes=usage.spill_bytes, compile_seconds=round(result.seconds, 2), spec=variant.spec_file,
        relative_speed=variant.relative_speed,
        nvrtc_version=tc.versions["nvrtc"], cutlass_version=tc.versions["nvidia-cutlass"],
        generator_version=GENERATOR_VERSION,
    )


def build_identity(specs_dir: Path) -> dict:
    """What a build's cubins are a function of: versions, toolchain and specs."""
    tc = toolchain()
    return {
        "flashkiln_version": __version__,
        "generator_version": GENERATOR_VERSION,
        "cuda_flavor": tc.cuda_flavor,
        "toolchain": tc.versions,
        "toolchain_identity": tc.identity[:16],
        "specs_digest": _specs_digest(Path(specs_dir)),
        "spec_files": [str(p.name) for p in spec_files(Path(specs_dir))],
    }


def generate(specs_dir: Path, out_dir: Path, workers: int = os.cpu_count() or 1, selection: Selection = Selection(),
             cache_dir: Path = DEFAULT_CACHE_DIR, progress: bool = True, report: bool = False,
             probes: tuple[str, ...] = ()) -> Manifest:
    start = time.perf_counter()
    units = plan_units(specs_dir, selection, probes)
    cache = CompileCache(cache_dir)
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
        atomic_write(out_dir / f"{unit.name}.cubin", result.cubin, 0o644)
        atomic_write(out_dir / "src" / f"{unit.name}.cu", unit.source.encode(), 0o644)
        entries += [kernel_entry(v, result, f"{unit.name}.cubin") for v in unit.variants]
    build = {**build_identity(specs_dir), "selection": selection.describe(), "probes": sorted(set(probes))}
    manifest = Manifest(out_dir, build, tuple(sorted(entries, key=lambda e: e.name)))
    atomic_write(out_dir / MANIFEST_NAME, manifest.to_json().encode(), 0o644)
    _remove_stale(out_dir, {f"{u.name}.cubin" for u in units} | {f"{u.name}.cu" for u in units})
    if report:
        _report(units, results, compiled)
    elapsed = time.perf_counter() - start
    print(f"generated {len(entries)} variant(s) in {len(units)} cubin(s) into {out_dir} in {elapsed:.1f} s "
          f"({len(compiled)} unit(s) compiled, {len(units) - len(compiled)} from cache; "
          f"{sum(len(results[u.key].cubin) for u in units) / 2**20:.1f} MiB of cubins)")
    return manifest


class MergeError(RuntimeError):
    """Shard outputs that do not belong to one build, or that disagree about a kernel."""


def merge(out_dir: Path, shard_dirs: list[Path]) -> Manifest:
    """Combine the outputs of `generate --shard i/n` runs (from several machines) into one directory."""
    manifests = [Manifest.load(d) for d in shard_dirs]
    identity_keys = ("flashkiln_version", "generator_version", "toolchain_identity", "specs_digest", "probes")
    identities = {repr([m.build.get(k) for k in identity_keys]) for m in manifests}
    if len(identities) != 1:
        raise MergeError(f"the shards come from different builds ({', '.join(identity_keys)} differ): "
                         + "; ".join(f"{m.directory}: {[m.build.get(k) for k in identity_keys]}" for m in manifests))
    out_dir = Path(out_dir)
    (out_dir / "src").mkdir(parents=True, exist_ok=True)
    entries: dict[str, KernelEntry] = {}
    for m in manifests:
        for e in m.kernels:
            if e.hash in entries and entries[e.hash].sha256 != e.sha256:
                raise MergeError(f"{e.name} was built twice with different cubins ({m.directory})")
            entries[e.hash] = e
            if not (out_dir / e.cubin).exists():
                shutil.copyfile(m.directory / e.cubin, out_dir / e.cubin)
                source = m.directory / "src" / e.cubin.replace(".cubin", ".cu")
                if source.exists():
                    shutil.copyfile(source, out_dir / "src" / source.name)
    sets = {m.build.get("selection", {}).get("set") for m in manifests}
    build = {**manifests[0].build, "selection": {"set": sets.pop() if len(sets) == 1 else "mixed",
                                                 "merged_shards": [str(m.build.get("selection")) for m in manifests]}}
    merged = Manifest(out_dir, build, tuple(sorted(entries.values(), key=lambda e: e.name)))
    atomic_write(out_dir / MANIFEST_NAME, merged.to_json().encode(), 0o644)
    print(f"merged {len(manifests)} shard(s) into {out_dir}: {len(entries)} variant(s)")
    return merged
