"""The additive bias on the CPU: checks, the layout the kernels read, dBias from workspace tiles,
and the backward's kernel and route choice with a bias."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import flashkiln
from flashkiln import launch
from flashkiln.bias import (COLUMNS, STORE, SUM, bias_gradient, ds_row_elements, empty_bias_gradient, prepare_bias,
                            reduction, sum_shape)
from flashkiln.dq_routes import ROUTE_ENV, WORKSPACE_BUDGET_ENV
from test_backward_api import CAUSAL, H200_MEMORY, bwd_descriptor, make_registry, tensors
from test_registry import planned_backward


def q_like(b=2, hq=4, sq=100, d=64):
    return torch.randn(b, hq, sq, d, dtype=torch.bfloat16)


@pytest.mark.parametrize("shape,broadcast", [
    ((2, 4, 100, 64), ()), ((1, 4, 100, 64), (0,)), ((2, 1, 100, 64), (1,)), ((100, 64), (0, 1)),
    ((2, 1, 1, 64), (1, 2)), ((4, 100, 64), (0,)),
])
def test_broadcast_dims_become_zero_strides_without_copies(shape, broadcast):
    bias = torch.randn(shape, dtype=torch.bfloat16)
    kb = prepare_bias(bias, (2, 4, 100, 64), q_like())
    assert kb.tensor.shape == (2, 4, 100, 64) and kb.broadcast_dims == broadcast and kb.shape == shape
    assert kb.tensor.data_ptr() == bias.data_ptr()  # read in place
    assert all(kb.tensor.stride(d) == 0 for d in broadcast if d < 3) and kb.tensor.stride(3) == 1
    assert torch.equal(kb.tensor, bias.expand(2, 4, 100, 64))


def test_rows_that_are_not_whole_16_byte_pieces_are_padded():
    bias = torch.randn(2, 4, 100, 61, dtype=torch.bfloat16)
    kb = prepare_bias(bias, (2, 4, 100, 61), q_like())
    assert kb.tensor.stride(2) == 64 and torch.equal(kb.tensor, bias)
    # A bias broadcast over keys is a per-row constant, materialized (and summed in dBias).
    kb = prepare_bias(torch.randn(1, 1, 100, 1, dtype=torch.bfloat16), (2, 4, 100, 64), q_like())
    assert kb.tensor.stride(3) == 1 and kb.broadcast_dims == (0, 1, 3)


def test_a_boolean_mask_becomes_zero_or_minus_infinity():
    mask = torch.rand(100, 64) < 0.5
    kb = prepare_bias(mask, (2, 4, 100, 64), q_like())
    assert kb.tensor.dtype == torch.bfloat16
    assert torch.equal(torch.isneginf(kb.tensor[0, 0]), ~mask) and (kb.tensor[0, 0][mask] == 0).all()


@pytest.mark.parametrize("bias,match", [
    (torch.randn(100, 64), "must be torch.bfloat16"),
    (torch.randn(3, 4, 100, 64, dtype=torch.bfloat16), "does not broadcast"),
    (torch.randn(100, 65, dtype=torch.bfloat16), "does not broadcast"),
    (torch.randn(1, 2, 4, 100, 64, dtype=torch.bfloat16), "does not broadcast"),
    ("mask", "torch.Tensor or None"),
])
def test_bad_biases_are_typed_errors_before_any_launch(bias, match):
    q = q_like()
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.attention_forward(q, q, q, bias=bias)


def test_dbias_is_the_dense_workspace_or_its_sum_over_broadcast_dims():
    b, h, sq, sk = 2, 3, 70, 150
    ds = torch.randn(b, h, sq, sk).to(torch.bfloat16)
    # dS as the kernels lay it out: dense rows padded to whole 16-byte pieces (150 -> 152); the
    # padding holds NaN here, which must not leak into dBias.
    rows = torch.full((b, h, sq, ds_row_elements(sk)), float("nan"), dtype=torch.bfloat16)
    rows[..., :sk] = ds
    scratch = {STORE: rows.view(-1)}
    q = torch.empty(b, h, sq, 64, dtype=torch.bfloat16)
    for shape, dims in (((b, h, sq, sk), ()), ((1, h, sq, sk), (0,)), ((sq, sk), (0, 1)), ((b, 1, 1, sk), (1, 2))):
        bias = torch.zeros(shape, dtype=torch.bfloat16)
        got = bias_gradient(scratch, prepare_bias(bias, (*q.shape[:3], sk), q))
        expected = ds.float().sum(dims, keepdim=True).to(torch.bfloat16) if dims else ds
        assert got.shape == shape and torch.equal(got, expected.reshape(shape))
        # The custom op's fake gives the same strides, and a full bias's gradient is a view.
        assert empty_bias_gradient(bias, (*q.shape[:3], sk), q).stride() == got.stride()
    full = prepare_bias(torch.zeros(b, h, sq, sk, dtype=torch.bfloat16), (b, h, sq, sk), q)
    assert bias_gradient(scratch, full).data_ptr() == scratch[STORE].data_ptr()


@pytest.mark.parametrize("shape, packed, expected", [
    ((2, 3, 70, 150), False, STORE), ((2, 3, 70, 150), True, STORE),     # full: dS is dBias
    ((1, 3, 70, 150), False, SUM), ((70, 150), False, SUM),             # shared by batch entries or heads
    ((2, 1, 70, 150), True, SUM),                                       # heads of one sequence take turns
    ((1, 3, 70, 150), True, STORE), ((70, 150), True, STORE),           # sequences visit different tiles
    ((2, 3, 1, 150), False, COLUMNS), ((150,), True, COLUMNS),          # broadcast over the rows
])
def test_the_hopper_kernel_reduces_a_broadcast_bias_itself(shape, packed, expected):
    q = torch.empty(2, 3, 70, 64, dtype=torch.bfloat16)
    assert reduction(prepare_bias(torch.zeros(shape, dtype=torch.bfloat16), (2, 3, 70, 150), q), packed) == expected


def test_dbias_from_the_kernels_reductions():
    """What the hopper kernel leaves for COLUMNS (each (batch, head)'s sums over the rows) and SUM
    (the fp32 sum in the bias's own shape, rows in 8-element pieces) becomes dBias in the bias's
    shape, summed over what the kernel left broadcast, NaN padding left out."""
    b, h, sq, sk = 2, 3, 70, 150
    ds = torch.randn(b, h, sq, sk, generator=torch.Generator().manual_seed(0))
    q = torch.empty(b, h, sq, 64, dtype=torch.bfloat16)
    columns = ds.sum(2)  # the kernel's part; then torch sums the rest (the same order here)
    for shape, dims in (((b, h, 1, sk), ()), ((1, h, 1, sk), (0,)), ((sk,), (0, 1))):
        kb = prepare_bias(torch.zeros(shape, dtype=torch.bfloat16), (b, h, sq, sk), q)
        got = bias_gradient({COLUMNS: columns}, kb)
        expected = columns[:, :, None].sum(dims, keepdim=True) if dims else columns[:, :, None]
        assert got.shape == shape and torch.equal(got, expected.to(torch.bfloat16).reshape(shape))
        exact = ds.sum((*dims, 2), keepdim=True).reshape(shape)
        torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2)
    for shape, dims in (((1, h, sq, sk), (0,)), ((b, 1, sq, sk), (1,)), ((sq, sk), (0, 1))):
        kb = prepare_bias(torch.zeros(shape, dtype=torch.bfloat16), (b, h, sq, sk), q)
        total = torch.full(sum_shape(kb), float("nan"))
        assert total.shape[-1] == ds_row_elements(sk)
        total[..., :sk] = ds.sum(dims, keepdim=True)
        got = bias_gradient({SUM: total}, kb)
        assert got.shape == shape and torch.equal(got, ds.sum(dims, keepdim=True).to(torch.bfloat16).reshape(shape))


@pytest.fixture
def registry(tmp_path):
    ds = [bwd_descriptor("bwd_dq", c) for c in CAUSAL] + [bwd_descriptor("bwd", c, True, bias="additive") for c in CAUSAL]
    return make_registry(tmp_path, ds, dims=(128,))


def plan(registry, causal="none", bias_grad=True, deterministic=False, bias_shape=(1, 4, 100, 300)):
    dout, q, k, v, out, lse = tensors()
    kb = prepare_bias(torch.randn(bias_shape, dtype=torch.bfloat16), (*q.shape[:3], 300), q)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    return planned_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, 0.125, deterministic, (9, 0), H200_MEMORY,
                         registry, kb, bias_grad)


@pytest.mark.parametrize("causal, window", [("top_left", None), ("none", (16, 16))])
def test_the_dbias_workspace_starts_zeroed_where_tiles_go_unvisited(tmp_path, monkeypatch, causal, window):
    """A causal mask or a window leaves tiles that no key tile visits, which dBias still reads: the
    workspace is allocated zeroed then (scratch made any other way comes back NaN here)."""
    monkeypatch.delenv(ROUTE_ENV, raising=False)
    monkeypatch.setattr(launch, "allocate", lambda spec, device: (torch.zeros if spec.zeroed else nan_filled)(
        spec.shape, dtype=spec.dtype))
    kernels = [bwd_descriptor("bwd_dq", c) for c in CAUSAL]
    kernels += [bwd_descriptor("bwd", c, True, bias="additive") for c in CAUSAL]
    registry = make_registry(tmp_path, kernels + [dataclasses.replace(d, window=True) for d in kernels])
    dout, q, k, v, out, lse = tensors()
    kb = prepare_bias(torch.randn(1, 4, 100, 300, dtype=torch.bfloat16), (*q.shape[:3], 300), q)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    p = planned_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, 0.125, False, (9, 0), H200_MEMORY, registry, kb,
                         True, window=window)
    assert p.route == "workspace"
    assert torch.equal(p.scratch["ds_workspace"], torch.zeros_like(p.scratch["ds_workspace"]))


def nan_filled(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def test_a_biased_backward_runs_the_deterministic_bias_kernel_on_the_workspace_route(registry, monkeypatch):
    monkeypatch.delenv(ROUTE_ENV, raising=False)
    monkeypatch.setenv(WORKSPACE_BUDGET_ENV, "0")  # dBias needs the workspace whatever the budget
    p = plan(registry, causal="top_left")
    main = p.launches[1]
    assert p.route == "workspace" and main.entry.descriptor["bias"] == "additive"
    assert main.entry.descriptor["deterministic"] is True
    # S_k = 300 rows padded to whole 16-byte pieces (304); batch broadcast as a zero stride.
    assert main.params.bias != 0 and main.params.bias_head_stride == 100 * 304 and main.params.bias_batch_stride == 0
    workspace = p.scratch["ds_workspace"]
    assert not workspace.any(), "tiles no key tile visits are read by dBias: zeroed under a causal mask"
    # Without dBias, beyond the budget: the ordered route, still the deterministic bias kernel.
    p = plan(registry, bias_grad=False)
    assert p.route == "ordered" and p.launches[1].entry.descriptor["bias"] == "additive"


def test_a_forced_route_that_cannot_give_dbias_is_refused(registry, monkeypatch):
    monkeypatch.setenv(ROUTE_ENV, "ordered")
    with pytest.raises(flashkiln.UnsupportedError, match="dBias"):
        plan(registry)


def test_sdpa_turns_a_boolean_mask_into_its_bias_once(monkeypatch):
    """The ops (forward and, through autograd, backward) receive the additive bias, so the mask is
    not converted again in each pass."""
    from flashkiln import ops

    seen = []
    monkeypatch.setattr(ops, "_attention", lambda q, k, v, bias, *rest: seen.append(bias) or (q, None))
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    mask = torch.rand(8, 8) < 0.5
    ops.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    (bias,) = seen
    assert bias.dtype == torch.bfloat16 and torch.equal(torch.isneginf(bias), ~mask)


def _exact_key_constant_case(seed: int, bias_shape, with_sink: bool, with_dlse: bool, sk: int = 5):
    """fp64 on the CPU: q, k, v, dO, a key-constant bias, a sink and dLSE; the autograd dBias and the
    per-row quantities key_constant_gradient takes, each computed from its definition."""
    gen = torch.Generator().manual_seed(seed)
    b, h, sq, d = 2, 3, 7, 8
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, dout = randn(b, h, sq, d), randn(b, h, sk, d), randn(b, h, sk, d), randn(b, h, sq, d)
    bias = (3 * randn(*bias_shape)).requires_grad_()
    sink = randn(h) if with_sink else None
    dlse = randn(b, h, sq) if with_dlse else None
    scores = q @ k.transpose(-1, -2) / d**0.5 + bias
    scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))  # causal (top left)
    full = scores if sink is None else torch.cat([scores, sink[None, :, None, None].expand(b, h, sq, 1)], -1)
    lse = torch.logsumexp(full, -1)
    probs = torch.exp(scores - lse[..., None])
    out = probs @ v
    loss = (out * dout).sum() + (0 if dlse is None else (lse * dlse).sum())
    loss.backward()
    dp = dout @ v.transpose(-1, -2)
    delta = (probs * dp).sum(-1)  # = rowsum(dO * O)
    kernel_delta = delta - (0 if dlse is None else dlse)
    parts = None
    if sink is not None:
        p_sink = torch.exp(sink[None, :, None] - lse)
        parts = (p_sink * delta).sum(-1, keepdim=True)  # one "key tile"
    detached = (t if t is None else t.detach() for t in (lse, kernel_delta, dlse, sink, parts))
    return (bias, *detached)


@pytest.mark.parametrize("bias_shape", [(1, 1, 1, 1), (2, 3, 7, 1), (1, 3, 1, 1), (2, 1, 7, 1), (7, 1), (1,)])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_a_key_constant_bias_gradient_is_its_closed_form(bias_shape, with_sink, with_dlse):
    from flashkiln.bias import key_constant_gradient

    bias, lse, delta, dlse, sink, parts = _exact_key_constant_case(7, bias_shape, with_sink, with_dlse)
    kb = prepare_bias(bias.detach(), (2, 3, 7, 5), torch.empty(2, 3, 7, 8, dtype=torch.float64))
    assert kb.key_constant
    got = key_constant_gradient(kb, lse, delta, dlse, sink, parts, None)
    assert got.shape == bias.shape
    assert torch.allclose(got, bias.grad, rtol=1e-9, atol=1e-12), (got - bias.grad).abs().max()


def test_a_key_constant_bias_gradient_needs_no_ds_workspace(registry, monkeypatch):
    """Its closed form (bias.key_constant_gradient) replaces the dS tiles: the route is the one of a
    backward without dBias."""
    monkeypatch.delenv(ROUTE_ENV, raising=False)
    monkeypatch.setenv(WORKSPACE_BUDGET_ENV, "0")
    for shape, route in (((1, 4, 100, 1), "ordered"), ((1, 1, 1, 1), "ordered"), ((1, 4, 100, 300), "workspace")):
        p = plan(registry, bias_shape=shape)
        assert p.route == route, shape
        assert (p.scratch["ds_workspace"] is None) == (route != "workspace")
