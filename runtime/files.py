"""Crash-safe file writes, shared by the JIT cache and the generator's outputs."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see a torn file.

    The file keeps mkstemp's private mode (0600) unless `mode` is given."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
