"""Where the compiler and headers come from (all pip packages), and their identity for caching.

Two CUDA flavors build from the same specs: the NVRTC that cuda-bindings loads decides which
(13.x with the `generator` extra, 12.x with `generator-cu12`), and with it the header packages.
"""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = _PACKAGE_DIR.parent


def _data_dir(name: str) -> Path:
    """templates/ or specs/: inside the package when installed from a wheel, else the checkout's."""
    packaged = _PACKAGE_DIR / name
    return packaged if packaged.is_dir() else REPO_ROOT / name


TEMPLATES_DIR = _data_dir("templates")
SPECS_DIR = _data_dir("specs")
INCLUDE_DIR = TEMPLATES_DIR / "include"

# Per CUDA major version: (distribution, directory inside it) of each third-party include root,
# in search order, and the NVRTC distribution.
_FLAVORS = {
    13: {
        "headers": (
            ("nvidia-cutlass", "cutlass_library/source/include"),  # CuTe and CUTLASS
            ("nvidia-cuda-cccl", "nvidia/cu13/include/cccl"),  # libcu++ (cuda/std), CUB, Thrust
            ("nvidia-cuda-runtime", "nvidia/cu13/include"),  # cuda_fp16.h, cuda_bf16.h, ...
        ),
        "nvrtc": "nvidia-cuda-nvrtc",
    },
    12: {
        "headers": (
            ("nvidia-cutlass", "cutlass_library/source/include"),
            ("nvidia-cuda-cccl-cu12", "nvidia/cuda_cccl/include"),
            ("nvidia-cuda-runtime-cu12", "nvidia/cuda_runtime/include"),
        ),
        "nvrtc": "nvidia-cuda-nvrtc-cu12",
    },
}

# Options that change the generated code; include paths are not among them (they vary by
# machine), the header packages' versions stand in for them in the cache key.
BASE_OPTIONS = ("-std=c++17", "-default-device", "-use_fast_math", "-DNDEBUG", "-Xptxas=-v")


class ToolchainError(RuntimeError):
    """The generator's compiler or headers are missing: install flashkiln[generator]."""


@dataclass(frozen=True)
class Toolchain:
    include_dirs: tuple[Path, ...]
    versions: dict[str, str]  # package and compiler versions
    identity: str  # hash of versions and options (a unit's own headers join its cache key: cache.py)

    @property
    def cuda_flavor(self) -> str:
        """cu12 or cu13: the CUDA major version of the NVRTC that builds the cubins."""
        return "cu" + self.versions["nvrtc"].split(".")[0]

    def options(self, arch: str) -> list[str]:
        return [f"-arch={arch}", *BASE_OPTIONS, *(f"-I{d}" for d in self.include_dirs)]


def _package_dir(dist: str, relative: str) -> Path:
    try:
        path = Path(str(metadata.distribution(dist).locate_file(relative)))
    except metadata.PackageNotFoundError:
        raise ToolchainError(f"package {dist} is not installed: pip install 'flashkiln[generator]' "
                             "(or flashkiln[generator-cu12] for the CUDA 12 flavor)") from None
    if not path.is_dir():
        raise ToolchainError(f"{dist} is installed but has no {relative} ({path})")
    return path


def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise ToolchainError("cuda-bindings is not installed: pip install 'flashkiln[generator]'") from None
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"nvrtcVersion failed: {err}")
    return major, minor


# Every include of one of flashkiln's headers, wherever it stands (also under #if: a header that
# might be read counts).
_OWN_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"](flashkiln/[^>"]+)[>"]', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def _own_header(relative: str) -> tuple[bytes, tuple[str, ...]]:
    """A header's bytes and the flashkiln headers it includes (read once per process)."""
    path = INCLUDE_DIR / relative
    if not path.is_file():
        raise ToolchainError(f"#include <{relative}>: no such header under {INCLUDE_DIR}")
    text = path.read_bytes()
    return text, tuple(_OWN_INCLUDE.findall(text.decode()))


def own_headers_digest(source: str) -> str:
    """Content hash of the flashkiln headers that `source` reaches, directly or through each other:
    editing a header invalidates the cache entries of the units that include it, and no others."""
    reached, pending = set(), list(_OWN_INCLUDE.findall(source))
    while pending:
        relative = pending.pop()
        if relative not in reached:
            reached.add(relative)
            pending.extend(_own_header(relative)[1])
    h = hashlib.sha256()
    for relative in sorted(reached):
        h.update(relative.encode() + b"\0" + _own_header(relative)[0] + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    major, minor = nvrtc_version()
    if major not in _FLAVORS:
        raise ToolchainError(f"NVRTC {major}.{minor} is not a supported CUDA flavor ({sorted(_FLAVORS)})")
    flavor = _FLAVORS[major]
    include_dirs = (INCLUDE_DIR, *(_package_dir(dist, rel) for dist, rel in flavor["headers"]))
    versions = {dist: metadata.version(dist) for dist, _ in flavor["headers"]}
    versions[flavor["nvrtc"]] = metadata.version(flavor["nvrtc"])
    versions["nvrtc"] = f"{major}.{minor}"
    identity = hashlib.sha256(repr((sorted(versions.items()), BASE_OPTIONS)).encode()).hexdigest()
    return Toolchain(include_dirs, versions, identity)
