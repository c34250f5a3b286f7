"""The Hopper forward (backend="hopper") on an sm_90 GPU against the fp32 reference, beyond the
shared sweep in tests/test_forward_gpu.py (which runs both families): MQA/MHA in (B, S, H, D)
storage, the two families agree, auto selection, sinks, persistence over many tiles, typed
refusals."""
from __future__ import annotations

from functools import partial

import pytest
import torch

import flashkiln
from reference import attention_reference, fa_style_check, repro_line, seed_of
from test_forward_gpu import CAUSAL, HEAD_DIMS, _check_forward, _inputs, head_dim_id

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_hopper_forward_gpu.py")


# Every head dim of specs/hopper.yaml's forward: d 96 lies in 64-byte swizzled boxes, the others in 128-byte ones.
HOPPER_HEAD_DIMS = (64, 96, 128, (192, 128), 256)


@pytest.fixture(autouse=True)
def _needs_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper backend runs on compute capability 9.0 only")


@pytest.mark.parametrize("hq,hkv", [(6, 1), (6, 6)], ids=["mqa6-1", "mha6"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", HOPPER_HEAD_DIMS, ids=head_dim_id)
def test_heads_and_bshd_layout(d, causal, hq, hkv):
    """MQA and MHA, (B, S, H, D) storage, a custom scale."""
    seed = seed_of("hopper-heads", d, causal, hq, hkv)
    q, k, v = _inputs(seed, 3, hq, hkv, 1023, 517, d, torch.bfloat16, layout="bshd")
    _check_forward(q, k, v, causal, 0.3, _repro("test_heads_and_bshd_layout", seed=seed, d=d, causal=causal,
                                                hq=hq, hkv=hkv), backend="hopper")


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", HOPPER_HEAD_DIMS, ids=head_dim_id)
def test_families_agree(d, causal):
    """Hopper and portable forwards on the same inputs: both within FA-style(2) of REF32, and close
    to each other (they round P and accumulate in different orders, so not bitwise)."""
    seed = seed_of("hopper-agree", d, causal)
    q, k, v = _inputs(seed, 2, 8, 2, 2048, 2048, d, torch.bfloat16)
    hop = flashkiln.attention_forward(q, k, v, causal=causal, backend="hopper")
    port = flashkiln.attention_forward(q, k, v, causal=causal, backend="portable")
    repro = _repro("test_families_agree", seed=seed, d=d, causal=causal)
    ref32 = attention_reference(q, k, v, causal, None, torch.float32)
    reflp = attention_reference(q, k, v, causal, None, q.dtype)
    for name, got in (("hopper", hop), ("portable", port)):
        fa_style_check(f"{name} out", got[0], ref32.out, reflp.out, 2, repro)
        fa_style_check(f"{name} lse", got[1], ref32.lse, reflp.lse, 2, repro)
    rounding = (reflp.out.float() - ref32.out).abs().max().item()
    assert (hop[0].float() - port[0].float()).abs().max().item() <= 4 * rounding + 1e-5, repro
    assert (hop[1] - port[1]).abs().max().item() <= 1e-3, repro


def test_many_tiles_per_cta_and_repeatability():
    """More work tiles than SMs (each persistent CTA runs several, crossing heads and batches),
    and 20 runs bitwise equal (outputs re-poisoned between runs)."""
    seed = seed_of("hopper-persistent")
    q, k, v = _inputs(seed, 4, 16, 4, 4224, 1023, 128, torch.bfloat16)
    out, lse = flashkiln.attention_forward(q, k, v, causal="bottom_right", backend="hopper")
    repro = _repro("test_many_tiles_per_cta_and_repeatability", seed=seed)
    ref32 = attention_reference(q, k, v, "bottom_right", None, torch.float32)
    reflp = attention_reference(q, k, v, "bottom_right", None, q.dtype)
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, repro)
    for _ in range(20):
        again_out, again_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
        flashkiln.attention_forward(q, k, v, causal="bottom_right", backend="hopper", out=again_out, lse=again_lse)
        assert torch.equal(again_out, out) and torch.equal(again_lse, lse), repro


@pytest.mark.parametrize("causal", CAUSAL)
def test_sinks(causal):
    seed = seed_of("hopper-sinks", causal)
    q, k, v = _inputs(seed, 2, 6, 2, 300, 113, 128, torch.bfloat16)
    sink = torch.linspace(-3.0, 6.0, 6, device="cuda")
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, sink=sink, backend="hopper")
    repro = _repro("test_sinks", seed=seed, causal=causal)
    ref32 = attention_reference(q, k, v, causal, None, torch.float32, sink=sink)
    reflp = attention_reference(q, k, v, causal, None, q.dtype, sink=sink)
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, repro)
    assert (out[ref32.empty_rows] == 0).all(), repro


def test_rows_without_visible_keys():
    q, k, v = _inputs(seed_of("hopper-no-keys"), 1, 2, 2, 300, 100, 64, torch.bfloat16)
    out, lse = flashkiln.attention_forward(q, k, v, causal="bottom_right", backend="hopper")
    assert (out[:, :, :200] == 0).all() and torch.isneginf(lse[:, :, :200]).all()
    assert torch.isfinite(lse[:, :, 200:]).all() and not torch.isnan(out).any()


def test_auto_takes_hopper_where_it_has_the_variant(monkeypatch):
    """Auto runs the Hopper kernel for a generated variant (with a bias, and at d 96, too), bitwise
    what backend="hopper" runs. (Fallbacks: the packed softcapped forward, test_softcap_gpu.py.)"""
    from conftest import spy_planner

    planned = spy_planner(monkeypatch, "hopper")
    q, k, v = _inputs(seed_of("hopper-auto"), 1, 2, 2, 256, 256, 128, torch.bfloat16)
    auto = flashkiln.attention_forward(q, k, v)
    assert len(planned) == 1
    torch.testing.assert_close(auto[0], flashkiln.attention_forward(q, k, v, backend="hopper")[0], rtol=0, atol=0)
    bias = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    biased = flashkiln.attention_forward(q, k, v, bias=bias)
    assert len(planned) == 3
    torch.testing.assert_close(biased[0], flashkiln.attention_forward(q, k, v, bias=bias, backend="hopper")[0],
                               rtol=0, atol=0)
    d96 = _inputs(seed_of("hopper-d96"), 1, 2, 2, 64, 64, 96, torch.bfloat16)
    flashkiln.attention_forward(*d96)  # d 96 too (64-byte swizzled boxes, hopper/head_boxes.hpp)
    assert len(planned) == 5 and "_d96_" in str(planned[-1])


def test_causal_launch_takes_a_zeroed_tile_counter():
    """Causal CTAs claim tiles from a zeroed counter, scratch made for every call (held until the
    launch is enqueued); the grid's row shift is the one the tile choice counts."""
    from flashkiln import hopper_family
    from flashkiln.calls import ForwardCall
    from flashkiln.launch import ScratchSet, Target
    from flashkiln.registry import default_registry

    q, k, v = _inputs(seed_of("hopper-counter"), 1, 2, 2, 300, 300, 128, torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    scratch = ScratchSet(q.device)
    (launch,) = hopper_family.plan_forward(ForwardCall(q, k, v, out, lse, "top_left", 0.1), Target.of(q),
                                           default_registry(), scratch)
    counter = scratch.tensors["tile_counter"]
    assert [s.role for s in scratch.specs] == ["tile_counter"] and scratch.specs[0].zeroed
    assert launch.params.tile_counter == counter.data_ptr() and counter.item() == 0
    assert "tile_counter" in launch.pointers  # a cached plan points each call at a fresh zeroed counter
    tile_m = launch.entry.descriptor["tile_m"]
    assert launch.params.row_shift == flashkiln.tile_choice.causal_row_shift(300, tile_m, 64) == 64
    scratch = ScratchSet(q.device)
    (plain,) = hopper_family.plan_forward(ForwardCall(q, k, v, out, lse, "none", 0.1), Target.of(q),
                                          default_registry(), scratch)
    assert plain.params.tile_counter == 0 and scratch.specs == [] and plain.params.row_shift == 0


@pytest.mark.parametrize("sq,sk", [(1023, 1023), (129, 4224), (4224, 129)])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", HOPPER_HEAD_DIMS, ids=head_dim_id)
def test_each_tuning_of_a_variant(monkeypatch, d, causal, sq, sk):
    """Each tuning of a variant that has several (specs/tuning/hopper.yaml), forced in turn,
    whichever the shape would pick."""
    forced = {"index": 0, "count": 0, "names": set()}

    def choose(entries, seqlen_q, seqlen_k, window=None):
        forced["count"] = len(entries)
        forced["names"].add(entries[forced["index"]].name)
        return entries[forced["index"]]

    monkeypatch.setattr(flashkiln.tile_choice, "choose", choose)
    seed = seed_of("hopper-tunings", d, causal, sq, sk)
    q, k, v = _inputs(seed, 2, 6, 2, sq, sk, d, torch.bfloat16)
    while True:
        flashkiln.forward.PLANS.clear()  # plan again with the next tuning
        _check_forward(q, k, v, causal, None, _repro("test_each_tuning_of_a_variant", seed=seed, d=d, causal=causal,
                                                     sq=sq, sk=sk, tuning=forced["index"]), backend="hopper")
        forced["index"] += 1
        if forced["index"] >= forced["count"]:
            break
    if forced["count"] == 0:
        pytest.skip(f"d {d}: one tuning in this build, covered by the other tests")
    assert len(forced["names"]) == forced["count"], forced


@pytest.mark.parametrize("causal", [None, "top_left"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_row_maxima_growing_across_key_tiles(d, causal):
    """Even query rows see scores rising by about 40 (log2 units) from the last key to the first
    (key tiles run last to first, so the running maximum grows at every tile, by less or more
    than the lazy rescaling's slack of 8); odd rows see flat scores: O's rescaling (eager at d 64,
    lazy above, hopper/fwd_traits.hpp) in warps whose rows disagree."""
    seed = seed_of("hopper-growing", d, causal)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = 1100
    q = torch.zeros(1, 2, s, d, device="cuda")
    q[:, :, ::2, 0] = 1.0
    k = 0.1 * torch.randn(1, 2, s, d, device="cuda", generator=gen)
    k[..., 0] = torch.linspace(40, 0, s, device="cuda") * d**0.5 / 1.4426950408889634
    v = torch.randn(1, 2, s, d, device="cuda", generator=gen)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    _check_forward(q, k, v, causal, None, _repro("test_row_maxima_growing_across_key_tiles", seed=seed, d=d,
                                                 causal=causal), backend="hopper")
