"""Content-addressed compile cache: an unchanged variant is never compiled twice.

The key hashes everything that determines the cubin: the rendered source, the flashkiln headers
it reaches, the toolchain identity (NVRTC version, header package versions, base options) and the
target arch. So an edited header recompiles the units that include it, and only those. Entries
are written to a temporary file and renamed into place under a file lock, and carry the cubin's
sha256, checked on every read.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from filelock import FileLock

from flashkiln.files import atomic_write

from .nvrtc import CompileResult
from .toolchain import own_headers_digest


def cache_key(source: str, toolchain_identity: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, own_headers_digest(source), toolchain_identity, arch):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


class CompileCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _paths(self, key: str) -> tuple[Path, Path]:
        folder = self.root / key[:2]
        return folder / f"{key}.cubin", folder / f"{key}.json"

    def get(self, key: str) -> CompileResult | None:
        cubin_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if meta.get("key") != key or hashlib.sha256(cubin).hexdigest() != meta.get("sha256"):
            return None  # torn or foreign entry: recompile and overwrite it
        return CompileResult(cubin, meta["log"], meta["seconds"])

    def put(self, key: str, result: CompileResult) -> None:
        cubin_path, meta_path = self._paths(key)
        cubin_path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "key": key,
            "sha256": hashlib.sha256(result.cubin).hexdigest(),
            "log": result.log,
            "seconds": result.seconds,
        }
        with FileLock(str(cubin_path) + ".lock"):
            # The metadata goes last: an entry is complete once its metadata names the cubin's hash.
            atomic_write(cubin_path, result.cubin)
            atomic_write(meta_path, json.dumps(meta).encode())
