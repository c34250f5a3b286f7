"""The manifest of generated kernels: written by the generator, read by the runtime.

One JSON file beside the cubins. Per kernel it records the full descriptor and its hash, the
entry symbol, target arch, cubin file and sha256, the launch contract (threads, dynamic shared
memory, parameter-block layout), the toolchain that built it, and, where a tuning table gives a
variant several tunings, this one's measured speed relative to the first (flashkiln.tile_choice).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .descriptor import VariantDescriptor
from .errors import ManifestError

MANIFEST_FORMAT = 2
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class KernelEntry:
    hash: str
    name: str
    symbol: str
    arch: str
    descriptor: dict[str, Any]
    cubin: str  # file name, relative to the manifest
    sha256: str
    cubin_bytes: int
    threads: int
    smem_bytes: int
    params_layout: str  # digest of the parameter struct layout (flashkiln.params)
    registers: int
    spill_bytes: int
    compile_seconds: float  # of the compile unit (cubin) that holds it
    spec: str
    relative_speed: float  # on equal work, against the variant's first tuning (1 for that one)
    nvrtc_version: str
    cutlass_version: str
    generator_version: str

    @property
    def variant(self) -> VariantDescriptor:
        return VariantDescriptor.from_dict(self.descriptor)


@dataclass(frozen=True)
class Manifest:
    directory: Path
    build: dict[str, Any]  # toolchain and generator identity of the whole build
    kernels: tuple[KernelEntry, ...]

    def to_json(self) -> str:
        return json.dumps(
            {"format": MANIFEST_FORMAT, "build": self.build, "kernels": [dataclasses.asdict(k) for k in self.kernels]},
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ManifestError(f"no kernel manifest at {path}: run `make generate` (or set FLASHKILN_KERNEL_DIR)") from None
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ManifestError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        if raw.get("format") != MANIFEST_FORMAT:
            raise ManifestError(
                f"{path} has manifest format {raw.get('format')!r}; this runtime reads format {MANIFEST_FORMAT}: "
                "regenerate the kernels with a matching flashkiln"
            )
        names = {f.name for f in dataclasses.fields(KernelEntry)}
        kernels = []
        for i, k in enumerate(raw.get("kernels", [])):
            if not isinstance(k, dict) or set(k) != names:
                raise ManifestError(f"{path}: kernel #{i} is not an object with fields {sorted(names)}")
            entry = KernelEntry(**k)
            try:
                variant = entry.variant
            except ValueError as exc:
                raise ManifestError(f"{path}: kernel {entry.name} has an invalid descriptor: {exc}") from None
            if variant.hash != entry.hash:
                raise ManifestError(f"{path}: kernel {entry.name} records hash {entry.hash}, "
                                    f"but its descriptor hashes to {variant.hash}")
            kernels.append(entry)
        return cls(Path(directory), raw.get("build", {}), tuple(kernels))
