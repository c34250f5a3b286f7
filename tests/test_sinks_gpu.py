"""Attention sinks on the GPU: forward (out, sink-inclusive LSE) and backward (dq, dk, dv, dsink)
against the fp32 reference, with causal masks, GQA and a bias; determinism of dsink."""
from __future__ import annotations

from functools import partial

import pytest
import torch

import flashkiln
from reference import (GRAD_FLOOR, attention_grad_reference, attention_reference, check_grads_against,
                       fa_style_check, repro_line, seed_of)

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_sinks_gpu.py")

B, HQ, HKV = 2, 6, 2
HEAD_DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]


def _inputs(seed: int, sq: int, sk: int, dims=(128, 128)):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dqk, dv = dims
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v, dout = make(B, HQ, sq, dqk), make(B, HKV, sk, dqk), make(B, HKV, sk, dv), make(B, HQ, sq, dv)
    # Sinks from well below to well above the typical row maximum, in the sink's own dtype.
    sink = torch.linspace(-3.0, 6.0, HQ, device="cuda").to(torch.bfloat16)
    return q, k, v, dout, sink, gen


def _check_dsink(dsink, ref32, reflp, repro):
    """FA-style(3) on dsink, with no floor beyond the gradients' own: the kernels sum p_sink * P * dP
    in fp32 (flashkiln.sinks), so the forward's rounded O does not enter it."""
    fa_style_check("dsink", dsink, ref32.dsink, reflp.dsink, 3, repro, floor=GRAD_FLOOR)


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"d{a}x{b}" for a, b in HEAD_DIMS])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(129, 200), (300, 113)])
def test_sinks_forward_and_backward(sq, sk, causal, dims):
    seed = seed_of("sinks", sq, sk, causal, dims)
    q, k, v, dout, sink, _ = _inputs(seed, sq, sk, dims)
    repro = _repro("test_sinks_forward_and_backward", seed=seed, sq=sq, sk=sk, causal=causal, dims=dims)
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, sink=sink)
    ref32 = attention_reference(q, k, v, causal, None, torch.float32, sink=sink)
    reflp = attention_reference(q, k, v, causal, None, q.dtype, sink=sink)
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, repro)
    # Rows that see no key: O = 0 and LSE = the sink.
    empty = ref32.empty_rows
    assert (out[empty] == 0).all()
    assert torch.equal(lse[empty], sink.float()[None, :, None].expand_as(lse)[empty])
    *grads, dsink = flashkiln.attention_backward(dout, q, k, v, out, lse, causal=causal, sink=sink, sink_grad=True)
    assert dsink.shape == sink.shape and dsink.dtype == sink.dtype
    ref32 = attention_grad_reference(q, k, v, dout, causal, None, torch.float32, sink=sink)
    reflp = attention_grad_reference(q, k, v, dout, causal, None, q.dtype, sink=sink)
    check_grads_against(grads, ref32, reflp, repro)
    _check_dsink(dsink, ref32, reflp, repro)


def test_sinks_with_a_bias_through_autograd_and_deterministic_dsink():
    seed = seed_of("sinks-bias")
    q, k, v, dout, sink, gen = _inputs(seed, 257, 320)
    bias = torch.randn(1, HQ, 257, 320, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.detach().requires_grad_()
    out = flashkiln.scaled_dot_product_attention(*leaves, attn_mask=bias, is_causal=True, enable_gqa=True,
                                                 sink=sink_leaf)
    out.backward(dout)
    repro = _repro("test_sinks_with_a_bias_through_autograd_and_deterministic_dsink", seed=seed)
    ref32 = attention_grad_reference(q, k, v, dout, "top_left", None, torch.float32, bias, sink)
    reflp = attention_grad_reference(q, k, v, dout, "top_left", None, q.dtype, bias, sink)
    check_grads_against((*(t.grad for t in leaves), bias.grad), ref32, reflp, repro)
    out, lse = flashkiln.attention_forward(q, k, v, causal="top_left", bias=bias.detach(), sink=sink)
    _check_dsink(sink_leaf.grad, ref32, reflp, repro)
    runs = [flashkiln.attention_backward(dout, q, k, v, out, lse, causal="top_left", bias=bias.detach(),
                                         bias_grad=True, sink=sink, sink_grad=True, deterministic=True)
            for _ in range(20)]
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsink"), runs[0], run):
            assert torch.equal(a, b), f"{name} differs between deterministic runs (seed {seed})"


def test_a_sink_far_above_every_score_takes_all_the_mass():
    q, k, v, dout, _, _ = _inputs(seed_of("sink-mass"), 64, 64)
    sink = torch.full((HQ,), 80.0, device="cuda")
    out, lse = flashkiln.attention_forward(q, k, v, sink=sink)
    assert out.abs().max() < 1e-12 and torch.allclose(lse, torch.full_like(lse, 80.0))
    assert not torch.isnan(out).any()
