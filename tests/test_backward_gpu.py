"""Attention backward on the GPU: dq, dk, dv against the fp32 reference (FA-style(3)), determinism.

Each dq route is run by name ("atomic", and the deterministic "ordered" and "workspace"), forced
through $FLASHKILN_BACKWARD_ROUTE and checked in the route log. Auto takes the hopper family
where it has the call (its atomic and ordered routes); the portable family's ordered route is
also forced by `backend=` where auto would not take it.

Gradients are written into NaN-poisoned buffers with NaN canaries around them; inputs are fresh
random tensors from a printed seed.
"""
from __future__ import annotations

import contextlib
from functools import partial
from unittest import mock

import pytest
import torch

import flashkiln
from flashkiln.dq_routes import DETERMINISTIC_ROUTES, ROUTE_ENV, ROUTES
from backward_log import backward_plans
from reference import attention_grad_reference, check_grads_against, repro_line, seed_of

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_backward_gpu.py")

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
CAUSAL = (None, "top_left", "bottom_right")
SEQLENS = [(1, 1), (17, 17), (113, 113), (128, 128), (129, 129), (1023, 1023), (4224, 4224),
           (1, 4224), (4224, 1), (17, 129), (129, 17), (113, 1023), (1023, 113)]


def _tensors(seed: int, b: int, hq: int, hkv: int, sq: int, sk: int, dqk: int, dv: int, dtype: torch.dtype,
             layout: str = "bhsd"):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(h: int, s: int, d: int) -> torch.Tensor:
        if layout == "bshd":
            return torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen)

    return make(hq, sq, dqk), make(hkv, sk, dqk), make(hkv, sk, dv), make(hq, sq, dv)


def _poisoned_like(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN buffer shaped like `t` (contiguous), inside storage with a NaN canary row on each side."""
    b, h, s, d = t.shape
    storage = torch.full((b, h, s + 2, d), float("nan"), device=t.device, dtype=t.dtype)
    return storage, storage[:, :, 1:-1]


@contextlib.contextmanager
def _forced_route(route: str):
    """Run the backward calls inside on `route`, and check that they took it."""
    with backward_plans() as plans, mock.patch.dict("os.environ", {ROUTE_ENV: route}):
        yield
    routes = [plan.route for plan in plans]
    assert routes and set(routes) == {route}, f"expected dq route {route}, took {routes}"


def _backward(dout, q, k, v, causal, scale=None, route="atomic", backend=None):
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, scale=scale)
    storages, buffers = zip(*(_poisoned_like(t) for t in (q, k, v)))
    with _forced_route(route):
        grads = flashkiln.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                             deterministic=route != "atomic", dq=buffers[0], dk=buffers[1],
                                             dv=buffers[2], backend=backend)
    torch.cuda.synchronize()
    for storage in storages:
        assert torch.isnan(storage[:, :, 0]).all() and torch.isnan(storage[:, :, -1]).all(), "canary overwritten"
    return grads


def _check_grads(dout, q, k, v, causal, repro: str, scale=None, route="atomic", backend=None) -> None:
    grads = _backward(dout, q, k, v, causal, scale, route, backend)
    check_grads_against(grads, attention_grad_reference(q, k, v, dout, causal, scale, torch.float32),
                        attention_grad_reference(q, k, v, dout, causal, scale, q.dtype), repro)


# Head dims with a hopper backward (all of them): auto takes it there, so the portable family's
# ordered route runs forced by backend= too.
HOPPER_DIMS = set(HEAD_DIMS)
ROUTE_CASES = [pytest.param(dims, route, backend, id=f"d{dims[0]}x{dims[1]}-{route}{'-portable' if backend else ''}")
               for dims in HEAD_DIMS for route in ROUTES
               for backend in ((None, "portable") if route == "ordered" and dims in HOPPER_DIMS else (None,))]


@pytest.mark.parametrize("dims,route,backend", ROUTE_CASES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_sweep_gqa_bf16(sq, sk, causal, dims, route, backend):
    """GQA 6/2, every S pair, head dims, causal mode and dq route."""
    seed = seed_of("bwd", sq, sk, causal, dims)
    q, k, v, dout = _tensors(seed, 2, 6, 2, sq, sk, *dims, torch.bfloat16)
    _check_grads(dout, q, k, v, causal, _repro("test_sweep_gqa_bf16", seed=seed, sq=sq, sk=sk, causal=causal,
                                                dims=dims, route=route, backend=backend), route=route, backend=backend)


@pytest.mark.parametrize("hq,hkv", [(6, 1), (6, 6)], ids=["mqa6-1", "mha6"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk", [(129, 129), (1023, 300), (300, 1023)])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"d{a}x{b}" for a, b in HEAD_DIMS])
def test_heads_and_fp16(dims, sq, sk, causal, hq, hkv):
    seed = seed_of("bwd-heads", dims, sq, sk, causal, hq, hkv)
    q, k, v, dout = _tensors(seed, 2, hq, hkv, sq, sk, *dims, torch.float16)
    _check_grads(dout, q, k, v, causal, _repro("test_heads_and_fp16", seed=seed, dims=dims, sq=sq, sk=sk,
                                                causal=causal, hq=hq, hkv=hkv))


@pytest.mark.parametrize("route,backend", [("ordered", None), ("ordered", "portable"), ("workspace", None)])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_deterministic_is_bitwise_reproducible(hq, hkv, causal, route, backend):
    """20 runs of the deterministic backward give identical dq, dk, dv (buffers re-poisoned each run)."""
    seed = seed_of("det", hq, hkv, causal)
    q, k, v, dout = _tensors(seed, 2, hq, hkv, 1000, 1100, 128, 128, torch.bfloat16)
    first = _backward(dout, q, k, v, causal, route=route, backend=backend)
    for _ in range(19):
        again = _backward(dout, q, k, v, causal, route=route, backend=backend)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs (seed {seed})"
    check_grads_against(first, attention_grad_reference(q, k, v, dout, causal, None, torch.float32),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype),
                        _repro("test_deterministic_is_bitwise_reproducible", seed=seed, hq=hq, hkv=hkv, causal=causal,
                               route=route, backend=backend))


@pytest.mark.parametrize("route", DETERMINISTIC_ROUTES)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"d{a}x{b}" for a, b in HEAD_DIMS])
def test_deterministic_every_head_dim(dims, route):
    seed = seed_of("det-dims", dims)
    q, k, v, dout = _tensors(seed, 1, 6, 2, 513, 700, *dims, torch.bfloat16)
    runs = [_backward(dout, q, k, v, "bottom_right", route=route) for _ in range(3)]
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    _check_grads(dout, q, k, v, "bottom_right", _repro("test_deterministic_every_head_dim", seed=seed, dims=dims,
                                                       route=route), route=route)


def test_deterministic_routes_agree_closely():
    """The portable family's two deterministic routes sum dq in different orders: equal within
    rounding, not bitwise."""
    q, k, v, dout = _tensors(seed_of("routes"), 2, 4, 4, 777, 900, 128, 128, torch.bfloat16)
    ordered, workspace = (_backward(dout, q, k, v, "top_left", route=r, backend="portable")
                          for r in DETERMINISTIC_ROUTES)
    torch.testing.assert_close(workspace[0], ordered[0], rtol=2e-2, atol=2e-2)
    assert all(torch.equal(a, b) for a, b in zip(ordered[1:], workspace[1:])), "dk and dv do not depend on the route"


def test_deterministic_default_follows_torch(caplog):
    q, k, v, dout = _tensors(seed_of("default"), 1, 2, 2, 256, 256, 64, 64, torch.bfloat16)
    out, lse = flashkiln.attention_forward(q, k, v)
    with caplog.at_level("DEBUG", logger="flashkiln"):
        flashkiln.attention_backward(dout, q, k, v, out, lse)
        assert "dq route atomic" in caplog.text
        caplog.clear()
        torch.use_deterministic_algorithms(True)
        try:
            flashkiln.attention_backward(dout, q, k, v, out, lse)
        finally:
            torch.use_deterministic_algorithms(False)
        assert "dq route ordered" in caplog.text  # the workspace route is opt-in (dq_routes)


@pytest.mark.parametrize("route", ROUTES)
def test_rows_without_keys_get_zero_dq(route):
    seed = seed_of("no-keys")
    q, k, v, dout = _tensors(seed, 1, 2, 2, 300, 100, 128, 128, torch.bfloat16)
    dq, dk, dv = _backward(dout, q, k, v, "bottom_right", route=route)
    assert (dq[:, :, :200] == 0).all()
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


def test_layouts_strides_and_custom_scale():
    """(B, S, H, D) inputs get (B, S, H, D)-strided gradients; a non-contiguous dout works."""
    seed = seed_of("layout")
    q, k, v, _ = _tensors(seed, 2, 4, 2, 333, 444, 128, 128, torch.bfloat16, layout="bshd")
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(2, 4, 128, 333, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(2, 3)
    assert not dout.is_contiguous()
    out, lse = flashkiln.attention_forward(q, k, v, causal="top_left", scale=0.2)
    dq, dk, dv = flashkiln.attention_backward(dout, q, k, v, out, lse, causal="top_left", scale=0.2)
    for grad, inp in ((dq, q), (dk, k), (dv, v)):
        assert grad.stride() == inp.stride()
    check_grads_against((dq, dk, dv), attention_grad_reference(q, k, v, dout, "top_left", 0.2, torch.float32),
                        attention_grad_reference(q, k, v, dout, "top_left", 0.2, q.dtype),
                        _repro("test_layouts_strides_and_custom_scale", seed=seed))
