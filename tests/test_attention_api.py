"""attention_forward's argument checks and the portable planner's kernel choice and packing (CPU tensors only)."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

import flashkiln
from flashkiln import inputs
from flashkiln.head_dims import kernel_dims, padded
from flashkiln.inputs import check_forward_outputs, is_kernel_layout, kernel_layout
from test_registry import all_variants, descriptor, fake_registry, planned_forward  # tests/ is on sys.path (conftest.py)


@pytest.fixture
def registry(tmp_path):
    variants = all_variants(archs=("sm_80", "sm_90a"), dims=(64, 128))
    # A pair of head dims with its own tile_m, to see the grid follow the chosen entry.
    variants += [descriptor(arch="sm_80", dtype="fp16", d=192, d_v=128, causal=c, tile_m=64)
                 for c in ("none", "bottom_right")]
    reg, driver = fake_registry(tmp_path, variants)
    reg.fake_driver = driver
    return reg


def qkv(b=2, hq=4, hkv=2, sq=33, sk=40, d=64, d_v=None, dtype=torch.float16):
    d_v = d if d_v is None else d_v
    return (torch.zeros(b, hq, sq, d, dtype=dtype), torch.zeros(b, hkv, sk, d, dtype=dtype),
            torch.zeros(b, hkv, sk, d_v, dtype=dtype))


def expect_invalid(registry, q, k, v, match: str, **kwargs) -> None:
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.attention_forward(q, k, v, registry=registry, **kwargs)
    assert registry.fake_driver.calls == []


# -- argument checks, in the order forward.py makes them ---------------------------------------

def test_invalid_input_is_a_value_error():
    assert issubclass(flashkiln.InvalidInputError, ValueError)
    assert issubclass(flashkiln.InvalidInputError, flashkiln.FlashkilnError)


def test_cpu_tensors_are_refused(registry):
    expect_invalid(registry, *qkv(), match="inputs must be CUDA tensors, got device cpu")


def test_non_tensor(registry):
    q, k, v = qkv()
    expect_invalid(registry, q.numpy(), k, v, match="q must be a torch.Tensor, got ndarray")


def test_float32(registry):
    expect_invalid(registry, *qkv(dtype=torch.float32), match="q has dtype torch.float32")


def test_mixed_dtypes(registry):
    q, k, v = qkv()
    expect_invalid(registry, q, k, v.to(torch.bfloat16), match="q, k and v must share a dtype")


def test_three_dimensional_input(registry):
    q, k, v = qkv()
    expect_invalid(registry, q, k[0], v, match=r"k must be 4-D .* got shape \(2, 40, 64\)")


def test_batch_mismatch(registry):
    q, _, _ = qkv()
    _, k, v = qkv(b=3)
    expect_invalid(registry, q, k, v, match="batch sizes differ: q 2, k 3, v 3")


def test_query_heads_not_a_multiple_of_kv_heads(registry):
    expect_invalid(registry, *qkv(hq=3, hkv=2), match=r"query heads \(3\) must be a multiple of key/value heads \(2\)")


def test_kv_seqlen_mismatch(registry):
    q, k, _ = qkv(sk=40)
    _, _, v = qkv(sk=41)
    expect_invalid(registry, q, k, v, match="k and v must have the same heads and seqlen")


def test_unsupported_head_dim(registry):
    expect_invalid(registry, *qkv(d=264), match="q/k head dim 264 is not supported: .* from 1 to 256")


def test_unsupported_v_head_dim(registry):
    expect_invalid(registry, *qkv(d=64, d_v=0), match="v head dim 0 is not supported")


def test_head_dims_that_were_not_generated_run_on_the_next_larger_kernel():
    generated = frozenset({(64, 64), (128, 128), (192, 128), (256, 256)})
    assert kernel_dims(64, 64, generated, "forward") == (64, 64)
    assert kernel_dims(1, 1, generated, "forward") == (64, 64)
    assert kernel_dims(59, 59, generated, "forward") == (64, 64)
    assert kernel_dims(80, 80, generated, "forward") == (128, 128)
    assert kernel_dims(160, 96, generated, "forward") == (192, 128)
    assert kernel_dims(192, 192, generated, "forward") == (256, 256)
    assert kernel_dims(129, 64, generated, "forward") == (192, 128)
    with pytest.raises(flashkiln.VariantNotFoundError, match=r"head dims 200 \(generated for this GPU: 64, 128\)"):
        kernel_dims(200, 200, frozenset({(64, 64), (128, 128)}), "forward")


def test_padding_is_zeros_along_the_head_dim_only():
    t = torch.randn(2, 3, 5, 59, dtype=torch.bfloat16).transpose(1, 2)
    got = padded(t, 64)
    assert got.shape == (2, 5, 3, 64) and torch.equal(got[..., :59], t) and not got[..., 59:].any()
    assert padded(t, 59) is t


def test_q_k_head_dim_mismatch(registry):
    q, _, _ = qkv(d=64)
    _, k, v = qkv(d=128)
    expect_invalid(registry, q, k, v, match="q and k head dims differ: 64 vs 128")


@pytest.mark.parametrize("causal", [True, False, "bottom-right", "top-left", "causal", 1])
def test_bad_causal(registry, causal):
    expect_invalid(registry, *qkv(), match="causal must be None, 'top_left' or 'bottom_right'", causal=causal)


@pytest.mark.parametrize("scale", [0, 0.0, -1, float("nan"), float("inf"), True, "0.1"])
def test_bad_scale(registry, scale):
    expect_invalid(registry, *qkv(), match="scale must be a finite positive number", scale=scale)


@pytest.mark.parametrize("causal, scale", [(None, None), ("top_left", 0.5), ("bottom_right", 2)])
def test_valid_causal_and_scale_reach_the_device_check(registry, causal, scale):
    expect_invalid(registry, *qkv(), match="CUDA tensors", causal=causal, scale=scale)


def test_wrong_out_shape_is_refused(registry):
    q, k, v = qkv()
    # The output checks run after the device check, so on CPU the call fails there, before any
    # launch; test_check_outputs below covers the out/lse messages themselves.
    expect_invalid(registry, q, k, v, match="CUDA tensors", out=torch.zeros(2, 4, 33, 32, dtype=q.dtype))


@pytest.mark.parametrize(
    "out_shape, out_dtype, lse_shape, lse_dtype, match",
    [
        ((2, 4, 33, 32), torch.float16, (2, 4, 33), torch.float32, r"out must be a torch.float16 tensor of shape \(2, 4, 33, 64\)"),
        ((2, 4, 64, 33), torch.float16, (2, 4, 33), torch.float32, "out must be"),
        ((2, 4, 33, 64), torch.bfloat16, (2, 4, 33), torch.float32, "out must be"),
        ((2, 4, 33, 64), torch.float16, (2, 4, 34), torch.float32, r"lse must be a float32 tensor of shape \(2, 4, 33\)"),
        ((2, 4, 33, 64), torch.float16, (2, 4, 33), torch.float16, "lse must be"),
    ],
)
def testcheck_forward_outputs(out_shape, out_dtype, lse_shape, lse_dtype, match):
    q, _, _ = qkv()
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        check_forward_outputs(q, torch.zeros(out_shape, dtype=out_dtype), torch.zeros(lse_shape, dtype=lse_dtype), 64)


def test_check_outputs_layout():
    q, _, _ = qkv()
    lse = torch.zeros(2, 4, 33)
    check_forward_outputs(q, torch.zeros(2, 4, 33, 64, dtype=q.dtype), lse, 64)  # fine
    strided_out = torch.zeros(2, 4, 33, 128, dtype=q.dtype)[..., ::2]
    with pytest.raises(flashkiln.InvalidInputError, match="contiguous head dim"):
        check_forward_outputs(q, strided_out, lse, 64)
    with pytest.raises(flashkiln.InvalidInputError, match="lse must be contiguous"):
        check_forward_outputs(q, torch.zeros(2, 4, 33, 64, dtype=q.dtype), torch.zeros(2, 33, 4).transpose(1, 2), 64)


# -- portable_family.plan_forward ---------------------------------------------------------------------------------

def outputs_for(q, d_v):
    b, h, s, _ = q.shape
    return torch.zeros(b, h, s, d_v, dtype=q.dtype), torch.zeros(b, h, s, dtype=torch.float32)


def plan(registry, q, k, v, causal="none", scale=0.125, capability=(9, 0)):
    out, lse = outputs_for(q, v.shape[3])
    return planned_forward(q, k, v, out, lse, causal, scale, None, capability, registry), out, lse


def f32(x: float) -> float:
    return ctypes.c_float(x).value


def assert_strides(params, prefix: str, t: torch.Tensor) -> None:
    assert (getattr(params, f"{prefix}_batch_stride"), getattr(params, f"{prefix}_head_stride"),
            getattr(params, f"{prefix}_row_stride")) == t.stride()[:3]


def test_plan_grid_pointers_sizes_and_scale(registry):
    q, k, v = qkv(b=2, hq=4, hkv=2, sq=300, sk=200, d=128, dtype=torch.bfloat16)
    launch, out, lse = plan(registry, q, k, v, scale=0.1)
    assert launch.entry.variant == descriptor(arch="sm_90a", dtype="bf16", d=128, causal="none")
    assert launch.grid == (math.ceil(300 / 128), 4, 2) == (3, 4, 2)
    p = launch.params
    assert (p.q, p.k, p.v, p.o, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        assert_strides(p, prefix, t)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k) == (2, 4, 2, 300, 200)
    assert p.scale == f32(0.1)
    assert p.scale_log2 == f32(0.1 * math.log2(math.e))
    assert p.scale_log2 == pytest.approx(0.1 / math.log(2), rel=1e-6)


@pytest.mark.parametrize("sq, blocks", [(1, 1), (128, 1), (129, 2), (256, 2), (257, 3)])
def test_plan_grid_rounds_up(registry, sq, blocks):
    launch, _, _ = plan(registry, *qkv(sq=sq, sk=7, d=64, b=3, hq=2, hkv=1))
    assert launch.grid == (blocks, 2, 3)


def test_plan_passes_strides_of_a_bshd_tensor_through(registry):
    b, s, h, d = 2, 50, 4, 64
    q = torch.zeros(b, s, h, d, dtype=torch.float16).transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D)
    k = torch.zeros(b, s, h, d, dtype=torch.float16).transpose(1, 2)
    v = torch.zeros(b, s, h, d, dtype=torch.float16).transpose(1, 2)
    assert kernel_layout(q) is q  # no copy needed
    launch, _, _ = plan(registry, q, k, v)
    p = launch.params
    assert (p.q_batch_stride, p.q_head_stride, p.q_row_stride) == (s * h * d, d, h * d)
    assert (p.k_batch_stride, p.k_head_stride, p.k_row_stride) == (s * h * d, d, h * d)
    assert (p.v_batch_stride, p.v_head_stride, p.v_row_stride) == (s * h * d, d, h * d)
    assert p.q == q.data_ptr()
    assert launch.grid == (1, h, b)


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("capability, arch", [((9, 0), "sm_90a"), ((8, 0), "sm_80"), ((8, 6), "sm_80")])
def test_plan_picks_the_entry_for_the_causal_mode(registry, causal, capability, arch):
    launch, _, _ = plan(registry, *qkv(d=64), causal=causal, capability=capability)
    # One causal kernel serves both alignments: the call's is its parameter block's top_left.
    kernel_causal = "none" if causal == "none" else "bottom_right"
    assert launch.entry.variant == descriptor(arch=arch, dtype="fp16", d=64, causal=kernel_causal)
    assert launch.params.top_left == (causal == "top_left")


def test_plan_uses_the_entry_tile_m_and_distinct_head_dims(registry):
    launch, _, _ = plan(registry, *qkv(sq=130, d=192, d_v=128), causal="top_left", capability=(8, 0))
    assert launch.entry.variant == descriptor(arch="sm_80", dtype="fp16", d=192, d_v=128, causal="bottom_right",
                                              tile_m=64)
    assert launch.grid == (3, 4, 2)  # ceil(130 / 64)


def test_plan_for_a_missing_variant(registry):
    with pytest.raises(flashkiln.VariantNotFoundError, match="d_qk=192, d_v=128"):
        plan(registry, *qkv(d=192, d_v=128), capability=(9, 0))


# -- _kernel_layout -------------------------------------------------------------------------------

def test_kernel_layout_keeps_an_aligned_tensor():
    t = torch.zeros(2, 3, 5, 64, dtype=torch.float16)
    assert kernel_layout(t) is t


def test_kernel_layout_copies_a_strided_head_dim():
    t = torch.arange(2 * 3 * 5 * 128, dtype=torch.float32).to(torch.bfloat16).view(2, 3, 5, 128)[..., ::2]
    assert t.stride(-1) == 2
    copy = kernel_layout(t)
    assert copy is not t and copy.data_ptr() != t.data_ptr()
    assert copy.is_contiguous() and is_kernel_layout(copy)
    assert torch.equal(copy, t)


def test_kernel_layout_copies_a_misaligned_base():
    n = 2 * 3 * 5 * 64
    storage = torch.arange(n + 8, dtype=torch.float32).to(torch.float16)
    assert storage.data_ptr() % 16 == 0
    t = storage[1:n + 1].view(2, 3, 5, 64)  # one element (2 bytes) past an aligned base
    assert t.data_ptr() % 16 == 2
    copy = kernel_layout(t)
    assert copy is not t
    assert copy.data_ptr() % 16 == 0 and is_kernel_layout(copy)
    assert torch.equal(copy, t)


def test_kernel_layout_copies_an_unaligned_row_stride():
    t = torch.zeros(2, 3, 5, 72, dtype=torch.float16)[..., :64]  # row stride 72: fine (multiple of 8)
    assert kernel_layout(t) is t
    t = torch.zeros(2, 3, 5, 68, dtype=torch.float16)[..., :64]  # row stride 68: not 16-byte aligned
    assert kernel_layout(t) is not t


def test_kernel_layout_ignores_strides_of_unit_dims():
    t = torch.zeros(1, 3, 5, 68, dtype=torch.float16)[:, :1, :1, :64]  # only the head dim has extent > 1
    assert kernel_layout(t) is t


def test_empty_like_layout_follows_q():
    q = torch.zeros(2, 50, 4, 64, dtype=torch.float16).transpose(1, 2)
    out = inputs.empty_in_memory_order(q, 32)
    assert out.shape == (2, 4, 50, 32)
    assert out.stride() == (50 * 4 * 32, 32, 4 * 32, 1)
    q = torch.zeros(2, 4, 50, 64, dtype=torch.float16)
    assert inputs.empty_in_memory_order(q, 32).is_contiguous()
