"""The canonical kernel-variant descriptor, shared by the generator and the runtime.

A descriptor holds every field that changes the generated code: the functional ones (what the
kernel computes) and the performance ones (how: tiles, warps, pipeline stages). Its canonical
serialization is hashed (sha256, 16 hex digits) into the dispatch key that names the cubin; its
readable name is derived from it. Nothing else in flashkiln invents names or hashes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .archs import ARCHS

# Bump when the meaning of a field changes without its value changing: every hash moves.
SCHEMA_VERSION = 1

# Value domains of the functional axes: what the templates implement today. Specs are
# validated against these; a value outside them is an error naming the allowed ones.
KERNELS = ("fwd", "bwd_pre", "bwd", "bwd_post", "bwd_dq")
FAMILIES = ("portable", "hopper")
DTYPES = ("fp16", "bf16")
CAUSAL_MODES = ("none", "top_left", "bottom_right")
BIAS_MODES = ("none", "additive")
HEAD_DIMS = tuple(range(32, 257, 32))

_CAUSAL_TAGS = {"none": "", "top_left": "causal-tl", "bottom_right": "causal-br"}
# Fields added after the first release, with the default that leaves them out of the hash.
ADDED_LATER = {"packed": False}

FUNCTIONAL_FIELDS = ("kernel", "family", "arch", "dtype", "d_qk", "d_v", "causal", "bias", "deterministic",
                     "packed")
PERFORMANCE_FIELDS = ("tile_m", "tile_n", "warps", "stages")


@dataclass(frozen=True)
class VariantDescriptor:
    # functional
    kernel: str
    family: str
    arch: str
    dtype: str
    d_qk: int
    d_v: int
    causal: str
    bias: str
    deterministic: bool
    # performance
    tile_m: int
    tile_n: int
    warps: int
    stages: int
    # functional, added later (defaults keep older manifests and names valid): a kernel compiled
    # for packed variable-length batches only (the hopper family's; portable kernels read the
    # sequence bounds at run time, so their packed=false kernels take both).
    packed: bool = False

    def __post_init__(self) -> None:
        problems = validation_errors(self.as_dict())
        if problems:
            raise ValueError("invalid variant descriptor: " + "; ".join(problems))

    # -- identity ---------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def canonical(self) -> str:
        """Stable text form: sorted keys, no whitespace, schema version included. A field added
        later is left out at its default, so the variants that existed before keep their hashes."""
        fields = {k: v for k, v in self.as_dict().items() if ADDED_LATER.get(k, object()) != v}
        return json.dumps({"schema": SCHEMA_VERSION, **fields}, sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """Readable and unique, e.g. fwd_portable_sm90a_bf16_d128_causal-br_1a2b3c4d."""
        dims = f"d{self.d_qk}" if self.d_qk == self.d_v else f"d{self.d_qk}x{self.d_v}"
        parts = [self.kernel, self.family, self.arch.replace("_", ""), self.dtype, dims]
        parts += [t for t in (_CAUSAL_TAGS[self.causal],) if t]
        if self.bias != "none":
            parts.append(f"bias-{self.bias}")
        if self.deterministic:
            parts.append("det")
        if self.packed:
            parts.append("packed")
        return "_".join(parts + [self.hash[:8]])

    @property
    def symbol(self) -> str:
        """The extern "C" entry point's name in the cubin (a C identifier)."""
        return "flashkiln_" + self.name.replace("-", "_")

    # -- grouping ---------------------------------------------------------------------------
    @property
    def functional_key(self) -> tuple:
        """What a call asks for; several tunings of one functional variant share it."""
        return tuple(getattr(self, f) for f in FUNCTIONAL_FIELDS)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "VariantDescriptor":
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(fields) - known - {"schema"}
        if extra:
            raise ValueError(f"unknown descriptor fields: {sorted(extra)}")
        return cls(**{k: v for k, v in fields.items() if k in known})


def with_later_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` (a request, say) with the fields added later at their defaults where it lacks
    them, so that what named a kernel before those fields existed still names it. (On every
    call's lookup: a request that has them all is returned as it is.)"""
    return fields if ADDED_LATER.keys() <= fields.keys() else {**ADDED_LATER, **fields}


def validation_errors(fields: dict[str, Any]) -> list[str]:
    """Every way `fields` falls outside the functional domains (empty when valid)."""
    domains = {
        "kernel": KERNELS,
        "family": FAMILIES,
        "arch": tuple(ARCHS),
        "dtype": DTYPES,
        "d_qk": HEAD_DIMS,
        "d_v": HEAD_DIMS,
        "causal": CAUSAL_MODES,
        "bias": BIAS_MODES,
        "deterministic": (False, True),
        "packed": (False, True),
    }
    errors = []
    for key, allowed in domains.items():
        value = fields.get(key)
        # Exact types: True must not pass as a head dim, 1 as a flag, nor 128.0 as 128.
        if type(value) is not type(allowed[0]) or value not in allowed:
            errors.append(f"{key}={value!r} is not supported (supported: {', '.join(map(str, allowed))})")
    for key in PERFORMANCE_FIELDS:
        value = fields.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            errors.append(f"{key}={value!r} must be a positive integer")
    return errors
