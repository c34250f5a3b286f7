"""PyTorch integration on the GPU: custom ops (opcheck), autograd, torch.compile, CUDA graphs, SDPA drop-in."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import flashkiln
from reference import attention_grad_reference, attention_reference, check_grads_against, fa_style_check

pytestmark = pytest.mark.gpu


def _qkv(seed: int, b=2, hq=4, hkv=4, sq=257, sk=257, d=64, dtype=torch.bfloat16, requires_grad=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h, s: torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    tensors = make(hq, sq), make(hkv, sk), make(hkv, sk)
    return [t.requires_grad_(requires_grad) for t in tensors]


OPCHECK_SAMPLES = [  # (b, hq, hkv, sq, sk, d, causal, bias shape or None)
    (1, 2, 2, 64, 64, 64, "none", None),
    (2, 4, 2, 129, 300, 128, "top_left", (2, 4, 129, 300)),
    (1, 6, 1, 300, 129, 128, "bottom_right", None),
    (2, 2, 2, 17, 17, 256, "none", (1, 1, 17, 17)),
    (1, 3, 3, 200, 100, 96, "bottom_right", None),
    (1, 2, 1, 64, 256, 64, "top_left", (64, 256)),
]


def _sample(sample, requires_grad):
    b, hq, hkv, sq, sk, d, causal, bias_shape = sample
    seed = zlib.crc32(repr(sample).encode())
    q, k, v = _qkv(seed, b, hq, hkv, sq, sk, d, requires_grad=requires_grad)
    bias = None
    if bias_shape is not None:
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        bias = torch.randn(bias_shape, device="cuda", dtype=q.dtype, generator=gen).requires_grad_(requires_grad)
    return q, k, v, bias, causal, d**-0.5


def _sink(sample, q, requires_grad):
    """Sinks on every other sample."""
    if OPCHECK_SAMPLES.index(sample) % 2 == 0:
        return None
    return torch.linspace(-1, 2, q.shape[1], device="cuda").requires_grad_(requires_grad)


@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck_forward(sample):
    q, k, v, bias, causal, scale = _sample(sample, requires_grad=True)
    sink = _sink(sample, q, requires_grad=True)
    torch.library.opcheck(torch.ops.flashkiln.attention_forward.default, (q, k, v, bias, sink, causal, scale, None))


@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck_backward(sample):
    q, k, v, bias, causal, scale = _sample(sample, requires_grad=False)
    sink = _sink(sample, q, requires_grad=False)
    out, lse = torch.ops.flashkiln.attention_forward(q, k, v, bias, sink, causal, scale, None)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    for lse_grad in (None, dlse):
        torch.library.opcheck(torch.ops.flashkiln.attention_backward.default,
                              (dout, q, k, v, out, lse, lse_grad, bias, bias is not None, sink, sink is not None,
                               causal, scale, True))


def _loss_and_grads(fn, q, k, v, dout):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach().clone(), *(t.grad.clone() for t in (q, k, v))


def _sdpa(q, k, v):
    # Deterministic, so that runs can be compared bitwise.
    return flashkiln.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, deterministic=True)


def test_sdpa_matches_reference_with_gradients():
    q, k, v = _qkv(1, hq=6, hkv=2, sq=300, sk=300, d=128)
    dout = torch.randn(2, 6, 300, 128, device="cuda", dtype=torch.bfloat16)
    out, dq, dk, dv = _loss_and_grads(_sdpa, q, k, v, dout)
    ref32 = attention_reference(q.detach(), k.detach(), v.detach(), "top_left", None, torch.float32)
    reflp = attention_reference(q.detach(), k.detach(), v.detach(), "top_left", None, q.dtype)
    fa_style_check("out", out, ref32.out, reflp.out, 2, "sdpa seed 1")
    check_grads_against((dq, dk, dv), attention_grad_reference(q, k, v, dout, "top_left", None, torch.float32),
                        attention_grad_reference(q, k, v, dout, "top_left", None, q.dtype), "sdpa seed 1")


def test_sdpa_is_a_one_line_swap_for_torch():
    q, k, v = _qkv(2, sq=128, sk=128, d=64)
    ours = flashkiln.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
    theirs = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.1)
    assert ours.shape == theirs.shape and ours.dtype == q.dtype
    assert (ours.float() - theirs).abs().max() < 2e-2
    three_d = flashkiln.scaled_dot_product_attention(q[:, 0], k[:, 0], v[:, 0])
    assert three_d.shape == q[:, 0].shape


def test_torch_compile_fullgraph_forward_and_backward(deterministic_algorithms):
    """Compiled and eager, bitwise: in deterministic mode (dQ and GQA's dK and dV are otherwise
    added in any order)."""
    q, k, v = _qkv(3, hq=4, hkv=2, sq=500, sk=500, d=128)
    dout = torch.randn(2, 4, 500, 128, device="cuda", dtype=torch.bfloat16)
    eager = _loss_and_grads(_sdpa, q, k, v, dout)
    compiled_fn = torch.compile(_sdpa, fullgraph=True)
    compiled = _loss_and_grads(compiled_fn, q, k, v, dout)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_cuda_graph_replay_is_bitwise_equal_to_eager():
    q, k, v = _qkv(4, hq=4, hkv=4, sq=512, sk=512, d=128)
    dout = torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        return _loss_and_grads(lambda *t: flashkiln.scaled_dot_product_attention(*t, is_causal=True,
                                                                                 deterministic=True), q, k, v, dout)

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (loads the kernels) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager, captured):
            assert torch.equal(a, b)
