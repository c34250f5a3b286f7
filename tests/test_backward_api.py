"""attention_backward's checks and plan_backward's kernel choice, workspaces and packing (CPU only),
and the SDPA drop-in's refusals."""
from __future__ import annotations

import math

import pytest
import torch

import flashkiln
from flashkiln.backward import _check_gradient_buffer, plan_backward
from flashkiln.descriptor import VariantDescriptor
from flashkiln.registry import KernelRegistry
from test_registry import FakeDriver, kernel_entry, write_manifest

TILES = {"bwd": (64, 128, 8, 2), "bwd_pre": (16, 1, 4, 1), "bwd_post": (16, 1, 4, 1)}


def bwd_descriptor(kernel: str, causal="none", deterministic=False, d=128) -> VariantDescriptor:
    tile_m, tile_n, warps, stages = TILES[kernel]
    return VariantDescriptor(kernel=kernel, family="portable", arch="sm_90a", dtype="bf16", d_qk=d, d_v=d,
                             causal=causal, bias="none", deterministic=deterministic, tile_m=tile_m, tile_n=tile_n,
                             warps=warps, stages=stages)


@pytest.fixture
def registry(tmp_path):
    ds = [bwd_descriptor("bwd", c, det) for c in ("none", "top_left", "bottom_right") for det in (False, True)]
    ds += [bwd_descriptor("bwd_pre"), bwd_descriptor("bwd_post")]
    return KernelRegistry(write_manifest(tmp_path, [kernel_entry(d) for d in ds]), driver=FakeDriver())


def tensors(b=2, hq=4, hkv=4, sq=100, sk=300, d=128):
    q = torch.randn(b, hq, sq, d, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, sk, d, dtype=torch.bfloat16) for _ in range(2))
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(b, hq, sq)
    return dout, q, k, v, out, lse


def plan(registry, deterministic=False, causal="none", **shape):
    dout, q, k, v, out, lse = tensors(**shape)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    return plan_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, 0.125, deterministic, (9, 0), registry), \
        (dout, q, k, v, out, lse, dq, dk, dv)


def test_plan_launches_pre_main_post_with_their_grids(registry):
    p, _ = plan(registry, b=2, hq=4, sq=100, sk=300)
    pre, main, post = p.launches
    assert [l.entry.descriptor["kernel"] for l in p.launches] == ["bwd_pre", "bwd", "bwd_post"]
    assert main.grid == (math.ceil(300 / 128), 4, 2)
    assert pre.grid == (128 // 16, 4, 2)  # 100 query rows rounded up to tile_m = 64 -> 128
    assert post.grid == (math.ceil(100 / 16), 4, 2)
    assert main.params.seqlen_q_rounded == 128 and main.params.scale == 0.125
    assert abs(main.params.scale_log2 - 0.125 * math.log2(math.e)) < 1e-6
    assert pre.params is main.params is post.params


def test_plan_packs_every_tensor_and_stride(registry):
    p, (dout, q, k, v, out, lse, dq, dk, dv) = plan(registry)
    params = p.launches[1].params
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert [getattr(params, f"{name}_{kind}_stride") for kind in ("batch", "head", "row")] == list(t.stride()[:3])
    assert (params.q, params.dout, params.lse, params.dq) == (q.data_ptr(), dout.data_ptr(), lse.data_ptr(),
                                                              dq.data_ptr())
    delta, dq_accum, semaphore = p.workspaces
    assert delta.shape == (2, 4, 100) and dq_accum.shape == (2, 4, 128, 128) and dq_accum.dtype == torch.float32
    assert params.delta == delta.data_ptr() and params.dq_accum == dq_accum.data_ptr()


def test_deterministic_plan_orders_dq_behind_zeroed_semaphores(registry):
    p, _ = plan(registry, deterministic=True, causal="bottom_right")
    assert p.route == "ordered" and p.launches[1].entry.descriptor["deterministic"] is True
    assert p.launches[1].entry.descriptor["causal"] == "bottom_right"
    semaphore = p.workspaces[2]
    assert semaphore.shape == (2, 4, 2) and semaphore.dtype == torch.int32 and not semaphore.any()
    assert p.launches[1].params.dq_semaphore == semaphore.data_ptr()
    atomic, _ = plan(registry)
    assert atomic.route == "atomic" and atomic.workspaces[2] is None and atomic.launches[1].params.dq_semaphore == 0


def test_gqa_plan_accumulates_per_query_head(registry):
    p, _ = plan(registry, hq=6, hkv=2)
    assert p.dk_accum.shape == (2, 6, 300, 128) and p.dv_accum.shape == (2, 6, 300, 128)
    assert p.launches[1].params.dk_accum == p.dk_accum.data_ptr()
    mha, _ = plan(registry)
    assert mha.dk_accum is None and mha.launches[1].params.dk_accum == 0


@pytest.mark.parametrize("bad,match", [
    (lambda t: (t[0][..., :64], *t[1:]), "dout must be"),
    (lambda t: (*t[:4], t[4].float(), t[5]), "out must be"),
    (lambda t: (*t[:5], t[5].double()), "lse must be"),
    (lambda t: (*t[:5], t[5][:, :, :10]), "lse must be"),
])
def test_backward_checks_come_before_any_launch(registry, bad, match):
    args = bad(tensors())
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.attention_backward(*args, registry=registry)
    assert registry.driver.calls == []


def test_backward_refuses_cpu_tensors_and_bad_buffers(registry):
    dout, q, k, v, out, lse = tensors()
    with pytest.raises(flashkiln.InvalidInputError, match="CUDA"):
        flashkiln.attention_backward(dout, q, k, v, out, lse, registry=registry)
    assert registry.driver.calls == []
    with pytest.raises(flashkiln.InvalidInputError, match="dq must be a"):
        _check_gradient_buffer("dq", torch.empty(1), q)
    with pytest.raises(flashkiln.InvalidInputError, match="16-byte aligned"):
        _check_gradient_buffer("dq", torch.empty(2, 4, 100, 129, dtype=q.dtype)[..., 1:], q)


def test_sdpa_refuses_what_it_does_not_support():
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(flashkiln.UnsupportedError, match="dropout"):
        flashkiln.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(flashkiln.UnsupportedError, match="attn_mask"):
        flashkiln.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(flashkiln.InvalidInputError, match="enable_gqa"):
        flashkiln.scaled_dot_product_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(flashkiln.InvalidInputError, match="CUDA"):
        flashkiln.scaled_dot_product_attention(q, q, q)
