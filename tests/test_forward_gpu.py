"""Attention forward on the GPU against the fp32 reference (shared/CONVENTIONS.md).

Every case draws fresh random inputs from a printed seed, poisons the outputs with NaN before the
launch (and keeps NaN canaries around them), and checks O and LSE with rule FA-style(2).
"""
from __future__ import annotations

from functools import partial

import pytest
import torch

import flashkiln
from reference import attention_reference, fa_style_check, repro_line, seed_of

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_forward_gpu.py")

HEAD_DIMS = (64, 128, 256)
# With d_qk != d_v (192/128, as in DeepSeek's MLA): for the tests whose inputs come from _inputs.
ALL_HEAD_DIMS = (64, 128, (192, 128), 256)


def head_dim_id(d: int | tuple[int, int]) -> str:
    return str(d) if isinstance(d, int) else f"{d[0]}x{d[1]}"
CAUSAL = (None, "top_left", "bottom_right")
# Tails, tile boundaries and S_q != S_k in both directions (CONVENTIONS.md's S set).
SEQLENS = [(1, 1), (17, 17), (113, 113), (128, 128), (129, 129), (1023, 1023), (4224, 4224),
           (1, 4224), (4224, 1), (17, 129), (129, 17), (113, 1023), (1023, 113), (128, 4224), (4224, 128)]


def _inputs(seed: int, b: int, hq: int, hkv: int, sq: int, sk: int, d: int | tuple[int, int], dtype: torch.dtype,
            layout: str = "bhsd") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v; d is the head dim, or (d_qk, d_v)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d_qk, d_v = (d, d) if isinstance(d, int) else d

    def make(h: int, s: int, dim: int) -> torch.Tensor:
        if layout == "bshd":  # (B, S, H, D) storage seen as (B, H, S, D)
            return torch.randn(b, s, h, dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
        return torch.randn(b, h, s, dim, device="cuda", dtype=dtype, generator=gen)

    return make(hq, sq, d_qk), make(hkv, sk, d_qk), make(hkv, sk, d_v)


def _poisoned_outputs(q: torch.Tensor, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN-filled out and lse views, with NaN canaries on both sides of each."""
    b, h, s, _ = q.shape
    out_storage = torch.full((b, h, s + 2, d_v), float("nan"), device="cuda", dtype=q.dtype)
    lse_storage = torch.full((b * h * s + 2,), float("nan"), device="cuda", dtype=torch.float32)
    return out_storage, out_storage[:, :, 1:-1], lse_storage, lse_storage[1:-1].view(b, h, s)


# Each kernel family explicitly (auto picks hopper on an H200 wherever it can).
BACKENDS = ("portable", "hopper")


def _check_forward(q, k, v, causal, scale, repro: str, backend: str | None = None) -> None:
    if backend == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    out_storage, out, lse_storage, lse = _poisoned_outputs(q, v.shape[-1])
    got_out, got_lse = flashkiln.attention_forward(q, k, v, causal=causal, scale=scale, out=out, lse=lse,
                                                   backend=backend)
    torch.cuda.synchronize()
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    assert torch.isnan(out_storage[:, :, 0]).all() and torch.isnan(out_storage[:, :, -1]).all(), \
        f"canary rows around out were overwritten\n{repro}"
    assert torch.isnan(lse_storage[0]) and torch.isnan(lse_storage[-1]), f"canaries around lse were overwritten\n{repro}"
    ref32 = attention_reference(q, k, v, causal, scale, torch.float32)
    reflp = attention_reference(q, k, v, causal, scale, q.dtype)
    fa_style_check("out", got_out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", got_lse, ref32.lse, reflp.lse, 2, repro)
    # Rows that see no key: exactly O = 0 and LSE = -inf.
    assert (got_out[ref32.empty_rows] == 0).all(), f"rows that see no key are not 0\n{repro}"


@pytest.mark.parametrize("d", ALL_HEAD_DIMS, ids=head_dim_id)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_gqa(backend, dtype, sq, sk, causal, d):
    """GQA 6/2 over every S pair, head dim and causal mode, each family on the same inputs."""
    seed = seed_of("sweep", dtype, sq, sk, causal, d)
    q, k, v = _inputs(seed, 2, 6, 2, sq, sk, d, dtype)
    _check_forward(q, k, v, causal, None, _repro("test_sweep_gqa", seed=seed, backend=backend, dtype=dtype, sq=sq,
                                                 sk=sk, causal=causal, d=d), backend=backend)


@pytest.mark.parametrize("hq,hkv", [(6, 1), (6, 6)], ids=["mqa6-1", "mha6"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk", [(129, 129), (1023, 4224), (4224, 1023)])
@pytest.mark.parametrize("d", ALL_HEAD_DIMS, ids=head_dim_id)
def test_heads(d, sq, sk, causal, hq, hkv):
    seed = seed_of("heads", d, sq, sk, causal, hq, hkv)
    q, k, v = _inputs(seed, 2, hq, hkv, sq, sk, d, torch.bfloat16)
    _check_forward(q, k, v, causal, None, _repro("test_heads", seed=seed, d=d, sq=sq, sk=sk, causal=causal,
                                                 hq=hq, hkv=hkv))


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", ALL_HEAD_DIMS, ids=head_dim_id)
def test_bshd_layout_and_scale(d, causal):
    """(B, S, H, D) storage in, same memory order out; a custom scale."""
    seed = seed_of("bshd", d, causal)
    q, k, v = _inputs(seed, 3, 4, 2, 300, 517, d, torch.bfloat16, layout="bshd")
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, scale=0.3)
    assert out.stride(1) < out.stride(2), "out should keep q's (B, S, H, D) memory order"
    repro = _repro("test_bshd_layout_and_scale", seed=seed, d=d, causal=causal)
    ref32 = attention_reference(q, k, v, causal, 0.3, torch.float32)
    reflp = attention_reference(q, k, v, causal, 0.3, q.dtype)
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, repro)


def test_unaligned_and_strided_inputs_are_copied():
    """A last-dim stride of 2 and a base offset of one element are read correctly (via a copy)."""
    seed = seed_of("unaligned")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(2, 4, 200, 2 * 128 + 1, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = base[..., 1:1 + 256:2]  # stride 2 in the head dim
    k = base[..., 1:129]  # base pointer off by one element
    v = base[..., 129:257]
    repro = _repro("test_unaligned_and_strided_inputs_are_copied", seed=seed)
    _check_forward(q, k, v, "top_left", None, repro)


def test_empty_key_sequence():
    q, k, v = _inputs(seed_of("empty"), 1, 2, 2, 33, 0, 64, torch.bfloat16)
    out, lse = flashkiln.attention_forward(q, k, v)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_rows_without_visible_keys_bottom_right():
    """S_q > S_k, bottom-right: the first S_q - S_k queries see nothing (O = 0, LSE = -inf)."""
    seed = seed_of("no-keys")
    q, k, v = _inputs(seed, 1, 2, 2, 300, 100, 128, torch.bfloat16)
    out, lse = flashkiln.attention_forward(q, k, v, causal="bottom_right")
    assert (out[:, :, :200] == 0).all() and torch.isneginf(lse[:, :, :200]).all()
    assert torch.isfinite(lse[:, :, 200:]).all() and not torch.isnan(out).any()


def test_runs_on_the_current_stream():
    seed = seed_of("stream")
    q, k, v = _inputs(seed, 2, 4, 4, 1024, 1024, 128, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = flashkiln.attention_forward(q, k, v)
        expected = out.clone()  # ordered after the kernel on the same stream
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    ref32 = attention_reference(q, k, v, None, None, torch.float32)
    reflp = attention_reference(q, k, v, None, None, q.dtype)
    fa_style_check("out", out, ref32.out, reflp.out, 2, _repro("test_runs_on_the_current_stream", seed=seed))


def test_large_batch_offsets_use_64_bit():
    """K/V batch stride of 2**31 elements: the second batch entry lies past int32 offsets."""
    seed = seed_of("64bit")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    storage = torch.randn(2**31 + 4 * 1024 * 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    shape, strides = (2, 2, 1024, 128), (2**31, 1024 * 128, 128, 1)
    k = storage.as_strided(shape, strides)
    v = storage.as_strided(shape, strides, storage_offset=2 * 1024 * 128)
    q = torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    repro = _repro("test_large_batch_offsets_use_64_bit", seed=seed)
    _check_forward(q, k, v, None, None, repro)
