"""Additive bias (attn_mask) on the GPU: forward and backward against the fp32 reference, dBias in
each broadcast shape, boolean masks, determinism of dBias, rows a bias masks out entirely.

Inputs are fresh random tensors from a printed seed; outputs go into NaN-poisoned buffers where
the API takes them.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch

import flashkiln
from flashkiln.errors import VariantNotFoundError
from reference import (attention_grad_reference, attention_reference, check_grads_against, fa_style_check,
                       repro_line, seed_of)

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_bias_gpu.py")

B, HQ, HKV = 2, 6, 2
CAUSAL = (None, "top_left", "bottom_right")
# S_k = 301 is no multiple of 8: the bias rows are then copied into padded rows.
SEQLENS = [(129, 200), (200, 129), (113, 301)]
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
# Bias shapes as (batch, heads, rows, cols) with 1 where it broadcasts; "2d" is (S_q, S_k).
SHAPES = {"full": "bhqk", "heads": "1hqk", "batch": "b1qk", "shared": "11qk", "2d": "qk", "keys": "b11k"}


def _inputs(seed: int, sq: int, sk: int, dims=(128, 128), dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dqk, dv = dims
    q = torch.randn(B, HQ, sq, dqk, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(B, HKV, sk, dqk, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(B, HKV, sk, dv, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(B, HQ, sq, dv, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, dout, gen


def _bias(kind: str, sq: int, sk: int, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    sizes = {"b": B, "h": HQ, "q": sq, "k": sk, "1": 1}
    shape = tuple(sizes[c] for c in SHAPES[kind])
    return 2 * torch.randn(shape, device="cuda", dtype=dtype, generator=gen)


# Each kernel family explicitly (auto picks hopper on an H200 wherever it can).
BACKENDS = ("portable", "hopper")
HOPPER_HEAD_DIMS = {(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)}  # specs/hopper.yaml


def _forward_check(q, k, v, causal, bias, repro, backend=None):
    if backend == "hopper":
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the hopper backend runs on compute capability 9.0 only")
        if (q.shape[-1], v.shape[-1]) not in HOPPER_HEAD_DIMS:
            with pytest.raises(VariantNotFoundError, match="hopper"):
                flashkiln.attention_forward(q, k, v, causal=causal, bias=bias, backend=backend)
            return
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, bias=bias, backend=backend)
    ref32 = attention_reference(q, k, v, causal, None, torch.float32, bias)
    reflp = attention_reference(q, k, v, causal, None, q.dtype, bias)
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, repro)
    assert (out[ref32.empty_rows] == 0).all(), f"rows that see no key are not 0\n{repro}"


def _backward_check(q, k, v, dout, causal, bias, bias_grad, repro):
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, bias=bias)
    grads = flashkiln.attention_backward(dout, q, k, v, out, lse, causal=causal, bias=bias, bias_grad=bias_grad)
    assert len(grads) == (4 if bias_grad else 3)
    check_grads_against(grads, attention_grad_reference(q, k, v, dout, causal, None, torch.float32, bias),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype, bias), repro)
    return grads


@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_every_bias_shape(backend, kind, causal, sq, sk):
    seed = seed_of("fwd", kind, causal, sq, sk)
    q, k, v, _, gen = _inputs(seed, sq, sk)
    _forward_check(q, k, v, causal, _bias(kind, sq, sk, gen),
                   _repro("test_forward_every_bias_shape", seed=seed, backend=backend, kind=kind, causal=causal,
                          sq=sq, sk=sk), backend)


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"d{a}x{b}" for a, b in HEAD_DIMS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_head_dims_and_dtypes(backend, dims, dtype):
    seed = seed_of("fwd-dims", dims, dtype)
    q, k, v, _, gen = _inputs(seed, 333, 1000, dims, dtype)
    _forward_check(q, k, v, "top_left", _bias("full", 333, 1000, gen, dtype),
                   _repro("test_forward_head_dims_and_dtypes", seed=seed, backend=backend, dims=dims, dtype=dtype),
                   backend)


@pytest.mark.parametrize("kind", ["full", "shared"])
def test_hopper_and_portable_forwards_agree(kind):
    """The two families on the same biased inputs, against each other within the FA-style rule."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    seed = seed_of("families", kind)
    q, k, v, _, gen = _inputs(seed, 1000, 1000)
    bias = _bias(kind, 1000, 1000, gen)
    hopper = flashkiln.attention_forward(q, k, v, causal="bottom_right", bias=bias, backend="hopper")
    portable = flashkiln.attention_forward(q, k, v, causal="bottom_right", bias=bias, backend="portable")
    ref32 = attention_reference(q, k, v, "bottom_right", None, torch.float32, bias)
    repro = _repro("test_hopper_and_portable_forwards_agree", seed=seed, kind=kind)
    fa_style_check("out", hopper[0], ref32.out, portable[0], 2, repro)
    fa_style_check("lse", hopper[1], ref32.lse, portable[1], 2, repro)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("kind", ["shared", "heads", "batch", "keys"])
@pytest.mark.parametrize("dims", sorted(HOPPER_HEAD_DIMS), ids=[f"d{a}x{b}" for a, b in sorted(HOPPER_HEAD_DIMS)])
@pytest.mark.parametrize("order", ["heads", "batch"])
def test_hopper_tile_orders(order, dims, kind, causal, force_tile_order):
    """The hopper forward's tile orders for biases broadcast over heads or batches that L2 cannot
    hold (flashkiln.hopper_family.tile_order), forced at a shape with several batches, heads
    (GQA) and query tiles."""
    forced, plans = force_tile_order(order)
    seed = seed_of("tile-order", order, dims, kind, causal)
    q, k, v, _, gen = _inputs(seed, 700, 450, dims)
    repro = _repro("test_hopper_tile_orders", seed=seed, order=order, dims=dims, kind=kind, causal=causal)
    _forward_check(q, k, v, causal, _bias(kind, 700, 450, gen), repro, "hopper")
    assert [launches[0].params.tile_order for launches in plans] == [forced]


@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("bias_grad", [True, False], ids=["dbias", "no-dbias"])
def test_backward_every_bias_shape(bias_grad, kind, causal, sq, sk):
    seed = seed_of("bwd", kind, causal, sq, sk)
    q, k, v, dout, gen = _inputs(seed, sq, sk)
    _backward_check(q, k, v, dout, causal, _bias(kind, sq, sk, gen), bias_grad,
                    _repro("test_backward_every_bias_shape", seed=seed, kind=kind, causal=causal, sq=sq, sk=sk,
                           bias_grad=bias_grad))


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"d{a}x{b}" for a, b in HEAD_DIMS])
def test_backward_head_dims(dims):
    seed = seed_of("bwd-dims", dims)
    q, k, v, dout, gen = _inputs(seed, 333, 1000, dims)
    _backward_check(q, k, v, dout, "bottom_right", _bias("batch", 333, 1000, gen), True,
                    _repro("test_backward_head_dims", seed=seed, dims=dims))


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_boolean_masks_keep_where_true(causal):
    seed = seed_of("bool", causal)
    q, k, v, dout, gen = _inputs(seed, 200, 264)
    mask = torch.rand((B, 1, 200, 264), device="cuda", generator=gen) < 0.7
    mask[:, :, 5] = False  # rows that see no key at all
    repro = _repro("test_boolean_masks_keep_where_true", seed=seed, causal=causal)
    _forward_check(q, k, v, causal, mask, repro)
    dq, dk, dv = _backward_check(q, k, v, dout, causal, mask, False, repro)
    assert (dq[:, :, 5] == 0).all()
    with pytest.raises(flashkiln.InvalidInputError, match="no gradient"):
        out, lse = flashkiln.attention_forward(q, k, v, bias=mask)
        flashkiln.attention_backward(dout, q, k, v, out, lse, bias=mask, bias_grad=True)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("kind", ["full", "shared", "keys"])
def test_dbias_is_bitwise_deterministic(kind, deterministic):
    """20 runs give identical dbias, also where it sums over broadcast dims, and with
    deterministic=True identical dq, dk and dv too."""
    seed = seed_of("det", kind)
    q, k, v, dout, gen = _inputs(seed, 500, 700)
    bias = _bias(kind, 500, 700, gen)
    out, lse = flashkiln.attention_forward(q, k, v, causal="top_left", bias=bias)
    run = lambda: flashkiln.attention_backward(dout, q, k, v, out, lse, causal="top_left", bias=bias,  # noqa: E731
                                               bias_grad=True, deterministic=deterministic)
    first = run()
    for _ in range(19):
        again = run()
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), first, again):
            if deterministic or name == "dbias":
                assert torch.equal(a, b), f"{name} differs between runs (seed {seed})"


def test_rows_masked_out_by_the_bias():
    """A bias row of -inf: O = 0, LSE = -inf, zero dq and dbias rows, no NaN anywhere."""
    seed = seed_of("inf-rows")
    q, k, v, dout, gen = _inputs(seed, 150, 260)
    bias = _bias("full", 150, 260, gen)
    bias[:, :, 7] = float("-inf")
    bias[1, 3, 100:120] = float("-inf")
    out, lse = flashkiln.attention_forward(q, k, v, bias=bias)
    assert (out[:, :, 7] == 0).all() and torch.isneginf(lse[:, :, 7]).all()
    dq, dk, dv, dbias = _backward_check(q, k, v, dout, None, bias, True,
                                        _repro("test_rows_masked_out_by_the_bias", seed=seed))
    assert (dq[:, :, 7] == 0).all() and (dbias[:, :, 7] == 0).all()
    assert not any(torch.isnan(t).any() for t in (out, dq, dk, dv, dbias))


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_attn_mask_gradient_through_autograd(is_causal):
    seed = seed_of("sdpa", is_causal)
    q, k, v, dout, gen = _inputs(seed, 256, 320)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    bias = _bias("heads", 256, 320, gen).requires_grad_()
    out = flashkiln.scaled_dot_product_attention(*leaves, attn_mask=bias, is_causal=is_causal, enable_gqa=True)
    out.backward(dout)
    grads = (*(t.grad for t in leaves), bias.grad)
    causal = "top_left" if is_causal else None
    check_grads_against(grads, attention_grad_reference(q, k, v, dout, causal, None, torch.float32, bias),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype, bias),
                        _repro("test_sdpa_attn_mask_gradient_through_autograd", seed=seed, is_causal=is_causal))
    # Without requires_grad on the mask, no dbias comes back (and none is computed).
    frozen = bias.detach()
    out = flashkiln.scaled_dot_product_attention(*leaves, attn_mask=frozen, is_causal=is_causal, enable_gqa=True)
    out.backward(dout)
    assert frozen.grad is None


def test_bias_ops_under_torch_compile(deterministic_algorithms):
    """Compiled and eager give the same gradients, bitwise: in deterministic mode, since otherwise
    dQ and a shared bias's dBias are added in any order."""
    q, k, v, dout, gen = _inputs(seed_of("compile"), 128, 192)
    bias = _bias("batch", 128, 192, gen).requires_grad_()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step(q, k, v, bias):
        return flashkiln.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    compiled = torch.compile(step, fullgraph=True)
    compiled(*leaves, bias).backward(dout)
    got = (*(t.grad for t in leaves), bias.grad)
    for t in (*leaves, bias):
        t.grad = None
    step(*leaves, bias).backward(dout)
    for a, b in zip(got, (*(t.grad for t in leaves), bias.grad)):
        assert torch.equal(a, b)
