"""VariantDescriptor: golden hashes and names, stability across processes, validation."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from flashkiln.archs import ARCHS
from flashkiln.descriptor import (
    BIAS_MODES,
    CAUSAL_MODES,
    DTYPES,
    FAMILIES,
    FUNCTIONAL_FIELDS,
    HEAD_DIMS,
    KERNELS,
    PERFORMANCE_FIELDS,
    SCHEMA_VERSION,
    VariantDescriptor,
)

# (constructor fields, golden hash, golden name): computed once from the current code and pasted.
# A change here means every generated kernel gets a new dispatch key: bump deliberately or not at all.
GOLDEN = [
    (
        dict(kernel="fwd", family="portable", arch="sm_90a", dtype="bf16", d_qk=128, d_v=128, causal="bottom_right",
             bias="none", deterministic=False, tile_m=128, tile_n=64, warps=4, stages=1),
        "237182eecb24eada",
        "fwd_portable_sm90a_bf16_d128_causal-br_237182ee",
    ),
    (
        dict(kernel="fwd", family="portable", arch="sm_80", dtype="fp16", d_qk=192, d_v=128, causal="bottom_right",
             bias="none", deterministic=False, tile_m=64, tile_n=64, warps=4, stages=2),
        "0b6555c676b913a1",
        "fwd_portable_sm80_fp16_d192x128_causal-br_0b6555c6",
    ),
    (
        dict(kernel="fwd", family="portable", arch="sm_86", dtype="fp16", d_qk=64, d_v=64, causal="none",
             bias="none", deterministic=False, tile_m=128, tile_n=32, warps=8, stages=1),
        "1eab1b255071feec",
        "fwd_portable_sm86_fp16_d64_1eab1b25",
    ),
    (
        dict(kernel="fwd", family="hopper", arch="sm_90a", dtype="bf16", d_qk=128, d_v=128, causal="bottom_right",
             bias="none", deterministic=False, tile_m=128, tile_n=128, warps=12, stages=2, packed=True),
        "e38a77c7694ee51d",
        "fwd_hopper_sm90a_bf16_d128_causal-br_packed_e38a77c7",
    ),
]

# Valid values of each field (the performance fields are any positive integers).
DOMAINS = {
    "kernel": KERNELS,
    "family": FAMILIES,
    "arch": tuple(ARCHS),
    "dtype": DTYPES,
    "d_qk": HEAD_DIMS,
    "d_v": HEAD_DIMS,
    "causal": CAUSAL_MODES,
    "bias": BIAS_MODES,
    "deterministic": (False,),
    "packed": (False, True),
    "window": (False, True),
    "softcap": (False, True),
    "bias_grad": (False,),  # true only for the hopper backward with a bias (make() is a portable forward)
    "tile_m": (16, 32, 64, 128, 256),
    "tile_n": (16, 32, 64, 128, 256),
    "warps": (1, 2, 4, 8),
    "stages": (1, 2, 3),
}


def base_fields(**overrides):
    return {**GOLDEN[0][0], **overrides}


def make(**overrides) -> VariantDescriptor:
    return VariantDescriptor(**base_fields(**overrides))


# -- golden values ----------------------------------------------------------------------------

@pytest.mark.parametrize("fields, golden_hash, golden_name", GOLDEN, ids=[g[2] for g in GOLDEN])
def test_golden_hash_and_name(fields, golden_hash, golden_name):
    d = VariantDescriptor(**fields)
    assert d.hash == golden_hash
    assert d.name == golden_name


_CHILD = """
import json, sys
from flashkiln.descriptor import VariantDescriptor
fields = json.loads(sys.argv[1])
print(json.dumps([[VariantDescriptor(**f).hash, VariantDescriptor(**f).name] for f in fields]))
"""


@pytest.mark.parametrize("seed", ["1", "2"])
def test_golden_values_are_stable_across_processes(seed):
    env = {**os.environ, "PYTHONHASHSEED": seed}
    result = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([g[0] for g in GOLDEN])],
                            capture_output=True, text=True, env=env, check=True)
    assert json.loads(result.stdout) == [[g[1], g[2]] for g in GOLDEN]


def test_all_fields_are_in_exactly_one_group():
    names = [f.name for f in dataclasses.fields(VariantDescriptor)]
    assert sorted(names) == sorted(FUNCTIONAL_FIELDS + PERFORMANCE_FIELDS)
    assert not set(FUNCTIONAL_FIELDS) & set(PERFORMANCE_FIELDS)


# -- every field is part of the identity ------------------------------------------------------

def _alternative(name: str, value):
    others = [v for v in DOMAINS[name] if v != value]
    return others[0] if others else None


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(VariantDescriptor)])
def test_changing_any_field_changes_the_hash(field):
    d = make()
    other = _alternative(field, getattr(d, field))
    if other is not None:
        changed = dataclasses.replace(d, **{field: other})
    else:
        # A field with a single valid value today (bias, deterministic, ...): force another value
        # past validation to prove the hash still reads it, so a future value gets its own key.
        changed = copy.copy(d)
        object.__setattr__(changed, field, "other")
    assert changed.hash != d.hash
    assert changed.canonical() != d.canonical()


def test_fields_with_alternatives_cover_every_multi_valued_domain():
    # Guards the test above: the fields that have another valid value really get replaced.
    multi = {name for name, values in DOMAINS.items() if len(values) > 1}
    assert multi >= {"arch", "dtype", "d_qk", "d_v", "causal", *PERFORMANCE_FIELDS}


def test_hash_does_not_depend_on_construction_order():
    fields = base_fields()
    reordered = dict(reversed(list(fields.items())))
    assert VariantDescriptor(**reordered).hash == VariantDescriptor(**fields).hash


# -- canonical form ---------------------------------------------------------------------------

def test_canonical_is_sorted_compact_json_with_schema():
    d = make()
    text = d.canonical()
    assert " " not in text and "\n" not in text
    parsed = json.loads(text)
    fields = dataclasses.asdict(d)
    for later in ("packed", "window", "softcap", "bias_grad"):  # added later: left out at their defaults
        del fields[later]
    assert parsed == {"schema": SCHEMA_VERSION, **fields}
    assert list(parsed) == sorted(parsed)
    assert text == ('{"arch":"sm_90a","bias":"none","causal":"bottom_right","d_qk":128,"d_v":128,'
                    '"deterministic":false,"dtype":"bf16","family":"portable","kernel":"fwd","schema":1,'
                    '"stages":1,"tile_m":128,"tile_n":64,"warps":4}')


def test_a_field_added_later_is_in_the_hash_only_away_from_its_default():
    # So the kernels that existed before `packed` keep their names and dispatch keys.
    assert "packed" not in make().canonical()
    assert '"packed":true' in make(packed=True).canonical()


def test_hash_is_16_hex_digits():
    assert re.fullmatch(r"[0-9a-f]{16}", make().hash)


# -- names and symbols ------------------------------------------------------------------------

@pytest.mark.parametrize("causal, tag", [("none", ""), ("bottom_right", "_causal-br")])
def test_name_format(causal, tag):
    d = make(causal=causal)
    assert d.name == f"fwd_portable_sm90a_bf16_d128{tag}_{d.hash[:8]}"


def test_name_shows_both_dims_when_they_differ():
    d = make(d_qk=192, d_v=128)
    assert d.name == f"fwd_portable_sm90a_bf16_d192x128_causal-br_{d.hash[:8]}"


@pytest.mark.parametrize("fields", [g[0] for g in GOLDEN])
def test_symbol_is_a_c_identifier(fields):
    d = VariantDescriptor(**fields)
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", d.symbol)
    assert d.symbol == "flashkiln_" + d.name.replace("-", "_")


def test_tunings_of_one_variant_share_the_functional_key_only():
    a, b = make(), make(tile_n=32)
    assert a.functional_key == b.functional_key
    assert a.hash != b.hash and a.name != b.name


# -- round trip and validation ----------------------------------------------------------------

@pytest.mark.parametrize("fields", [g[0] for g in GOLDEN])
def test_from_dict_round_trip(fields):
    d = VariantDescriptor(**fields)
    assert VariantDescriptor.from_dict(d.as_dict()) == d
    # The canonical form (with "schema") parses back too.
    again = VariantDescriptor.from_dict(json.loads(d.canonical()))
    assert again == d and again.hash == d.hash


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown descriptor fields.*'tile_k'"):
        VariantDescriptor.from_dict({**make().as_dict(), "tile_k": 32})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dtype": "fp8"}, "dtype='fp8'"),
        ({"d_qk": 80}, "d_qk=80"),
        ({"d_v": 80}, "d_v=80"),
        ({"d_qk": True}, "d_qk=True"),
        ({"deterministic": 1}, "deterministic=1"),
        ({"deterministic": "yes"}, "deterministic='yes'"),
        ({"tile_m": 0}, "tile_m=0"),
        ({"tile_n": -16}, "tile_n=-16"),
        ({"warps": True}, "warps=True"),
        ({"stages": 1.0}, "stages=1.0"),
        ({"arch": "sm_70"}, "arch='sm_70'"),
        ({"causal": "yes"}, "causal='yes'"),
        ({"kernel": "bwd_dk"}, "kernel='bwd_dk'"),
    ],
)
def test_invalid_values_raise(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(**overrides)


def test_every_problem_is_reported():
    with pytest.raises(ValueError) as info:
        make(dtype="fp8", d_qk=80, tile_m=0)
    text = str(info.value)
    assert "dtype='fp8'" in text and "d_qk=80" in text and "tile_m=0" in text


def test_float_head_dim_is_rejected():
    with pytest.raises(ValueError, match=re.escape("d_qk=128.0")):
        make(d_qk=128.0)
