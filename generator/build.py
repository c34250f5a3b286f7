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
from .render import render
from .specs import Variant, load_variants, spec_files
from .toolchain import REPO_ROOT, toolchain

DEFAULT_CACHE_DIR = REPO_ROOT / "build" / "nvrtc-cache"


class GenerateError(RuntimeError):
    """Some variants failed to compile; the message names each one with its NVRTC log."""


@dataclass(frozen=True)
class _Job:
    variant: Variant
    source: str
    key: str


def select(variants: list[Variant], pattern: str | None) -> list[Variant]:
    if not pattern:
        return variants
    regex = re.compile(pattern)
    return [v for v in variants if regex.search(v.descriptor.name)]


def _compile_job(name: str, source: str, options: list[str]) -> CompileResult:
    return compile_cubin(source, name, options)


def _compile_all(jobs: list[_Job], workers: int, progress: bool) -> dict[str, CompileResult]:
    """Compile every job; collect all failures before raising, so one run shows every broken variant."""
    tc = toolchain()
    results: dict[str, CompileResult] = {}
    failures: list[CompileError] = []
    bar = tqdm(total=len(jobs), desc="compiling", unit="kernel", disable=not progress, file=sys.stderr)
    if workers <= 1:
        for job in jobs:
            try:
                results[job.key] = _compile_job(job.variant.descriptor.name, job.source, tc.options(job.variant.descriptor.arch))
            except CompileError as exc:
                failures.append(exc)
            bar.update()
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {
                pool.submit(_compile_job, j.variant.descriptor.name, j.source, tc.options(j.variant.descriptor.arch)): j
                for j in jobs
            }
            for future in as_completed(futures):
                try:
                    results[futures[future].key] = future.result()
                except CompileError as exc:
                    failures.append(exc)
                bar.update()
    bar.close()
    if failures:
        raise GenerateError(f"{len(failures)} of {len(jobs)} variant(s) failed to compile:\n\n"
                            + "\n\n".join(str(f) for f in failures))
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
    jobs = []
    for v in variants:
        source = render(v.descriptor, v.spec_file)
        jobs.append(_Job(v, source, cache_key(source, tc.identity, v.descriptor.arch)))
    results = {j.key: r for j in jobs if (r := cache.get(j.key)) is not None}
    missing = [j for j in jobs if j.key not in results]
    compiled = _compile_all(missing, workers, progress) if missing else {}
    for key, result in compiled.items():
        cache.put(key, result)
    results.update(compiled)

    out_dir = Path(out_dir)
    (out_dir / "src").mkdir(parents=True, exist_ok=True)
    entries = []
    for job in jobs:
        d, result = job.variant.descriptor, results[job.key]
        cubin_name = f"{d.name}.cubin"
        atomic_write(out_dir / cubin_name, result.cubin)
        atomic_write(out_dir / "src" / f"{d.name}.cu", job.source.encode())
        family = FAMILIES[d.family]
        entries.append(KernelEntry(
            hash=d.hash, name=d.name, symbol=d.symbol, arch=d.arch, descriptor=d.as_dict(),
            cubin=cubin_name, sha256=hashlib.sha256(result.cubin).hexdigest(), cubin_bytes=len(result.cubin),
            threads=family.threads(d), smem_bytes=family.smem_bytes(d),
            params_layout=params_layout(d.kernel).digest, registers=result.registers,
            spill_bytes=result.spill_bytes, compile_seconds=round(result.seconds, 2), spec=job.variant.spec_file,
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
    _remove_stale(out_dir, {e.cubin for e in entries} | {f"{e.name}.cu" for e in entries})
    elapsed = time.perf_counter() - start
    print(f"generated {len(entries)} variant(s) into {out_dir} in {elapsed:.1f} s "
          f"({len(compiled)} compiled, {len(entries) - len(compiled)} from cache; "
          f"{sum(e.cubin_bytes for e in entries) / 2**20:.1f} MiB of cubins)")
    return manifest
