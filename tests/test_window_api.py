"""Sliding windows on the CPU: window_size's checks and normal form, the requests and parameter
blocks the planners make of it, and the error that names the YAML of a window variant."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import flashkiln
from flashkiln import inputs
from flashkiln.calls import BackwardCall
from flashkiln.errors import VariantNotFoundError
from flashkiln.visibility import UNBOUNDED_REACH
from test_registry import (all_variants, descriptor, fake_registry, planned_backward, planned_forward)


@pytest.mark.parametrize("window_size, causal, expected", [
    (None, "none", None),
    ((-1, -1), "none", None),  # bounds nothing
    ((3, 5), "none", (3, 5)),
    ([3, 5], "none", (3, 5)),
    ((0, 0), "none", (0, 0)),
    ((-1, 4), "none", (-1, 4)),
    ((4, -1), "none", (4, -1)),
    ((3, 5), "bottom_right", (3, 0)),  # causal: right = 0
    ((-1, 5), "bottom_right", None),  # the causal mask alone
    ((3, -1), "top_left", (3, 0)),
    ((UNBOUNDED_REACH, 2), "none", (-1, 2)),  # past every sequence: unbounded
    ((UNBOUNDED_REACH, UNBOUNDED_REACH), "none", None),
])
def test_window_normal_form(window_size, causal, expected):
    assert inputs.check_window(window_size, causal) == expected


@pytest.mark.parametrize("window_size, match", [
    ((-2, 0), "-1 .unbounded. or at least 0"),
    ((0, -5), "-1 .unbounded. or at least 0"),
    ((1,), "pair of ints"),
    ((1, 2, 3), "pair of ints"),
    ("ab", "pair of ints"),
    ((True, 0), "pair of ints"),
    ((1.0, 2), "pair of ints"),
    (4, "pair of ints"),
])
def test_bad_windows_are_typed_errors_before_any_launch(window_size, match):
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)  # on the CPU: the window's check comes first
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.attention_forward(q, q, q, window_size=window_size)
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.attention_backward(q, q, q, q, q, torch.zeros(1, 2, 16), window_size=window_size)
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.scaled_dot_product_attention(q, q, q, window_size=window_size)


def windowed(d):
    return dataclasses.replace(d, window=True)


def kernel_tensors(sq=100, sk=120, d=128):
    q = torch.zeros(1, 2, sq, d, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, sk, d, dtype=torch.bfloat16)
    return q, k, k.clone(), torch.zeros_like(q), torch.zeros(1, 2, sq)


def test_a_windowed_forward_takes_the_window_variant_and_passes_its_reach(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants() + [windowed(descriptor(causal="bottom_right"))])
    q, k, v, out, lse = kernel_tensors()
    launch = planned_forward(q, k, v, out, lse, "bottom_right", 0.1, None, (9, 0), registry, window=(7, 0))
    assert launch.entry.descriptor["window"] and launch.entry.descriptor["causal"] == "bottom_right"
    assert (launch.params.window_left, launch.params.window_right) == (7, 0)
    plain = planned_forward(q, k, v, out, lse, "bottom_right", 0.1, None, (9, 0), registry)
    assert not plain.entry.descriptor["window"]
    assert (plain.params.window_left, plain.params.window_right) == (-1, -1)


def test_a_window_variant_that_was_not_generated_names_its_yaml(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants())
    q, k, v, out, lse = kernel_tensors()
    with pytest.raises(VariantNotFoundError) as info:
        planned_forward(q, k, v, out, lse, "none", 0.1, None, (9, 0), registry, window=(16, 16))
    message = str(info.value)
    assert "window=True" in message and "    window: [true]\n" in message
    assert "append this group to `variants:` in specs/portable.yaml" in message


def test_only_the_kernels_that_tile_by_visibility_carry_the_window():
    q, k, v, out, lse = kernel_tensors()
    call = BackwardCall(q, q, k, v, out, lse, q, k, v, "none", 0.1, False, window=(4, 4))
    assert call.request("portable")["window"]
    assert call.kernel_request("bwd_dq", "portable")["window"]
    assert not call.kernel_request("bwd_pre", "portable")["window"]
    assert not call.kernel_request("bwd_post", "hopper")["window"]
    assert not dataclasses.replace(call, window=None).request("portable")["window"]


def test_a_windowed_backward_passes_its_reach_to_every_launch(tmp_path):
    backward = [dataclasses.replace(descriptor(), kernel=kernel, deterministic=det, window=window)
                for kernel, det, window in (("bwd_pre", False, False), ("bwd_post", False, False),
                                            ("bwd", False, True), ("bwd", True, True))]
    registry, _ = fake_registry(tmp_path, backward)
    q, k, v, out, lse = kernel_tensors()
    for deterministic, route in ((False, "atomic"), (True, "ordered")):
        planned = planned_backward(q, q, k, v, out, lse, q, k, v, "none", 0.1, deterministic, (9, 0), 141 << 30,
                                   registry, window=(3, 9))
        assert planned.route == route
        pre, main, post = planned.launches
        assert main.entry.descriptor["window"] and main.entry.descriptor["deterministic"] == deterministic
        assert not pre.entry.descriptor["window"] and not post.entry.descriptor["window"]
        assert {(launch.params.window_left, launch.params.window_right) for launch in planned.launches} == {(3, 9)}
