"""Cached plans on the GPU: a repeated call only runs its plan and gives the same result; a call
that differs from a cached one in anything the checks read gets its own plan, or its typed error."""
from __future__ import annotations

import pytest
import torch

import flashkiln
from flashkiln import backward, forward
from reference import seed_of

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _inputs(seed: int, b=2, hq=4, hkv=2, s=129, d=64, dtype=BF16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, s, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _fresh(fn):
    """fn() planned afresh (the reference a cached run must equal bitwise)."""
    forward.PLANS.clear()
    backward.PLANS.clear()
    return fn()


@pytest.mark.parametrize("backend", ["hopper", "portable"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_a_cache_hit_on_new_tensors_equals_a_fresh_plan(backend, causal):
    """Same key, new addresses (pointers patched, tensor maps re-pointed): bitwise the fresh plan's
    result; the cache holds one plan per direction."""
    q, k, v = _inputs(seed_of("plan-hit", backend, causal))
    dout = torch.randn_like(q)
    flashkiln.attention_forward(q, k, v, causal=causal, backend=backend)  # plans
    assert len(forward.PLANS) == 1
    q2, k2, v2, dout2 = (t.clone() + 0.5 for t in (q, k, v, dout))
    out, lse = flashkiln.attention_forward(q2, k2, v2, causal=causal, backend=backend)  # hit
    grads = flashkiln.attention_backward(dout2, q2, k2, v2, out, lse, causal=causal)
    grads_hit = flashkiln.attention_backward(dout2, q2, k2, v2, out, lse, causal=causal, deterministic=False)
    assert len(forward.PLANS) == 1 and len(backward.PLANS) == 2  # deterministic=None and False: two keys
    ref_out, ref_lse = _fresh(lambda: flashkiln.attention_forward(q2, k2, v2, causal=causal, backend=backend))
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    ref = _fresh(lambda: flashkiln.attention_backward(dout2, q2, k2, v2, out, lse, causal=causal, deterministic=True))
    hit = flashkiln.attention_backward(dout2, q2, k2, v2, out, lse, causal=causal, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(hit, ref))
    for a, b in zip(grads, grads_hit):  # the atomic route: equal up to the order of its additions
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_after_a_hit_a_call_that_differs_in_what_the_checks_read_is_checked():
    q, k, v = _inputs(seed_of("plan-checks"))
    flashkiln.attention_forward(q, k, v)
    flashkiln.attention_forward(q, k, v)  # a hit
    with pytest.raises(flashkiln.InvalidInputError, match="dtype torch.float32"):
        flashkiln.attention_forward(q.float(), k.float(), v.float())
    with pytest.raises(flashkiln.InvalidInputError, match="must share a dtype"):
        flashkiln.attention_forward(q, k.half(), v)
    with pytest.raises(flashkiln.InvalidInputError, match="CUDA tensors"):
        flashkiln.attention_forward(q.cpu(), k.cpu(), v.cpu())
    with pytest.raises(flashkiln.InvalidInputError, match="one device"):
        flashkiln.attention_forward(q, k.cpu(), v)
    with pytest.raises(flashkiln.InvalidInputError, match="scale"):
        flashkiln.attention_forward(q, k, v, scale=True)
    with pytest.raises(flashkiln.InvalidInputError, match="heads"):
        flashkiln.attention_forward(q[:, :3], k, v)
    out, lse = flashkiln.attention_forward(q, k, v)
    flashkiln.attention_backward(out, q, k, v, out, lse)
    with pytest.raises(flashkiln.InvalidInputError, match="dout must be"):
        flashkiln.attention_backward(out.float(), q, k, v, out, lse)
    with pytest.raises(flashkiln.InvalidInputError, match="lse must be"):
        flashkiln.attention_backward(out, q, k, v, out, lse[:, :, :-1])


@pytest.mark.parametrize("layout", ["strided head dim", "bshd", "unaligned base"])
def test_after_a_hit_another_layout_gets_its_own_plan_and_the_same_result(layout):
    """A non-contiguous head dim (copied first), (B, S, H, D) strides (read in place) and a base
    2 bytes past a 16-byte boundary (copied; TMA refuses it) after a cached call of the same shape."""
    q, k, v = _inputs(seed_of("plan-layout", layout))
    expected, expected_lse = flashkiln.attention_forward(q, k, v)
    flashkiln.attention_forward(q, k, v)  # a hit
    if layout == "strided head dim":
        wide = torch.zeros(*q.shape[:3], 2 * q.shape[3], device="cuda", dtype=q.dtype)
        wide[..., ::2] = q
        other = wide[..., ::2]
    elif layout == "bshd":
        other = q.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        flat = torch.zeros(q.numel() + 1, device="cuda", dtype=q.dtype)
        other = flat[1:].view(q.shape).copy_(q)
    assert torch.equal(other, q) and other.stride() != q.stride() or other.data_ptr() % 16
    out, lse = flashkiln.attention_forward(other, k, v)
    assert len(forward.PLANS) == 2
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
