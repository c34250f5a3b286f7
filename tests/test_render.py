"""Rendering a variant's translation unit: Traits arguments, launch contract, ABI checks (no compile)."""
from __future__ import annotations

import dataclasses
import json
import re

import jinja2
import jinja2.meta
import pytest

from flashkiln.descriptor import VariantDescriptor
from flashkiln.generator.families import FAMILIES
from flashkiln.generator.render import environment, render, render_unit, template_for, unit_context, variant_context
from flashkiln.params import params_layout

ELEMENTS = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}


def desc(**overrides) -> VariantDescriptor:
    fields = dict(kernel="fwd", family="portable", arch="sm_90a", dtype="bf16", d_qk=128, d_v=128,
                  causal="bottom_right", bias="none", deterministic=False, tile_m=128, tile_n=64, warps=4, stages=1)
    return VariantDescriptor(**{**fields, **overrides})


DESCRIPTORS = [
    desc(),
    desc(arch="sm_80", dtype="fp16", d_qk=192, d_v=128, causal="bottom_right", tile_m=64, tile_n=64, stages=2),
    desc(arch="sm_86", dtype="fp16", d_qk=64, d_v=64, causal="none", tile_m=128, tile_n=32, warps=8),
    desc(d_qk=256, d_v=256, warps=8, tile_n=32),
    desc(bias="additive", stages=2),
]
IDS = [d.name for d in DESCRIPTORS]


def traits_arguments(source: str) -> list[str]:
    """The template arguments of `using Traits = ...FwdTraits<...>;`, comments removed."""
    match = re.search(r"using Traits = flashkiln::portable::FwdTraits<(.*?)>;", source, re.S)
    assert match, "no FwdTraits instantiation in the rendered source"
    body = re.sub(r"//[^\n]*", "", match.group(1))
    return [arg.strip() for arg in body.split(",")]


def template_source(d: VariantDescriptor) -> str:
    env = environment()
    source, _, _ = env.loader.get_source(env, FAMILIES[d.family].template_name(d))
    return source


def variant_fields_used(d: VariantDescriptor) -> set[str]:
    """The per-variant keys the template and its base read (`v.<key>` inside the loop over variants)."""
    env = environment()
    base, _, _ = env.loader.get_source(env, "unit_base.cu.j2")
    return set(re.findall(r"\bv\.(\w+)", template_source(d) + base))


@pytest.mark.parametrize("d", DESCRIPTORS, ids=IDS)
def test_entry_point_is_the_descriptor_symbol(d):
    source = render(d)
    threads = FAMILIES["portable"].threads(d)
    assert re.search(rf'extern "C" __global__ void __launch_bounds__\({threads}, 1\)\s*\n{d.symbol}\(', source)
    assert source.count(d.symbol) == 1


@pytest.mark.parametrize("d", DESCRIPTORS, ids=IDS)
def test_traits_arguments_match_the_descriptor(d):
    args = traits_arguments(render(d))
    causal = "none" if d.causal == "none" else "masked"  # the alignment is a run-time value
    expected = [ELEMENTS[d.dtype], str(d.d_qk), str(d.d_v), str(d.tile_m), str(d.tile_n), str(d.warps),
                str(d.stages), f"flashkiln::Causal::{causal}", str(d.bias != "none").lower(), str(d.window).lower(),
                str(d.softcap).lower()]
    assert args == expected


@pytest.mark.parametrize("d", DESCRIPTORS, ids=IDS)
def test_launch_contract_matches_the_family(d):
    source = render(d)
    family = FAMILIES["portable"]
    assert f"static_assert(Traits::kThreads == {family.threads(d)}, " in source
    assert f"static_assert(Traits::kSmemBytes == {family.smem_bytes(d)}, " in source
    assert family.threads(d) == 32 * d.warps


def test_smem_formula_on_known_values():
    # 2 bytes * (64 * 192 + 2 stages * 64 * (192 + 128))
    assert FAMILIES["portable"].smem_bytes(DESCRIPTORS[1]) == 106496
    assert "kSmemBytes == 106496," in render(DESCRIPTORS[1])
    # 2 bytes * (128 * 128 + 2 stages * 64 * (128 + 128) + one 128 x 64 bias tile)
    assert FAMILIES["portable"].smem_bytes(DESCRIPTORS[4]) == 114688


@pytest.mark.parametrize("d", DESCRIPTORS, ids=IDS)
def test_params_abi_static_asserts_cover_every_field(d):
    source = render(d)
    layout = params_layout("fwd")
    assert layout.cpp_type == "flashkiln::FwdParams"
    assert f"using Params = {layout.cpp_type};" in source
    assert f"static_assert(sizeof(Params) == {layout.size}, " in source
    checks = re.findall(r"static_assert\(sizeof\(Params::(\w+)\) == (\d+) && kBytes\[(\d+)\] == (\d+),", source)
    assert [(name, int(size), int(offset), int(index)) for name, size, offset, index in checks] == [
        (f.name, f.size, f.offset, i) for i, f in enumerate(layout.fields, start=1)
    ]
    # The probe instance stores each field's 1-based index, floats by bit pattern.
    probe = re.search(r"constexpr Params kProbe\{(.*?)\n\};", source, re.S).group(1)
    entries = re.findall(r"^\s*(.+?),  // (\w+)$", probe, re.M)
    assert [name for _, name in entries] == [f.name for f in layout.fields]
    for i, ((value, _), f) in enumerate(zip(entries, layout.fields), start=1):
        assert value == (f"flashkiln::abi::float_marker({i})" if f.is_float else str(i))


def test_params_layout_has_the_expected_float_fields_and_size():
    layout = params_layout("fwd")
    assert [f.name for f in layout.fields if f.is_float] == ["scale", "scale_log2", "softcap_scale"]
    assert layout.size == 248  # 9 addresses, 15 strides, 10 ints, 3 floats, padded to 8 bytes


@pytest.mark.parametrize("d", DESCRIPTORS, ids=IDS)
def test_header_names_variant_and_canonical_form(d):
    lines = render(d).splitlines()
    assert lines[0].startswith("// Generated by flashkiln.generator ") and lines[0].endswith(": do not edit.")
    at = lines.index(f"// Variant {d.name}")
    assert json.loads(lines[at + 1].removeprefix("//   ")) == json.loads(d.canonical())


def test_render_is_deterministic_and_differs_per_variant():
    a, b = (render(d) for d in DESCRIPTORS[:2])
    assert a == render(DESCRIPTORS[0])
    assert a != b


# -- the template uses only what the contexts supply -----------------------------------------

def test_template_references_only_context_keys():
    d = DESCRIPTORS[0]
    env = environment()
    # `v` is the base template's loop variable over the unit's variants.
    unit_names = jinja2.meta.find_undeclared_variables(env.parse(template_source(d))) - {"v"}
    assert unit_names <= set(unit_context([d]))
    assert variant_fields_used(d) <= set(variant_context(d))
    assert {"d_qk", "d_v", "tile_m", "tile_n", "warps", "stages", "causal", "dtype"} <= variant_fields_used(d)


def test_every_descriptor_field_reaches_the_source():
    """Each field is a template parameter, or reaches the source through name/symbol/canonical
    (`packed` and `bias_grad`, added later, only away from their defaults: portable kernels never
    take them)."""
    d = DESCRIPTORS[0]
    used = variant_fields_used(d)
    assert {"name", "symbol", "canonical"} <= used
    source = render(d)
    for f in dataclasses.fields(VariantDescriptor):
        if f.name not in used and f.name not in ("packed", "bias_grad"):
            assert f'"{f.name}":{json.dumps(getattr(d, f.name))}' in source, f.name


@pytest.mark.parametrize("kernel, field, value, after", [
    ("fwd", "packed", False, r",\s*// packed batches"), ("fwd", "packed", True, r",\s*// packed batches"),
    ("bwd", "bias_grad", False, r">;\s*// bias_grad"), ("bwd", "bias_grad", True, r">;\s*// bias_grad"),
])
def test_flags_added_later_are_hopper_template_parameters(kernel, field, value, after):
    tiles = {"fwd": dict(tile_m=128, bias="none"), "bwd": dict(tile_m=64, bias="additive")}[kernel]
    d = VariantDescriptor(kernel=kernel, family="hopper", arch="sm_90a", dtype="bf16", d_qk=128, d_v=128,
                          causal="none", deterministic=False, tile_n=128, warps=12, stages=2, **tiles,
                          **{field: value})
    assert re.search(str(value).lower() + after, render(d))


@pytest.mark.parametrize("key", sorted(variant_fields_used(DESCRIPTORS[0])))
def test_dropping_a_variant_key_is_an_error(key):
    d = DESCRIPTORS[0]
    context = unit_context([d])
    del context["variants"][0][key]
    with pytest.raises(jinja2.UndefinedError):
        template_for(d).render(**context)


def test_full_context_renders_like_render():
    d = DESCRIPTORS[1]
    assert template_for(d).render(**unit_context([d])) == render(d)


def test_unit_holds_one_entry_per_variant():
    """Variants differing only in dtype/causal share a unit; each keeps its own symbol and Traits."""
    members = [desc(dtype=t, causal=c) for t in ("fp16", "bf16") for c in ("none", "bottom_right")]
    source = render_unit(members)
    for d in members:
        assert source.count(d.symbol) == 1 and f"namespace variant_{d.hash}" in source
    assert source.count("static_assert(sizeof(Params) ==") == 1  # the ABI check once per unit


def test_variants_of_different_tiles_cannot_share_a_unit():
    with pytest.raises(ValueError, match="may differ only in"):
        render_unit([desc(), desc(tile_n=32)])
