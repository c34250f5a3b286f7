"""The portable tiles of the archs out of reach (sm_80, sm_86 / sm_120), built for sm_90a by
tools/arch_tiles.py, run on the H200: forward and every dq route of the backward against the fp32
reference (FA-style(2) for O and LSE, (3) for gradients), every head dim and causal mode, GQA,
tails and S_q != S_k, with a bias and dBias; gradients into NaN-poisoned buffers with canaries.

The kernels come from $FLASHKILN_ARCH_TILES_DIR (default build/arch-tiles), one <arch>/kernels
directory per tiling; without them the tests skip, unless that variable is set (then they fail).
"""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest
import torch

import flashkiln
from flashkiln.registry import KernelRegistry
from reference import (attention_grad_reference, attention_reference, check_grads_against, fa_style_check,
                       repro_line, seed_of)
from test_backward_gpu import _forced_route, _poisoned_like

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_arch_tiles_gpu.py")

DIR_ENV = "FLASHKILN_ARCH_TILES_DIR"
ROOT = Path(os.environ.get(DIR_ENV, Path(__file__).resolve().parent.parent / "build" / "arch-tiles"))
TILINGS = sorted(p.parent.parent.name for p in ROOT.glob("*/kernels/manifest.json"))
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
SHAPES = [(113, 129), (129, 113), (1, 17), (300, 300)]


@pytest.fixture(params=TILINGS or [None], ids=TILINGS or ["none-built"])
def registry(request) -> KernelRegistry:
    if request.param is None:
        if DIR_ENV in os.environ:
            pytest.fail(f"${DIR_ENV}={ROOT} holds no <arch>/kernels/manifest.json: run tools/arch_tiles.py")
        pytest.skip(f"no arch tiles under {ROOT}: run tools/arch_tiles.py --out {ROOT}")
    return KernelRegistry(ROOT / request.param / "kernels")


def _tensors(seed: int, sq: int, sk: int, dims: tuple[int, int]):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 6, sq, dims[0], device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 2, sk, dims[0], device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 2, sk, dims[1], device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(2, 6, sq, dims[1], device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, dout


def _backward(registry, dout, q, k, v, out, lse, causal, route, bias=None):
    storages, buffers = zip(*(_poisoned_like(t) for t in (q, k, v)))
    with _forced_route(route):
        grads = flashkiln.attention_backward(dout, q, k, v, out, lse, causal=causal, bias=bias,
                                             bias_grad=bias is not None, deterministic=route != "atomic",
                                             dq=buffers[0], dk=buffers[1], dv=buffers[2], registry=registry,
                                             backend="portable")
    torch.cuda.synchronize()
    for storage in storages:
        assert torch.isnan(storage[:, :, 0]).all() and torch.isnan(storage[:, :, -1]).all(), "canary overwritten"
    return grads


@pytest.mark.parametrize("route", ["atomic", "ordered", "workspace"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"d{a}x{b}" if a != b else f"d{a}" for a, b in HEAD_DIMS])
@pytest.mark.parametrize("sq, sk", SHAPES)
def test_forward_and_backward(registry, sq, sk, dims, causal, route):
    seed = seed_of("arch-tiles", registry.directory.parent.name, sq, sk, dims, causal, route)
    q, k, v, dout = _tensors(seed, sq, sk, dims)
    repro = _repro("test_forward_and_backward", seed=seed, tiling=registry.directory.parent.name, sq=sq, sk=sk,
                   dims=dims, causal=causal, route=route)
    out = torch.full((2, 6, sq, dims[1]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((2, 6, sq), float("nan"), device="cuda")
    flashkiln.attention_forward(q, k, v, causal=causal, out=out, lse=lse, registry=registry, backend="portable")
    ref32 = attention_reference(q, k, v, causal, None, torch.float32)
    reflp = attention_reference(q, k, v, causal, None, q.dtype)
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, repro)
    grads = _backward(registry, dout, q, k, v, out, lse, causal, route)
    check_grads_against(grads, attention_grad_reference(q, k, v, dout, causal, None, torch.float32),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype), repro)


@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=[f"d{a}x{b}" if a != b else f"d{a}" for a, b in HEAD_DIMS])
def test_bias_and_dbias(registry, dims, causal):
    """A full (B, H, S_q, S_k) bias: the forward's bias tile and dBias from the dS workspace."""
    sq, sk = 113, 129
    seed = seed_of("arch-tiles-bias", registry.directory.parent.name, dims, causal)
    q, k, v, dout = _tensors(seed, sq, sk, dims)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    bias = torch.randn(2, 6, sq, sk, device="cuda", dtype=q.dtype, generator=gen)
    repro = _repro("test_bias_and_dbias", seed=seed, tiling=registry.directory.parent.name, dims=dims, causal=causal)
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, bias=bias, registry=registry, backend="portable")
    ref32 = attention_reference(q, k, v, causal, None, torch.float32, bias=bias)
    reflp = attention_reference(q, k, v, causal, None, q.dtype, bias=bias)
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    grads = _backward(registry, dout, q, k, v, out, lse, causal, "workspace", bias=bias)
    check_grads_against(grads, attention_grad_reference(q, k, v, dout, causal, None, torch.float32, bias),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype, bias), repro)
