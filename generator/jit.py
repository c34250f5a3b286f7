"""Compile one variant on demand (the runtime's opt-in JIT): request -> descriptor -> cubin.

The performance fields come from the tuning tables shipped with the generator (the same tables
`make generate` uses), so a JIT-compiled variant is the one the specs would have built;
$FLASHKILN_JIT_SPECS points the JIT at another specs directory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flashkiln import descriptor as D
from flashkiln.descriptor import VariantDescriptor

from . import located_yaml
from .families import FAMILIES
from .nvrtc import compile_cubin
from .render import render
from .specs import head_dims_key, tuning_row
from .toolchain import SPECS_DIR, toolchain


class JitError(LookupError):
    """The variant cannot be compiled on demand (no tuning for it, or the family refuses it)."""


def tuned_descriptor(request: dict[str, Any], arch: str) -> VariantDescriptor:
    """The full descriptor of `request` for `arch`, with performance fields from the tuning table."""
    specs_dir = Path(os.environ.get("FLASHKILN_JIT_SPECS", SPECS_DIR))
    table_path = specs_dir / "tuning" / f"{request['family']}.yaml"
    table = located_yaml.load(table_path) if table_path.is_file() else {}
    dims = head_dims_key(request["d_qk"], request["d_v"])
    row = tuning_row(table, request["kernel"], arch, (request["d_qk"], request["d_v"]))
    if row is None:
        raise JitError(f"no tuning for {request['kernel']} {arch} head dims {dims} in {table_path}: add a row "
                       f"{request['kernel']}: {arch}: {dims}: {{{', '.join(f'{k}: ...' for k in D.PERFORMANCE_FIELDS)}}}")
    descriptor = VariantDescriptor(**{**request, "arch": arch}, **{k: row[k] for k in D.PERFORMANCE_FIELDS})
    family = FAMILIES[descriptor.family]
    problems = family.functional_errors(descriptor) + family.tuning_errors(descriptor)
    if problems:
        raise JitError(f"{descriptor.name} cannot be built: " + "; ".join(problems))
    return descriptor


def compile_variant(descriptor: VariantDescriptor) -> tuple[bytes, dict[str, Any]]:
    """The cubin of `descriptor` and the manifest fields that describe it."""
    family = FAMILIES[descriptor.family]
    tc = toolchain()
    result = compile_cubin(render(descriptor), descriptor.name, tc.options(descriptor.arch))
    usage = result.resources(descriptor.symbol)
    return result.cubin, {
        "threads": family.threads(descriptor),
        "smem_bytes": family.smem_bytes(descriptor),
        "registers": usage.registers,
        "spill_bytes": usage.spill_bytes,
        "compile_seconds": round(result.seconds, 2),
        "nvrtc_version": tc.versions["nvrtc"],
        "cutlass_version": tc.versions["nvidia-cutlass"],
    }
