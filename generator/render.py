"""Render one variant's translation unit from its Jinja template (StrictUndefined)."""
from __future__ import annotations

import functools

import jinja2

from flashkiln.descriptor import VariantDescriptor
from flashkiln.params import params_layout

from . import GENERATOR_VERSION
from .families import FAMILIES
from .toolchain import TEMPLATES_DIR


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,  # a parameter the descriptor does not supply is an error
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_context(d: VariantDescriptor, spec_file: str) -> dict:
    """Everything a template may use: the descriptor's own fields and values derived from them."""
    family = FAMILIES[d.family]
    return {
        **d.as_dict(),
        **family.template_context(d),
        "name": d.name,
        "symbol": d.symbol,
        "canonical": d.canonical(),
        "params": params_layout(d.kernel),
        "spec_file": spec_file,
        "generator_version": GENERATOR_VERSION,
    }


def render(d: VariantDescriptor, spec_file: str) -> str:
    template = environment().get_template(FAMILIES[d.family].template_name(d))
    return template.render(**template_context(d, spec_file))
