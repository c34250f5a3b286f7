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
from typing import Any, Callable

from .archs import ARCHS

# Bump when the meaning of a field changes without its value changing: every hash moves.
SCHEMA_VERSION = 1

_REQUIRED = object()  # an axis with no default: every spec group and request names it


@dataclass(frozen=True)
class Axis:
    """One functional axis: what a kernel computes. The spec loader, the renderer, the runtime's
    requests and the registry's hints all derive from AXES; templates read the values."""

    name: str
    domain: tuple  # the values the templates implement; specs and descriptors are checked against it
    default: Any = _REQUIRED  # a request's value when it leaves the axis out
    # Added after the first release: the canonical form leaves it out at its default, so the
    # variants that existed before keep their hashes.
    omit_at_default: bool = False
    # Variants that differ only in per-entry axes share a compile unit (one entry point each):
    # they share almost every template instantiation.
    per_entry: bool = False
    # Its part of the readable name ("" for none); the head dims are tagged as a pair.
    tag: Callable[[Any], str] = str
    # The key that lists it in a spec group: None for the family (the spec file's own key);
    # d_qk and d_v are listed together as head_dims.
    spec_key: str | None = None
    spec_required: bool = True  # a spec group must list it (else it takes [default])


def _flag_tag(tag: str) -> Callable[[bool], str]:
    return lambda on: tag if on else ""


_CAUSAL_TAGS = {"none": "", "bottom_right": "causal-br"}
HEAD_DIMS = tuple(range(32, 257, 32))

AXES: tuple[Axis, ...] = (
    Axis("kernel", ("fwd", "bwd_pre", "bwd", "bwd_post", "bwd_dq", "bwd_dbias"), spec_key="kernel"),
    Axis("family", ("portable", "hopper")),
    Axis("arch", tuple(ARCHS), tag=lambda arch: arch.replace("_", ""), spec_key="arch"),
    Axis("dtype", ("fp16", "bf16"), per_entry=True, spec_key="dtype"),
    Axis("d_qk", HEAD_DIMS, tag=lambda d: f"d{d}", spec_key="head_dims"),
    Axis("d_v", HEAD_DIMS, tag=lambda d: "", spec_key="head_dims"),  # tagged with d_qk: d_name()
    # A causal mask. Its alignment (top-left or bottom-right) is a run-time value, so that one kernel
    # serves both modes of a call (kernel_causal); the kernel keeps the name bottom_right, and so
    # its hash.
    Axis("causal", ("none", "bottom_right"), default="none", per_entry=True, tag=_CAUSAL_TAGS.get,
         spec_key="causal"),
    Axis("bias", ("none", "additive"), default="none", per_entry=True,
         tag=lambda mode: "" if mode == "none" else f"bias-{mode}", spec_key="bias", spec_required=False),
    Axis("deterministic", (False, True), default=False, per_entry=True, tag=_flag_tag("det"),
         spec_key="deterministic", spec_required=False),
    # A kernel compiled for packed variable-length batches only (the hopper family's; portable
    # kernels read the sequence bounds at run time, so their packed=false kernels take both).
    Axis("packed", (False, True), default=False, omit_at_default=True, per_entry=True, tag=_flag_tag("packed"),
         spec_key="packed", spec_required=False),
    # A sliding window (FlashAttention's window_size); its reach is a run-time value.
    Axis("window", (False, True), default=False, omit_at_default=True, per_entry=True, tag=_flag_tag("window"),
         spec_key="window", spec_required=False),
    # Logit softcapping (Gemma 2's cap * tanh(score / cap)); the cap is a run-time value.
    Axis("softcap", (False, True), default=False, omit_at_default=True, per_entry=True, tag=_flag_tag("softcap"),
         spec_key="softcap", spec_required=False),
    # A hopper backward that writes dBias of a key-varying bias (its dS stored or reduced): an entry
    # point of its own beside the biased one without it, whose registers it would otherwise share.
    Axis("bias_grad", (False, True), default=False, omit_at_default=True, per_entry=True, tag=_flag_tag("dbias"),
         spec_key="bias_grad", spec_required=False),
)
AXIS = {a.name: a for a in AXES}
FUNCTIONAL_FIELDS = tuple(a.name for a in AXES)
PERFORMANCE_FIELDS = ("tile_m", "tile_n", "warps", "stages")
PER_ENTRY_FIELDS = tuple(a.name for a in AXES if a.per_entry)
# Fields added after the first release, with the default that leaves them out of the hash.
ADDED_LATER = {a.name: a.default for a in AXES if a.omit_at_default}
# The domains under their usual names.
KERNELS, FAMILIES, DTYPES = AXIS["kernel"].domain, AXIS["family"].domain, AXIS["dtype"].domain
CAUSAL_MODES, BIAS_MODES = AXIS["causal"].domain, AXIS["bias"].domain


def kernel_causal(mode: str) -> str:
    """The causal axis value of the kernel that runs a call's causal mode (none, top_left or
    bottom_right): the causal kernels take the alignment at run time (common/visibility.hpp)."""
    return "none" if mode == "none" else "bottom_right"


def dims_tag(d_qk: int, d_v: int) -> str:
    """The head dims' part of a name: d128, or d192x128 when they differ."""
    return f"d{d_qk}" if d_qk == d_v else f"d{d_qk}x{d_v}"


def request(**fields: Any) -> dict[str, Any]:
    """A functional request (every axis but arch) with the table's defaults where `fields` lacks
    them; KeyError for an axis that has no default or a name that is no axis."""
    unknown = fields.keys() - AXIS.keys()
    if unknown:
        raise KeyError(f"not functional axes: {sorted(unknown)}")
    missing = [a.name for a in AXES if a.name not in fields and a.name != "arch" and a.default is _REQUIRED]
    if missing:
        raise KeyError(f"a request needs {', '.join(missing)}")
    return {a.name: fields.get(a.name, a.default) for a in AXES if a.name != "arch"}


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
    # functional, added later (AXES: omit_at_default), so with the default that keeps older
    # manifests and names valid
    packed: bool = False
    window: bool = False
    softcap: bool = False
    bias_grad: bool = False

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
        fields = self.as_dict()
        tags = [dims_tag(self.d_qk, self.d_v) if a.name == "d_qk" else a.tag(fields[a.name]) for a in AXES]
        return "_".join([t for t in tags if t] + [self.hash[:8]])

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
    errors = []
    for axis in AXES:
        key, allowed, value = axis.name, axis.domain, fields.get(axis.name)
        # Exact types: True must not pass as a head dim, 1 as a flag, nor 128.0 as 128.
        if type(value) is not type(allowed[0]) or value not in allowed:
            errors.append(f"{key}={value!r} is not supported (supported: {', '.join(map(str, allowed))})")
    for key in PERFORMANCE_FIELDS:
        value = fields.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            errors.append(f"{key}={value!r} must be a positive integer")
    return errors
