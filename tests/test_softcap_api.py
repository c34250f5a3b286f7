"""Logit softcapping on the CPU: softcap's checks, the kernels' score scaling that carries it, the
requests and parameter blocks the planners make of it, and the error that names its YAML."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import flashkiln
from flashkiln import inputs
from flashkiln.calls import BackwardCall
from flashkiln.errors import VariantNotFoundError
from test_registry import all_variants, descriptor, fake_registry, planned_backward, planned_forward
from test_window_api import kernel_tensors


@pytest.mark.parametrize("softcap, expected", [(None, None), (0, None), (0.0, None), (30, 30.0), (50.0, 50.0),
                                               (0.5, 0.5)])
def test_softcap_normal_form(softcap, expected):
    assert inputs.check_softcap(softcap) == expected


@pytest.mark.parametrize("softcap", [-1.0, float("inf"), float("nan"), True, "30", (30,)])
def test_bad_softcaps_are_typed_errors_before_any_launch(softcap):
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)  # on the CPU: the softcap's check comes first
    for call in (lambda: flashkiln.attention_forward(q, q, q, softcap=softcap),
                 lambda: flashkiln.attention_backward(q, q, q, q, q, torch.zeros(1, 2, 16), softcap=softcap),
                 lambda: flashkiln.scaled_dot_product_attention(q, q, q, softcap=softcap)):
        with pytest.raises(flashkiln.InvalidInputError, match="softcap"):
            call()


def test_score_fields_carry_the_cap_in_the_kernels_units():
    """With a cap c the kernels scale by c (LSE, base-2 softmax, 1 / scale for the bias) and enter
    the tanh with scale / c: c * tanh(s * scale / c) in natural units."""
    assert inputs.score_fields(0.125, None) == {"scale": 0.125, "scale_log2": 0.125 * math.log2(math.e),
                                                "softcap_scale": 0.0}
    got = inputs.score_fields(0.125, 30.0)
    assert got["scale"] == 30.0 and got["softcap_scale"] == 0.125 / 30.0
    assert got["scale_log2"] == pytest.approx(30.0 * math.log2(math.e))


def capped(d):
    return dataclasses.replace(d, softcap=True)


def test_a_capped_forward_takes_the_softcap_variant_and_its_scaling(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants() + [capped(descriptor(causal="bottom_right"))])
    q, k, v, out, lse = kernel_tensors()
    launch = planned_forward(q, k, v, out, lse, "bottom_right", 0.1, None, (9, 0), registry, softcap=20.0)
    assert launch.entry.descriptor["softcap"]
    assert (launch.params.scale, launch.params.softcap_scale) == (20.0, pytest.approx(0.1 / 20.0))
    plain = planned_forward(q, k, v, out, lse, "bottom_right", 0.1, None, (9, 0), registry)
    assert not plain.entry.descriptor["softcap"]
    assert (plain.params.scale, plain.params.softcap_scale) == (pytest.approx(0.1), 0.0)


def test_a_softcap_variant_that_was_not_generated_names_its_yaml(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants())
    q, k, v, out, lse = kernel_tensors()
    with pytest.raises(VariantNotFoundError) as info:
        planned_forward(q, k, v, out, lse, "none", 0.1, None, (9, 0), registry, softcap=50.0)
    assert "softcap=True" in str(info.value) and "    softcap: [true]\n" in str(info.value)


def test_only_the_kernels_that_compute_scores_carry_the_softcap():
    q, k, v, out, lse = kernel_tensors()
    call = BackwardCall(q, q, k, v, out, lse, q, k, v, "none", 0.1, False, softcap=30.0)
    assert call.request("portable")["softcap"]
    assert not any(call.kernel_request(kernel, "portable")["softcap"] for kernel in ("bwd_pre", "bwd_post", "bwd_dq"))


def test_every_backward_launch_scales_by_the_cap(tmp_path):
    """The postprocess multiplies dQ by scale: with a cap that is c, which with the main kernel's
    slope factor softcap_scale = scale / c gives dQ its scale."""
    backward = [dataclasses.replace(descriptor(), kernel=kernel, softcap=kernel == "bwd")
                for kernel in ("bwd_pre", "bwd_post", "bwd")]
    registry, _ = fake_registry(tmp_path, backward)
    q, k, v, out, lse = kernel_tensors()
    planned = planned_backward(q, q, k, v, out, lse, q, k, v, "none", 0.1, False, (9, 0), 141 << 30, registry,
                               softcap=25.0)
    assert planned.launches[1].entry.descriptor["softcap"]
    for launch in planned.launches:
        scaling = (launch.params.scale, launch.params.softcap_scale)
        assert scaling == (25.0, pytest.approx(0.1 / 25.0)), launch.entry.name
