"""Logit softcapping (softcap=c: each scaled score z becomes c * tanh(z / c) before the sink and the
mask) on the GPU: forward (O, LSE) and backward (dq, dk, dv, dsink) of both kernel families
against the fp32 reference (FA-style(2) and (3), shared/CONVENTIONS.md), with windows, causal
masks, S_q != S_k both ways, GQA and sinks, packed batches, caps that saturate the tanh, the
deterministic backward, autograd through the SDPA drop-in, and the typed error of a softcap that
was not generated. Outputs and gradients go into NaN-filled buffers framed by NaN canaries."""
from __future__ import annotations

from functools import partial

import pytest
import torch

import flashkiln
from backward_log import backward_plans
from reference import attention_grad_reference, attention_reference, check_grads_against, fa_style_check, \
    repro_line, seed_of
from test_varlen_gpu import _check_forward, _forward, _packed_case, _reference_grads
from test_window_gpu import _canaries_intact, _framed_nan, _on_hopper, _tensors

gpu = pytest.mark.gpu
_repro = partial(repro_line, "test_softcap_gpu.py")
FAMILIES = ("hopper", "portable")
SHAPES = [(1, 1), (7, 7), (113, 129), (129, 113), (300, 300), (17, 300), (300, 17)]


def _families() -> tuple[str, ...]:
    return FAMILIES if _on_hopper() else ("portable",)


def _run(q, k, v, dout, backend, repro, **kw):
    """Forward and backward of `backend` into NaN-filled, canary-framed buffers; (out, lse, grads)."""
    out_storage, out = _framed_nan((*q.shape[:3], v.shape[3]), q.dtype)
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    got_out, got_lse = flashkiln.attention_forward(q, k, v, out=out, lse=lse, backend=backend, **kw)
    storages, buffers = zip(*(_framed_nan(t.shape, t.dtype) for t in (q, k, v)))
    sink_grad = {"sink_grad": True} if kw.get("sink") is not None else {}
    with backward_plans() as plans:
        grads = flashkiln.attention_backward(dout, q, k, v, got_out, got_lse, backend=backend, dq=buffers[0],
                                             dk=buffers[1], dv=buffers[2], **kw, **sink_grad)
    torch.cuda.synchronize()
    assert _canaries_intact(out_storage) and all(_canaries_intact(s) for s in storages), \
        f"canary rows were overwritten\n{repro}"
    assert plans and {p.family for p in plans} == {backend}, f"expected the {backend} family, planned {plans}\n{repro}"
    return got_out, got_lse, grads


def _check(q, k, v, dout, causal, repro, sink=None, families: tuple[str, ...] | None = None, **kw):
    """The O, LSE and gradients of every family (or of `families`) against the references, with `kw`
    (softcap, window)."""
    ref_kw = dict(window=kw.get("window_size"), softcap=kw["softcap"])
    r32 = attention_reference(q, k, v, causal, None, torch.float32, sink=sink, **ref_kw)
    rlp = attention_reference(q, k, v, causal, None, q.dtype, sink=sink, **ref_kw)
    g32 = attention_grad_reference(q, k, v, dout, causal, None, torch.float32, sink=sink, **ref_kw)
    glp = attention_grad_reference(q, k, v, dout, causal, None, q.dtype, sink=sink, **ref_kw)
    for backend in families or _families():
        r = f"{repro} backend={backend}"
        out, lse, grads = _run(q, k, v, dout, backend, r, causal=causal, sink=sink, **kw)
        fa_style_check("out", out, r32.out, rlp.out, 2, r)
        fa_style_check("lse", lse, r32.lse, rlp.lse, 2, r)
        check_grads_against(grads, g32, glp, r)


@gpu
@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize("window", [None, (48, 16)])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", SHAPES)
def test_forward_and_backward(sq, sk, d, causal, window, softcap):
    """GQA 4/2, bf16: a cap of 5 bends most scores (|z| ~ 3), 30 (Gemma 2's range) few."""
    seed = seed_of("softcap", sq, sk, d, causal, window, softcap)
    q, k, v, dout, _ = _tensors(seed, 2, 4, 2, sq, sk, d, torch.bfloat16)
    _check(q, k, v, dout, causal, _repro("test_forward_and_backward", seed=seed, sq=sq, sk=sk, d=d, causal=causal,
                                         window=window, softcap=softcap),
           softcap=softcap, window_size=window)


@gpu
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("window", [None, (48, 16)])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (113, 129), (129, 113), (300, 17)])
def test_head_dim_256(sq, sk, causal, window, softcap):
    """d 256 (Gemma 2 9B: cap 50, windows of 4096), which the hopper family alone generates."""
    if not _on_hopper():
        pytest.skip("softcaps at d 256 are generated for the hopper family (compute capability 9.0) only")
    seed = seed_of("softcap-d256", sq, sk, causal, window, softcap)
    q, k, v, dout, _ = _tensors(seed, 2, 4, 2, sq, sk, 256, torch.bfloat16)
    _check(q, k, v, dout, causal, _repro("test_head_dim_256", seed=seed, sq=sq, sk=sk, causal=causal, window=window,
                                         softcap=softcap),
           families=("hopper",), softcap=softcap, window_size=window)


@gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_saturated_scores(d):
    """Scores of magnitude ~40 under a cap of 10: the tanh saturates, its slope is near 0, and the
    probabilities concentrate on the capped maxima. d 256: the hopper family's alone."""
    if d == 256 and not _on_hopper():
        pytest.skip("softcaps at d 256 are generated for the hopper family (compute capability 9.0) only")
    seed = seed_of("softcap-saturated", d)
    q, k, v, dout, _ = _tensors(seed, 1, 2, 2, 257, 257, d, torch.bfloat16)
    q = (q * 6).to(torch.bfloat16)
    _check(q, k, v, dout, "bottom_right", _repro("test_saturated_scores", seed=seed, d=d),
           families=("hopper",) if d == 256 else None, softcap=10.0)


@gpu
@pytest.mark.parametrize("window", [None, (32, 0)])
@pytest.mark.parametrize("sq, sk", [(113, 129), (300, 17)])
def test_gqa_with_sinks(sq, sk, window):
    seed = seed_of("softcap-sinks", sq, sk, window)
    q, k, v, dout, gen = _tensors(seed, 2, 4, 2, sq, sk, 128, torch.bfloat16)
    sink = 2.0 * torch.randn(4, device="cuda", generator=gen) + 1.0
    _check(q, k, v, dout, "bottom_right", _repro("test_gqa_with_sinks", seed=seed, sq=sq, sk=sk, window=window),
           sink=sink, softcap=8.0, window_size=window)


@gpu
@pytest.mark.parametrize("backend", FAMILIES)
def test_packed_batch(backend):
    """A packed batch with empty sequences, GQA 4/2: each sequence as the dense call of its own
    tokens, rows of tokens in no sequence O = 0 and zero gradients. The hopper forward has no packed
    softcap variant: auto runs the forward on the portable family, `backend` the backward."""
    if backend == "hopper" and not _on_hopper():
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    seed = seed_of("softcap-packed", backend)
    case = _packed_case(seed, "mixed", hq=4, hkv=2, dims=(64, 64))
    repro = _repro("test_packed_batch", seed=seed, backend=backend)
    out, lse = _forward(case, "bottom_right", softcap=6.0)
    _check_forward(case, out, lse, "bottom_right", None, None, repro, softcap=6.0)
    with backward_plans() as plans:
        grads = flashkiln.attention_backward(case.dout, case.q, case.k, case.v, out, lse, causal="bottom_right",
                                             softcap=6.0, packed=case.packed(), backend=backend)
    assert {p.family for p in plans} == {backend}, f"planned {plans}\n{repro}"
    assert case.canaries_intact(), f"canary overwritten\n{repro}"
    check_grads_against(grads, *(_reference_grads(case, "bottom_right", None, None, t, softcap=6.0)
                                 for t in (torch.float32, case.q.dtype)), repro)


@gpu
def test_deterministic_backward_is_bitwise_reproducible():
    """The hopper backward's ordered route with a softcap: 20 runs, bitwise equal."""
    if not _on_hopper():
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    seed = seed_of("softcap-deterministic")
    q, k, v, dout, _ = _tensors(seed, 2, 4, 2, 1000, 1000, 128, torch.bfloat16)
    out, lse = flashkiln.attention_forward(q, k, v, causal="bottom_right", softcap=20.0)
    first = flashkiln.attention_backward(dout, q, k, v, out, lse, causal="bottom_right", softcap=20.0,
                                         deterministic=True)
    for run in range(19):
        again = flashkiln.attention_backward(dout, q, k, v, out, lse, causal="bottom_right", softcap=20.0,
                                             deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"run {run + 2} differs\n" + _repro(
            "test_deterministic_backward_is_bitwise_reproducible", seed=seed)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_autograd(causal):
    seed = seed_of("softcap-sdpa", causal)
    q, k, v, dout, _ = _tensors(seed, 2, 4, 4, 333, 333, 64, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashkiln.scaled_dot_product_attention(*leaves, is_causal=causal, softcap=7.0)
    out.backward(dout)
    repro = _repro("test_sdpa_autograd", seed=seed, causal=causal)
    mode = "top_left" if causal else None
    fa_style_check("out", out, attention_reference(q, k, v, mode, None, torch.float32, softcap=7.0).out,
                   attention_reference(q, k, v, mode, None, torch.bfloat16, softcap=7.0).out, 2, repro)
    check_grads_against(tuple(t.grad for t in leaves),
                        attention_grad_reference(q, k, v, dout, mode, None, torch.float32, softcap=7.0),
                        attention_grad_reference(q, k, v, dout, mode, None, torch.bfloat16, softcap=7.0), repro)


@gpu
def test_a_softcap_that_was_not_generated_is_a_typed_error_before_any_launch():
    """fp16 has no softcap variant: VariantNotFoundError naming the YAML, the given output untouched."""
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(flashkiln.VariantNotFoundError, match="softcap: \\[true\\]"):
        flashkiln.attention_forward(q, q, q, softcap=30.0, out=out, backend="portable")
    assert torch.isnan(out).all()
