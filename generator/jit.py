"""Compile one variant on demand (the runtime's opt-in JIT): request -> spec variant -> cubin.

A request resolves through the same spec loader as `make generate`, so a variant gets the tuning
its own group names (e.g. specs/tuning/hopper-bias.yaml), and renders and compiles as a compile
unit of its own, through the build's unit and entry code. The unit's key is the build cache's:
it hashes the rendered source, the toolchain (NVRTC, header packages, flashkiln's own headers)
and the arch, so the runtime's JIT cache, keyed by it, never serves a cubin of edited headers.
$FLASHKILN_JIT_SPECS points the JIT at another specs directory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flashkiln import descriptor as D
from flashkiln.descriptor import VariantDescriptor

from .build import CompileUnit, make_unit
from .nvrtc import CompileResult, compile_cubin
from .specs import load_variants
from .toolchain import SPECS_DIR, toolchain

class JitError(LookupError):
    """The variant cannot be compiled on demand (no spec enumerates it)."""


def _specs_dir() -> Path:
    return Path(os.environ.get("FLASHKILN_JIT_SPECS", SPECS_DIR))


def spec_descriptors() -> list[VariantDescriptor]:
    """Every variant the JIT's specs enumerate (what it can build)."""
    return [v.descriptor for v in load_variants(_specs_dir())]


def plan_unit(request: dict[str, Any], arch: str) -> CompileUnit:
    """The compile unit of the spec variant `request` names on `arch` (its reference tuning)."""
    specs_dir = _specs_dir()
    fields = {**D.with_later_defaults(request), "arch": arch}
    wanted = tuple(fields[k] for k in D.FUNCTIONAL_FIELDS)
    matches = [v for v in load_variants(specs_dir) if v.descriptor.functional_key == wanted]
    if not matches:
        described = ", ".join(f"{k}={fields[k]}" for k in D.FUNCTIONAL_FIELDS)
        raise JitError(f"no spec in {specs_dir} enumerates {described}: add it to a variant group of the "
                       "family's spec (with a tuning row) and it compiles on first use")
    return make_unit([min(matches, key=lambda v: v.relative_speed != 1)])


def compile_variant(unit: CompileUnit) -> CompileResult:
    return compile_cubin(unit.source, unit.name, toolchain().options(unit.arch))
