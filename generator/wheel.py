"""`wheel`: the runtime plus one spec set's cubins (and the generator, for opt-in JIT) as a wheel.

The wheel's version carries the CUDA flavor and the archs of its cubins as a local label
(0.1.0+cu13.sm90a; 0.1.0+cu13.sm80.sm90a for a wheel of two). `wheel --per-arch` builds one
wheel per arch, each whole (runtime and that arch's cubins): a process runs on one arch, and
the runtime's parameter layouts must match the cubins', which one wheel keeps together; an image
for several archs takes one wheel of them all (`--archs`). Installing a wheel pulls only torch
and a matching cuda-bindings; the generator's own dependencies are its `generator` extra, needed
only to JIT-compile variants the wheel does not hold.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from flashkiln.archs import ARCHS
from flashkiln.version import __version__

from .build import DEFAULT_CACHE_DIR, Selection, generate
from .toolchain import REPO_ROOT, TEMPLATES_DIR, toolchain

# cuda-bindings majors that match each flavor's cubins and driver API.
_BINDINGS = {"cu12": "cuda-bindings>=12.8,<13", "cu13": "cuda-bindings>=13.0,<14"}
_EXTRA = {"cu12": "generator-cu12", "cu13": "generator"}


class WheelError(RuntimeError):
    """The wheel could not be built, or its cubins exceed the size bound."""


@dataclass(frozen=True)
class WheelReport:
    path: Path
    bytes: int
    cubin_bytes_per_arch: dict[str, int]


def _extension_tables(tool: dict) -> str:
    """The source tree's C modules and wheel tag (its pyproject.toml's `tool` table), their sources
    where the staged package keeps them (runtime/ is flashkiln/ there)."""
    tables = []
    for module in tool["setuptools"]["ext-modules"]:
        sources = ", ".join(f'"{"flashkiln/" + src.removeprefix("runtime/")}"' for src in module["sources"])
        limited = str(module.get("py-limited-api", False)).lower()
        tables.append(f'[[tool.setuptools.ext-modules]]\nname = "{module["name"]}"\nsources = [{sources}]\n'
                      f"py-limited-api = {limited}\n")
    tag = tool["distutils"]["bdist_wheel"]["py-limited-api"]
    return "\n".join(tables) + f'\n[tool.distutils.bdist_wheel]\npy-limited-api = "{tag}"\n'


def local_label(flavor: str, archs: list[str]) -> str:
    """The wheel's local version label: the flavor, then each arch of its cubins (ARCHS order)."""
    return ".".join([flavor, *(a.replace("_", "") for a in ARCHS if a in archs)])


def _stage_pyproject(flavor: str, label: str) -> str:
    source = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    quoted = lambda items: ", ".join(f'"{i}"' for i in items)  # noqa: E731
    return f"""[build-system]
requires = ["setuptools>=74.1"]
build-backend = "setuptools.build_meta"

[project]
name = "flashkiln"
version = "{__version__}+{label}"
description = "flashkiln runtime with precompiled attention kernels ({label})"
requires-python = ">=3.11"
dependencies = ["torch>=2.4", "{_BINDINGS[flavor]}"]

[project.optional-dependencies]
generator = [{quoted(source["project"]["optional-dependencies"][_EXTRA[flavor]])}]

[tool.setuptools]
packages = ["flashkiln", "flashkiln.generator", "flashkiln.generator.families"]
include-package-data = false

[tool.setuptools.package-data]
flashkiln = ["kernels/*.cubin", "kernels/manifest.json"]
"flashkiln.generator" = ["templates/**/*", "specs/**/*"]

{_extension_tables(source["tool"])}"""


def build_wheel(specs_dir: Path, out_dir: Path, workers: int = os.cpu_count() or 1,
                selection: Selection = Selection(), cache_dir: Path = DEFAULT_CACHE_DIR, progress: bool = True,
                max_mib_per_arch: float = float(os.environ.get("FLASHKILN_MAX_MIB_PER_ARCH", 256))) -> WheelReport:
    flavor = toolchain().cuda_flavor
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")  # the wheel builds its own C module
    with tempfile.TemporaryDirectory(prefix="flashkiln-wheel-") as tmp:
        stage = Path(tmp)
        package = stage / "flashkiln"
        shutil.copytree(REPO_ROOT / "runtime", package, ignore=ignore)
        shutil.copytree(REPO_ROOT / "generator", package / "generator", ignore=ignore)
        shutil.copytree(TEMPLATES_DIR, package / "generator" / "templates", ignore=ignore)
        shutil.copytree(specs_dir, package / "generator" / "specs", ignore=ignore)
        manifest = generate(specs_dir, package / "kernels", workers, selection, cache_dir, progress)
        shutil.rmtree(package / "kernels" / "src")  # rendered sources: debugging aids, not runtime data
        per_arch: dict[str, int] = {}
        for cubin in {(e.arch, e.cubin, e.cubin_bytes) for e in manifest.kernels}:
            per_arch[cubin[0]] = per_arch.get(cubin[0], 0) + cubin[2]
        too_big = {a: n for a, n in per_arch.items() if n > max_mib_per_arch * 2**20}
        if too_big:
            raise WheelError(f"cubins exceed {max_mib_per_arch} MiB per arch: "
                             + ", ".join(f"{a} {n / 2**20:.1f} MiB" for a, n in too_big.items()))
        label = local_label(flavor, list(per_arch))
        (stage / "pyproject.toml").write_text(_stage_pyproject(flavor, label))
        before = set(out_dir.glob("*.whl"))
        result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                                 "--wheel-dir", str(out_dir), str(stage)], capture_output=True, text=True)
        if result.returncode:
            raise WheelError(f"pip wheel failed:\n{result.stdout}\n{result.stderr}")
    built = sorted(set(out_dir.glob(f"flashkiln-{__version__}+{label}-*.whl")) - before) or \
        sorted(out_dir.glob(f"flashkiln-{__version__}+{label}-*.whl"))
    wheel = built[-1]
    report = WheelReport(wheel, wheel.stat().st_size, per_arch)
    print(f"built {wheel} ({report.bytes / 2**20:.1f} MiB compressed; cubins per arch: "
          + ", ".join(f"{a} {n / 2**20:.1f} MiB" for a, n in sorted(per_arch.items())) + ")")
    return report


def build_wheels_per_arch(specs_dir: Path, out_dir: Path, workers: int = os.cpu_count() or 1,
                          selection: Selection = Selection(), cache_dir: Path = DEFAULT_CACHE_DIR,
                          progress: bool = True) -> list[WheelReport]:
    """One wheel per arch of the selection (every arch the specs list by default)."""
    from .specs import load_variants

    listed = {v.descriptor.arch for v in selection.variants(load_variants(Path(specs_dir)))}
    return [build_wheel(specs_dir, out_dir, workers, dataclasses.replace(selection, archs=(arch,)), cache_dir,
                        progress) for arch in ARCHS if arch in listed]
