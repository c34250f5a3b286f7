"""Gradients where rounding and odd shapes bite, on the GPU, against the fp32 reference: dBias of
broadcast biases with one or few keys, dSink, the LSE's gradient, head dims that were not generated,
and the contracts on output buffers and packed tokens in no sequence."""
from __future__ import annotations

import itertools
import threading
from functools import partial

import pytest
import torch

import flashkiln
from flashkiln.dq_routes import ROUTE_ENV
from reference import (attention_grad_reference, attention_reference, check_grads_against,
                       fa_style_check, repro_line, seed_of)

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_gradients_gpu.py")
BF16 = torch.bfloat16


def _randn(gen, *shape, dtype=BF16, scale=1.0):
    return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(dtype)


def _references(q, k, v, dout, causal, scale=None, bias=None, sink=None, dlse=None):
    return tuple(attention_grad_reference(q, k, v, dout, causal, scale, dtype, bias, sink, dlse)
                 for dtype in (torch.float32, q.dtype))


# -- 1. dBias of a bias broadcast to one key (the report), and the class of shapes around it ----------

def test_broadcast_dbias_with_one_key_gqa_and_a_sink_as_reported():
    """bf16, d 64, B 1, H_q 6 / H_kv 2, S_q 1023, S_k 1, causal, a (1, 1, 1, 1) bias viewed out of a
    wider tensor, an fp32 sink, q at a storage offset of one element, k with a head-dim stride of 2,
    v and dO as (B, S, H, D) views: through SDPA's autograd."""
    seed = seed_of("report-dbias-one-key")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, hkv, sq, sk, d = 1, 6, 2, 1023, 1, 64
    q = _randn(gen, b * hq * sq * d + 1)[1:].view(b, hq, sq, d)
    k = _randn(gen, b, hkv, sk, 2 * d)[..., ::2]
    v = _randn(gen, b, sk, hkv, d).transpose(1, 2)
    dout = _randn(gen, b, sq, hq, d).transpose(1, 2)
    wide = _randn(gen, 1, 1, 1, 8, scale=3.0)
    sink = torch.randn(hq, device="cuda", generator=gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    wide_leaf = wide.detach().requires_grad_()
    bias = wide_leaf[..., 3:4]
    sink_leaf = sink.detach().requires_grad_()
    out = flashkiln.scaled_dot_product_attention(*leaves, attn_mask=bias, is_causal=True, enable_gqa=True,
                                                 sink=sink_leaf, deterministic=False)
    out.backward(dout)
    got = (*(t.grad for t in leaves), wide_leaf.grad[..., 3:4], sink_leaf.grad)
    assert not wide_leaf.grad[..., :3].any() and not wide_leaf.grad[..., 4:].any()
    ref32, reflp = _references(q, k, v, dout, "top_left", None, wide[..., 3:4], sink)
    check_grads_against(got, ref32, reflp, _repro("test_broadcast_dbias_with_one_key_gqa_and_a_sink_as_reported",
                                                  seed=seed))


BIAS_PATTERNS = list(itertools.product((False, True), repeat=4))  # which of (B, H, S_q, S_k) broadcast


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondet", "det"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(sq, sk) for sq in (1, 2, 7) for sk in (1, 2, 7)] + [(1023, 1), (129, 2)])
def test_every_broadcast_bias_with_few_keys_gqa_and_sinks(sq, sk, causal, deterministic):
    """Every broadcast shape of the bias (a dim of 1 or the full size, then the dims of 1 left out
    in front), with GQA 6/2 and fp32 sinks; dBias and dSink with dq, dk, dv, twice (bitwise equal
    when deterministic)."""
    seed = seed_of("few-keys", sq, sk, causal, deterministic)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, hkv, d = 2, 6, 2, 64
    q, k, v = _randn(gen, b, hq, sq, d), _randn(gen, b, hkv, sk, d), _randn(gen, b, hkv, sk, d)
    dout = _randn(gen, b, hq, sq, d)
    sink = torch.linspace(-2.0, 3.0, hq, device="cuda")
    full = (b, hq, sq, sk)
    for pattern in BIAS_PATTERNS:
        shape = tuple(1 if broadcast else n for broadcast, n in zip(pattern, full))
        while len(shape) > 1 and shape[0] == 1 and pattern[0]:
            shape, pattern = shape[1:], pattern[1:]
        bias = _randn(gen, *shape, scale=3.0)
        repro = _repro("test_every_broadcast_bias_with_few_keys_gqa_and_sinks", seed=seed, sq=sq, sk=sk,
                       causal=causal, deterministic=deterministic, bias_shape=shape)
        out, lse = flashkiln.attention_forward(q, k, v, causal=causal, bias=bias, sink=sink)
        runs = [flashkiln.attention_backward(dout, q, k, v, out, lse, causal=causal, bias=bias, bias_grad=True,
                                             sink=sink, sink_grad=True, deterministic=deterministic)
                for _ in range(2)]
        assert runs[0][3].shape == shape, repro
        if deterministic:
            assert all(torch.equal(a, c) for a, c in zip(*runs)), f"runs differ\n{repro}"
        ref32, reflp = _references(q, k, v, dout, causal, None, bias, sink)
        check_grads_against(runs[0], ref32, reflp, repro)


# -- 2. dSink (and a key-constant dBias) within the rule without a rounding floor ---------------------

def test_dsink_of_the_reported_configuration():
    """bf16, d 128, B 1, H 1, S 255, bottom-right causal, a full bias with rows of -inf, an fp32 sink
    with grad, deterministic."""
    seed = seed_of("report-dsink")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s, d = 255, 128
    q, k, v, dout = (_randn(gen, 1, 1, s, d) for _ in range(4))
    bias = _randn(gen, 1, 1, s, s)
    bias[:, :, ::17] = float("-inf")
    sink = torch.randn(1, device="cuda", generator=gen)
    out, lse = flashkiln.attention_forward(q, k, v, causal="bottom_right", bias=bias, sink=sink)
    grads = flashkiln.attention_backward(dout, q, k, v, out, lse, causal="bottom_right", bias=bias,
                                         bias_grad=True, sink=sink, sink_grad=True, deterministic=True)
    ref32, reflp = _references(q, k, v, dout, "bottom_right", None, bias, sink)
    check_grads_against(grads, ref32, reflp, _repro("test_dsink_of_the_reported_configuration", seed=seed))


@pytest.mark.parametrize("case", range(24))
def test_dsink_across_random_configurations(case):
    seed = seed_of("dsink-random", case)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=gen, device="cuda"))]  # noqa: E731
    d = pick(64, 128, 256)
    b, hq = pick(1, 2), pick(1, 3, 6)
    hkv = pick(*[h for h in (1, 3, 6) if hq % h == 0])
    sq, sk = pick(1, 17, 113, 255, 300), pick(1, 17, 129, 255, 320)
    causal, deterministic = pick(None, "top_left", "bottom_right"), pick(False, True)
    q, k, v, dout = _randn(gen, b, hq, sq, d), _randn(gen, b, hkv, sk, d), _randn(gen, b, hkv, sk, d), \
        _randn(gen, b, hq, sq, d)
    sink = 4 * torch.randn(hq, device="cuda", generator=gen)
    repro = _repro("test_dsink_across_random_configurations", case=case, seed=seed, d=d, b=b, hq=hq, hkv=hkv, sq=sq,
                   sk=sk, causal=causal, deterministic=deterministic)
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, sink=sink)
    *grads, dsink = flashkiln.attention_backward(dout, q, k, v, out, lse, causal=causal, sink=sink, sink_grad=True,
                                                 deterministic=deterministic)
    ref32, reflp = _references(q, k, v, dout, causal, None, None, sink)
    check_grads_against((*grads, dsink), ref32, reflp, repro)


@pytest.mark.parametrize("with_sink", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("shape", [(1, 4, 255, 1), (2, 1, 1, 1), (255, 1)])
def test_a_bias_constant_along_keys_has_its_exact_gradient(shape, with_sink):
    """Without a sink its gradient is exactly 0 (a row's dS sums to 0); with one, the rule holds."""
    seed = seed_of("key-constant", shape, with_sink)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = _randn(gen, 2, 4, 255, 128), _randn(gen, 2, 4, 300, 128), _randn(gen, 2, 4, 300, 128), \
        _randn(gen, 2, 4, 255, 128)
    bias = _randn(gen, *shape, scale=3.0)
    sink = torch.randn(4, device="cuda", generator=gen) if with_sink else None
    out, lse = flashkiln.attention_forward(q, k, v, causal="top_left", bias=bias, sink=sink)
    grads = flashkiln.attention_backward(dout, q, k, v, out, lse, causal="top_left", bias=bias, bias_grad=True,
                                         sink=sink, sink_grad=with_sink)
    if not with_sink:
        assert not grads[3].any(), "dBias of a key-constant bias is exactly 0 without a sink"
    ref32, reflp = _references(q, k, v, dout, "top_left", None, bias, sink)
    check_grads_against(grads, ref32, reflp, _repro("test_a_bias_constant_along_keys_has_its_exact_gradient",
                                                    seed=seed, shape=shape, with_sink=with_sink))


# -- 3. The LSE's gradient ---------------------------------------------------------------------------

@pytest.mark.parametrize("with_sink", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(129, 200), (300, 113)])
def test_the_lse_gradient_through_the_custom_op(sq, sk, causal, with_sink):
    seed = seed_of("dlse", sq, sk, causal, with_sink)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = _randn(gen, 2, 6, sq, 64), _randn(gen, 2, 2, sk, 64), _randn(gen, 2, 2, sk, 64), \
        _randn(gen, 2, 6, sq, 64)
    dlse = torch.randn(2, 6, sq, device="cuda", generator=gen)
    sink = torch.linspace(-1.0, 2.0, 6, device="cuda") if with_sink else None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sink is None else sink.detach().requires_grad_()
    out, lse = torch.ops.flashkiln.attention_forward(*leaves, None, sink_leaf, causal or "none", 0.125, None)
    torch.autograd.backward([out, lse], [dout, dlse])
    got = [t.grad for t in leaves] + ([] if sink is None else [sink_leaf.grad])
    ref32, reflp = _references(q, k, v, dout, causal, 0.125, None, sink, dlse)
    check_grads_against(got, ref32, reflp, _repro("test_the_lse_gradient_through_the_custom_op", seed=seed, sq=sq,
                                                  sk=sk, causal=causal, with_sink=with_sink))
    # The LSE alone: dq, dk from dLSE only (dO = 0), and no dv.
    for t in leaves:
        t.grad = None
    out, lse = torch.ops.flashkiln.attention_forward(*leaves, None, sink_leaf, causal or "none", 0.125, None)
    lse.backward(dlse)
    ref32, reflp = _references(q, k, v, torch.zeros_like(dout), causal, 0.125, None, sink, dlse)
    assert not leaves[2].grad.any()
    check_grads_against([t.grad for t in leaves], ref32, reflp, "lse only: " + repro_line(
        "test_gradients_gpu.py", "test_the_lse_gradient_through_the_custom_op", seed=seed))


def test_the_lse_gradient_of_a_packed_batch():
    seed = seed_of("dlse-packed")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [(5, 9), (0, 4), (130, 70), (17, 0)]
    total_q, total_k = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q, k, v, dout = _randn(gen, total_q, 4, 64), _randn(gen, total_k, 2, 64), _randn(gen, total_k, 2, 64), \
        _randn(gen, total_q, 4, 64)
    dlse = torch.randn(4, total_q, device="cuda", generator=gen)
    cu_q = torch.tensor([0] + list(itertools.accumulate(a for a, _ in lengths)), device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(b for _, b in lengths)), device="cuda", dtype=torch.int32)
    packed = flashkiln.PackedBatch(cu_q, cu_k, 130, 70)
    out, lse = flashkiln.attention_forward(q, k, v, causal="bottom_right", packed=packed)
    dq, dk, dv = flashkiln.attention_backward(dout, q, k, v, out, lse, dlse=dlse, causal="bottom_right",
                                              packed=packed)
    for i, (lq, lk) in enumerate(lengths):
        sq0, sk0 = int(cu_q[i]), int(cu_k[i])
        part = lambda t, s0, n: t[s0:s0 + n].transpose(0, 1)[None]  # noqa: E731
        args = (part(q, sq0, lq), part(k, sk0, lk), part(v, sk0, lk), part(dout, sq0, lq), "bottom_right")
        row_dlse = dlse[:, sq0:sq0 + lq][None]
        ref32, reflp = (attention_grad_reference(*args, None, dtype, dlse=row_dlse) for dtype in (torch.float32, BF16))
        check_grads_against((part(dq, sq0, lq), part(dk, sk0, lk), part(dv, sk0, lk)), ref32, reflp,
                            _repro("test_the_lse_gradient_of_a_packed_batch", seed=seed, sequence=i))


def test_dlse_must_have_the_lse_shape_and_dtype():
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=BF16)
    out, lse = flashkiln.attention_forward(q, q, q)
    for bad in (lse.half(), lse[..., :8], "x"):
        with pytest.raises(flashkiln.InvalidInputError, match="dlse must be a float32 tensor"):
            flashkiln.attention_backward(out, q, q, q, out, lse, dlse=bad)


# -- 6. Head dims that were not generated ------------------------------------------------------------

HEAD_DIM_CASES = [(16, 16), (32, 32), (59, 59), (100, 64), (192, 192), (72, 200)]


@pytest.mark.parametrize("backend", [None, "portable"])
@pytest.mark.parametrize("dims", HEAD_DIM_CASES, ids=lambda d: f"d{d[0]}x{d[1]}")
def test_head_dims_that_were_not_generated_are_exact(dims, backend):
    d_qk, d_v = dims
    seed = seed_of("padded-head-dims", dims, backend)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = _randn(gen, 2, 77, 6, d_qk).transpose(1, 2)  # (B, S, H, D) storage
    k, v = _randn(gen, 2, 2, 90, d_qk), _randn(gen, 2, 2, 90, d_v)
    dout = _randn(gen, 2, 6, 77, d_v)
    sink = torch.linspace(-1.0, 1.0, 6, device="cuda")
    repro = _repro("test_head_dims_that_were_not_generated_are_exact", seed=seed, dims=dims, backend=backend)
    out = torch.full((2, 6, 77, d_v), float("nan"), device="cuda", dtype=BF16)
    got_out, lse = flashkiln.attention_forward(q, k, v, causal="bottom_right", sink=sink, out=out, backend=backend)
    assert got_out is out
    ref32 = attention_reference(q, k, v, "bottom_right", None, torch.float32, sink=sink)
    reflp = attention_reference(q, k, v, "bottom_right", None, BF16, sink=sink)
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, repro)
    fresh, _ = flashkiln.attention_forward(q, k, v, causal="bottom_right", sink=sink, backend=backend)
    assert torch.equal(fresh, out) and fresh.stride(1) < fresh.stride(2), "O in q's memory order"
    grads = flashkiln.attention_backward(dout, q, k, v, out, lse, causal="bottom_right", sink=sink, sink_grad=True)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    check_grads_against(grads, *_references(q, k, v, dout, "bottom_right", None, None, sink), repro)


def test_an_odd_head_dim_trains_through_sdpa():
    seed = seed_of("padded-sdpa")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (_randn(gen, 2, 4, 65, 59) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    flashkiln.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
    check_grads_against([t.grad for t in leaves], *_references(q, k, v, dout, "top_left"),
                        _repro("test_an_odd_head_dim_trains_through_sdpa", seed=seed))


# -- 4. Output buffers that overlap or alias ---------------------------------------------------------

def test_output_buffers_that_overlap_or_alias_an_input_are_refused():
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=BF16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    with pytest.raises(flashkiln.InvalidInputError, match="out has overlapping elements"):
        zero_stride = torch.empty(1, 2, 1, 64, device="cuda", dtype=BF16).expand(1, 2, 64, 64)
        flashkiln.attention_forward(q, k, v, out=zero_stride)
    with pytest.raises(flashkiln.InvalidInputError, match="out shares memory with q"):
        flashkiln.attention_forward(q, k, v, out=q)
    with pytest.raises(flashkiln.InvalidInputError, match="out shares memory with lse"):
        storage = torch.empty(1 * 2 * 64 * 64, device="cuda", dtype=BF16)
        flashkiln.attention_forward(q, k, v, out=storage.view(1, 2, 64, 64), lse=storage.view(torch.float32)[:128]
                                    .view(1, 2, 64))
    out, lse = flashkiln.attention_forward(q, k, v)
    dout = torch.randn_like(out)
    for name, buffer, match in (("dq", dout, "dq shares memory with dout"), ("dk", k, "dk shares memory with k"),
                                ("dv", torch.empty(1, 2, 64, 64, device="cuda", dtype=BF16)[:, :1].expand(1, 2, 64, 64),
                                 "dv has overlapping elements")):
        with pytest.raises(flashkiln.InvalidInputError, match=match):
            flashkiln.attention_backward(dout, q, k, v, out, lse, **{name: buffer})
    dq = torch.empty_like(q)
    with pytest.raises(flashkiln.InvalidInputError, match="dk shares memory with dq"):
        flashkiln.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dq)


# -- 4. Packed tokens in no sequence, and the route variable on an empty batch ------------------------

@pytest.mark.parametrize("lengths", [[(3, 5), (0, 0), (9, 2)], [(0, 0), (0, 3)], [(0, 0)]],
                         ids=["some", "no-queries", "all-empty"])
def test_packed_tokens_in_no_sequence_get_zeros_in_given_buffers(lengths):
    seed = seed_of("packed-outside", lengths)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    before, after = 2, 3  # tokens in no sequence, before the first and after the last
    total_q = before + sum(a for a, _ in lengths) + after
    total_k = before + sum(b for _, b in lengths) + after
    q, dout = _randn(gen, total_q, 4, 64), _randn(gen, total_q, 4, 64)
    k, v = _randn(gen, total_k, 4, 64), _randn(gen, total_k, 4, 64)
    cu_q = torch.tensor([before + x for x in itertools.accumulate([0] + [a for a, _ in lengths])], device="cuda",
                        dtype=torch.int32)
    cu_k = torch.tensor([before + x for x in itertools.accumulate([0] + [b for _, b in lengths])], device="cuda",
                        dtype=torch.int32)
    packed = flashkiln.PackedBatch(cu_q, cu_k, max(a for a, _ in lengths), max(b for _, b in lengths))
    nan = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    out, lse = nan(q), torch.full((4, total_q), float("nan"), device="cuda")
    flashkiln.attention_forward(q, k[:, :2], v[:, :2], causal="bottom_right", packed=packed, out=out, lse=lse)
    outside_q = torch.ones(total_q, dtype=torch.bool, device="cuda")
    outside_q[int(cu_q[0]):int(cu_q[-1])] = False
    outside_k = torch.ones(total_k, dtype=torch.bool, device="cuda")
    outside_k[int(cu_k[0]):int(cu_k[-1])] = False
    assert (out[outside_q] == 0).all() and torch.isneginf(lse[:, outside_q]).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for hkv in (2, 4):  # GQA and not: dk, dv come from the host's group sum or from the kernel
        kk, vv = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
        out, lse = flashkiln.attention_forward(q, kk, vv, causal="bottom_right", packed=packed)
        dq, dk, dv = nan(q), nan(kk), nan(vv)
        flashkiln.attention_backward(dout, q, kk, vv, out, lse, causal="bottom_right", packed=packed, dq=dq, dk=dk,
                                     dv=dv)
        assert not any(torch.isnan(g).any() for g in (dq, dk, dv)), f"hkv {hkv}: unwritten gradient rows"
        assert (dq[outside_q] == 0).all() and (dk[outside_k] == 0).all() and (dv[outside_k] == 0).all()


def test_the_route_variable_is_checked_on_an_all_empty_packed_batch(monkeypatch):
    q = torch.randn(4, 2, 64, device="cuda", dtype=BF16)
    empty = torch.zeros(3, device="cuda", dtype=torch.int32)
    packed = flashkiln.PackedBatch(empty, empty, 0, 0)
    out, lse = flashkiln.attention_forward(q, q, q, packed=packed)
    monkeypatch.setenv(ROUTE_ENV, "atomic")
    with pytest.raises(flashkiln.InvalidInputError, match="is not deterministic"):
        flashkiln.attention_backward(out, q, q, q, out, lse, packed=packed, deterministic=True)


def test_a_second_derivative_raises_instead_of_being_dropped():
    """The backward op has no derivative of its own: asking for one is an error, never zeros."""
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=BF16, requires_grad=True)
    out = flashkiln.scaled_dot_product_attention(q, q, q)
    (dq,) = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        dq.float().sum().backward()


class _RawCalls(torch.autograd.Function):
    """The raw functions in a user's autograd.Function, as a ring-attention implementation wraps them."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = flashkiln.attention_forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return flashkiln.attention_backward(dout, q, k, v, out, lse, deterministic=True)


def test_launches_from_threads_torch_bound_no_cuda_context_to():
    """autograd runs a backward on its device thread, and torch binds no CUDA context to a thread
    whose device is already current: a raw call there must still launch (not CUDA_ERROR_INVALID_CONTEXT)."""
    q, k, v, dout = (torch.randn(1, 2, 128, 64, device="cuda", dtype=BF16) for _ in range(4))
    out, lse = flashkiln.attention_forward(q, k, v)
    expected = flashkiln.attention_backward(dout, q, k, v, out, lse, deterministic=True)
    results = {}

    def work():
        try:
            results["grads"] = flashkiln.attention_backward(dout, q, k, v, out, lse, deterministic=True)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 (reported below, on the test's thread)
            results["error"] = exc

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert "error" not in results, repr(results.get("error"))
    assert all(torch.equal(a, b) for a, b in zip(results["grads"], expected))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    _RawCalls.apply(*leaves).backward(dout)
    assert all(torch.equal(t.grad, g) for t, g in zip(leaves, expected))
