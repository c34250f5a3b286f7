"""Where the compiler and headers come from (all pip packages), and their identity for caching."""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = REPO_ROOT / "templates"
INCLUDE_DIR = TEMPLATES_DIR / "include"

# (distribution, directory inside it) of each third-party include root, in search order.
_HEADER_PACKAGES = (
    ("nvidia-cutlass", "cutlass_library/source/include"),  # CuTe and CUTLASS
    ("nvidia-cuda-cccl", "nvidia/cu13/include/cccl"),  # libcu++ (cuda/std), CUB, Thrust
    ("nvidia-cuda-runtime", "nvidia/cu13/include"),  # cuda_fp16.h, cuda_bf16.h, ...
)

# Options that change the generated code; include paths are not among them (they vary by
# machine), the header packages' versions stand in for them in the cache key.
BASE_OPTIONS = ("-std=c++17", "-default-device", "-use_fast_math", "-DNDEBUG", "-Xptxas=-v")


class ToolchainError(RuntimeError):
    """The generator's compiler or headers are missing: install flashkiln[generator]."""


@dataclass(frozen=True)
class Toolchain:
    include_dirs: tuple[Path, ...]
    versions: dict[str, str]  # package and compiler versions
    identity: str  # hash of versions, options and flashkiln's own headers

    def options(self, arch: str) -> list[str]:
        return [f"-arch={arch}", *BASE_OPTIONS, *(f"-I{d}" for d in self.include_dirs)]


def _package_dir(dist: str, relative: str) -> Path:
    try:
        path = Path(str(metadata.distribution(dist).locate_file(relative)))
    except metadata.PackageNotFoundError:
        raise ToolchainError(f"package {dist} is not installed: pip install 'flashkiln[generator]'") from None
    if not path.is_dir():
        raise ToolchainError(f"{dist} is installed but has no {relative} ({path})")
    return path


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


def own_headers_digest() -> str:
    """Content hash of flashkiln's C++ headers: editing a kernel invalidates its cache entries."""
    h = hashlib.sha256()
    for path in sorted(INCLUDE_DIR.rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(INCLUDE_DIR)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    include_dirs = (INCLUDE_DIR, *(_package_dir(dist, rel) for dist, rel in _HEADER_PACKAGES))
    versions = {dist: metadata.version(dist) for dist, _ in _HEADER_PACKAGES}
    versions["nvidia-cuda-nvrtc"] = metadata.version("nvidia-cuda-nvrtc")
    versions["nvrtc"] = nvrtc_version()
    identity = hashlib.sha256(
        repr((sorted(versions.items()), BASE_OPTIONS, own_headers_digest())).encode()
    ).hexdigest()
    return Toolchain(include_dirs, versions, identity)
