"""Opt-in JIT for variants the installed kernels lack, with a per-user cubin cache.

Enabled by FLASHKILN_JIT=1 (and the generator's extras: pip install 'flashkiln[generator]').
Entries live in $FLASHKILN_CACHE_DIR, else $XDG_CACHE_HOME/flashkiln (default ~/.cache/flashkiln),
under <flashkiln version>/<arch>/<descriptor hash>-<compile key>.{cubin,json}, where the compile
key is the build cache's (rendered source, toolchain and flashkiln's headers, arch). The cache is
safe to share between processes: one file lock per entry (a second process waits for the first
compile), writes go to a temporary file then an atomic rename, the JSON (written last) carries the
cubin's sha256 and is checked on every read, directories are created 0700, and a cache directory
that is a symlink, owned by another user, or writable by group or others is refused with a warning
(the process then compiles into a private temporary directory instead).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any

from .version import __version__
from .errors import FlashkilnError
from .files import atomic_write
from .manifest import KernelEntry

JIT_ENV = "FLASHKILN_JIT"
CACHE_ENV = "FLASHKILN_CACHE_DIR"


class JitUnavailableError(FlashkilnError):
    """JIT is enabled but the generator's dependencies are not installed."""


def enabled() -> bool:
    return os.environ.get(JIT_ENV, "") not in ("", "0")


def cache_base() -> Path:
    if env := os.environ.get(CACHE_ENV):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashkiln"


def unsafe_reason(path: Path) -> str | None:
    """Why `path` must not hold cubins this process will load, or None when it is safe."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.geteuid():
        return f"it is owned by uid {info.st_uid}, not by this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


class JitCache:
    """Entries of one flashkiln version, per arch."""

    def __init__(self, base: Path | None = None):
        self.base = Path(base) if base is not None else cache_base()
        self.root = self.base / __version__
        self._fallback: tempfile.TemporaryDirectory | None = None

    def _directory(self, arch: str) -> Path:
        """The arch's entry directory, created 0700 and checked at every level, or a private fallback."""
        directory = self.root / arch
        for level in (self.base, self.root, directory):
            reason = unsafe_reason(level)
            if reason is None:
                try:
                    level.mkdir(mode=0o700, exist_ok=True)
                except OSError as exc:
                    reason = f"it cannot be created ({exc})"
                else:
                    reason = unsafe_reason(level)
            if reason:
                warnings.warn(f"flashkiln: refusing the JIT cache directory {level}: {reason}; compiling into a "
                              "private temporary directory for this process instead", stacklevel=3)
                if self._fallback is None:
                    self._fallback = tempfile.TemporaryDirectory(prefix="flashkiln-jit-")
                return Path(self._fallback.name)
        return directory

    @staticmethod
    def _paths(directory: Path, key: str) -> tuple[Path, Path]:
        return directory / f"{key}.cubin", directory / f"{key}.json"

    @staticmethod
    def read(directory: Path, key: str) -> KernelEntry | None:
        """The entry stored under `key` (`<descriptor hash>-<compile key>`), if complete and intact
        (else None: recompile)."""
        cubin_path, meta_path = JitCache._paths(directory, key)
        try:
            entry = KernelEntry(**json.loads(meta_path.read_text()))
            image = cubin_path.read_bytes()
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None
        if not key.startswith(f"{entry.hash}-") or entry.variant.hash != entry.hash \
                or hashlib.sha256(image).hexdigest() != entry.sha256:
            return None
        return dataclasses.replace(entry, cubin=str(cubin_path))  # wherever the cache directory lives now

    def entries(self) -> list[KernelEntry]:
        found = []
        for meta in sorted(self.root.glob("*/*.json")) if self.root.is_dir() else []:
            entry = self.read(meta.parent, meta.stem)
            if entry is not None:
                found.append(entry)
        return found

    def clear(self) -> int:
        removed = 0
        for path in sorted(self.root.glob("*/*")) if self.root.is_dir() else []:
            path.unlink()
            removed += 1
        return removed

    def get_or_compile(self, request: dict[str, Any], arch: str) -> KernelEntry:
        """The cached entry for `request` on `arch`, compiling it (once, across processes) if needed."""
        try:
            from filelock import FileLock

            from .generator import jit as generator_jit
            from .generator.build import kernel_entry
        except ImportError as exc:
            raise JitUnavailableError(f"{JIT_ENV} is set but the generator's dependencies are missing ({exc}): "
                                      "pip install 'flashkiln[generator]'") from None
        unit = generator_jit.plan_unit(request, arch)
        directory = self._directory(arch)
        key = f"{unit.variants[0].descriptor.hash}-{unit.key[:32]}"
        cubin_path, meta_path = self._paths(directory, key)
        with FileLock(str(directory / f"{key}.lock")):
            entry = self.read(directory, key)
            if entry is not None:
                return entry
            result = generator_jit.compile_variant(unit)
            entry = dataclasses.replace(kernel_entry(unit.variants[0], result, str(cubin_path)),
                                        spec=f"jit ({unit.variants[0].spec_file})")
            # The JSON goes last: an entry exists once its JSON names the cubin's hash.
            atomic_write(cubin_path, result.cubin)
            atomic_write(meta_path, json.dumps(dataclasses.asdict(entry)).encode())
            return entry
