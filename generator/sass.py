"""Disassemble cubins with cuobjdump from pip (nvidia-cuda-cuobjdump): look, don't guess."""
from __future__ import annotations

import collections
import re
import subprocess
from importlib import metadata
from pathlib import Path


def cuobjdump_path() -> Path:
    try:
        path = Path(str(metadata.distribution("nvidia-cuda-cuobjdump").locate_file("nvidia/cu13/bin/cuobjdump")))
    except metadata.PackageNotFoundError:
        raise FileNotFoundError("cuobjdump is not installed: pip install 'flashkiln[dev]'") from None
    if not path.is_file():
        raise FileNotFoundError(f"nvidia-cuda-cuobjdump has no cuobjdump at {path}")
    return path


def disassemble(cubin: Path) -> str:
    return subprocess.run([str(cuobjdump_path()), "--dump-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout


def opcode_counts(sass: str) -> collections.Counter:
    """How often each opcode (without modifiers: HMMA.16816.F32.BF16 counts as HMMA) occurs."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return collections.Counter(ops)


def resource_usage(cubin: Path) -> dict[str, dict[str, int]]:
    """Per kernel symbol, cuobjdump's resource counts (REG, STACK, SHARED: static bytes, LOCAL, ...)."""
    text = subprocess.run([str(cuobjdump_path()), "--dump-resource-usage", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    usage = {}
    for symbol, counts in re.findall(r"Function (\S+):\s*\n\s*(.+)", text):
        usage[symbol] = {key: int(value) for key, value in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", counts)}
    return usage
