"""Render translation units from Jinja templates (StrictUndefined).

Variants that differ only in per-entry axes (descriptor.AXES: element type, masking, ...)
are rendered into one unit with one entry point each: they share almost every template
instantiation, which makes compiling them together several times cheaper than one by one.
"""
from __future__ import annotations

import functools

import jinja2

from flashkiln.descriptor import PER_ENTRY_FIELDS, VariantDescriptor
from flashkiln.params import params_layout

from . import GENERATOR_VERSION
from .abi_constants import abi_constants
from .families import FAMILIES
from .toolchain import TEMPLATES_DIR


# Measurement probes a build can compile in (`generate --probe NAME`): the macro each defines at the
# top of every unit. Headers compile a probe's code only under its macro, so the kernels of a build
# without probes carry none of it.
PROBES = {"timeline": "FLASHKILN_PROBE_TIMELINE"}


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,  # a parameter the descriptor does not supply is an error
        keep_trailing_newline=True,
        autoescape=False,
    )


def unit_key(d: VariantDescriptor) -> tuple:
    """Variants with equal keys are compiled together."""
    return tuple(v for k, v in sorted(d.as_dict().items()) if k not in PER_ENTRY_FIELDS)


def variant_context(d: VariantDescriptor) -> dict:
    """What a template may use of one variant: its fields and values derived from them."""
    return {
        **d.as_dict(),
        **FAMILIES[d.family].template_context(d),
        "name": d.name,
        "symbol": d.symbol,
        "namespace": f"variant_{d.hash}",
        "canonical": d.canonical(),
    }


def unit_context(descriptors: list[VariantDescriptor], probes: tuple[str, ...] = ()) -> dict:
    first = descriptors[0]
    if any(unit_key(d) != unit_key(first) for d in descriptors):
        raise ValueError("variants of one unit may differ only in " + ", ".join(PER_ENTRY_FIELDS))
    unknown = [p for p in probes if p not in PROBES]
    if unknown:
        raise ValueError(f"unknown probe(s) {', '.join(unknown)}: known are {', '.join(PROBES)}")
    return {
        "probe_macros": [PROBES[p] for p in sorted(set(probes))],
        "family": first.family,
        "kernel": first.kernel,
        "arch": first.arch,
        "params": params_layout(first.kernel, first.family),
        "constants": abi_constants(first.family, first.kernel, first.arch),
        "generator_version": GENERATOR_VERSION,
        "variants": [variant_context(d) for d in descriptors],
    }


def template_for(d: VariantDescriptor) -> jinja2.Template:
    return environment().get_template(FAMILIES[d.family].template_name(d))


def render_unit(descriptors: list[VariantDescriptor], probes: tuple[str, ...] = ()) -> str:
    """One translation unit for `descriptors` with `probes` (a pure function of them, so the compile
    cache is too)."""
    return template_for(descriptors[0]).render(**unit_context(descriptors, probes))


def render(d: VariantDescriptor) -> str:
    return render_unit([d])
