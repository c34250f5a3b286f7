"""The plan cache's keys (CPU): every property the checks and the planning read separates two calls."""
from __future__ import annotations

import pytest
import torch

from flashkiln import backward, forward
from flashkiln.plan_cache import PlanCache, tensor_key


def qkv(dtype=torch.bfloat16, s=16, d=64):
    return tuple(torch.zeros(1, 2, s, d, dtype=dtype) for _ in range(3))


def fkey(q, k, v, causal=None, scale=None, bias=None, sink=None, packed=None, registry=None, backend=None,
         window_size=None, softcap=None):
    return forward._key(q, k, v, causal, window_size, softcap, scale, bias, sink, packed, registry, backend)


def test_equal_calls_have_equal_keys_and_the_address_is_not_part_of_it():
    assert fkey(*qkv()) == fkey(*qkv())


@pytest.mark.parametrize("change", ["stride", "dtype", "shape", "alignment", "head dim stride", "type"])
def test_what_the_checks_read_of_a_tensor_separates_keys(change):
    q, k, v = qkv()
    if change == "stride":
        other = torch.zeros(1, 16, 2, 64, dtype=q.dtype).transpose(1, 2)
    elif change == "dtype":
        other = q.to(torch.float16)
    elif change == "shape":
        other = torch.zeros(1, 2, 17, 64, dtype=q.dtype)
    elif change == "alignment":  # same shape and strides, base 2 bytes past a 16-byte boundary
        other = torch.zeros(1 * 2 * 16 * 64 + 1, dtype=q.dtype)[1:].view(1, 2, 16, 64)
    elif change == "head dim stride":
        other = torch.zeros(1, 2, 16, 128, dtype=q.dtype)[..., ::2]
    else:
        other = torch.nn.Parameter(q.clone())
    assert tensor_key(other) != tensor_key(q)
    assert fkey(other, k, v) != fkey(q, k, v)


def test_a_device_separates_keys():
    q, k, v = qkv()
    meta = q.to("meta")
    assert tensor_key(meta) != tensor_key(q)


@pytest.mark.parametrize("a, b", [(1.0, True), (1.0, 1), (0.125, 0.25)])
def test_scalars_are_keyed_with_their_types(a, b):
    # True == 1 == 1.0 in Python: a plan for scale=1.0 must not serve scale=True (refused by the checks).
    assert fkey(*qkv(), scale=a) != fkey(*qkv(), scale=b)


def test_calls_the_key_cannot_describe_are_planned_each_time():
    q, k, v = qkv()
    assert fkey(q, k, v, bias=torch.zeros(16, 16, dtype=torch.bool)) is None
    with pytest.raises((AttributeError, TypeError)):
        fkey(q.numpy(), k, v)  # attention_forward then plans, and the checks name the problem


def test_a_bias_is_keyed_with_the_room_its_storage_leaves():
    q, k, v = qkv()
    exact = torch.zeros(16, 16, dtype=q.dtype)
    roomy = torch.zeros(16 * 16 + 8, dtype=q.dtype)[:256].view(16, 16)
    assert tensor_key(exact) == tensor_key(roomy)
    assert fkey(q, k, v, bias=exact) != fkey(q, k, v, bias=roomy)


def test_the_backward_key_reads_the_route_settings_and_torch_s_deterministic_flag(monkeypatch):
    q, k, v = qkv()
    lse = torch.zeros(1, 2, 16)

    def bkey(**kw):
        args = dict(dout=q, q=q, k=k, v=v, out=q, lse=lse, dlse=None, causal=None, window_size=None, softcap=None,
                    scale=None,
                    bias=None,
                    bias_grad=False, sink=None, sink_grad=False, deterministic=None, packed=None, partial_keys=False,
                    registry=None, backend=None)
        return backward._key(**{**args, **kw})

    base = bkey()
    assert bkey(partial_keys=True) != base
    monkeypatch.setenv("FLASHKILN_BACKWARD_ROUTE", "ordered")
    assert bkey() != base
    monkeypatch.delenv("FLASHKILN_BACKWARD_ROUTE")
    with torch.autograd.set_grad_enabled(True):
        flag = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(not flag)
        try:
            assert bkey() != base
        finally:
            torch.use_deterministic_algorithms(flag)
    assert bkey(dlse=lse) != base and bkey(bias_grad=1) != bkey(bias_grad=True)
    assert bkey(window_size=(4, 0)) != base != bkey(window_size=(-1, -1))
    assert bkey(softcap=30.0) != base and bkey(softcap=30) != bkey(softcap=30.0)


def test_the_window_is_keyed_with_its_types():
    """A window's pair is keyed by value and type: (1, 2) and [1, 2] plan apart (the checks pass
    both alike), and so do (1, 0) and (True, 0), which the checks refuse."""
    q, k, v = qkv()
    keys = [fkey(q, k, v, window_size=w) for w in (None, (1, 2), [1, 2], (1, 0), (True, 0), (1, 2))]
    assert len(set(keys[:5])) == 5 and keys[1] == keys[5]


def test_the_cache_is_bounded_and_drops_its_oldest_plan():
    cache = PlanCache(capacity=2)
    for i in range(3):
        cache.put(i, f"plan {i}")
    assert len(cache) == 2 and cache.get(0) is None and cache.get(2) == "plan 2"
    assert cache.newest() == "plan 2" and PlanCache().newest() is None
