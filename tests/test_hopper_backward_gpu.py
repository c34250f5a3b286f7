"""The Hopper backward on the GPU: both families forced by `backend=`, each against the fp32
reference (FA-style(3)) and against each other; NaN-poisoned gradient buffers with canaries; its
deterministic mode bitwise reproducible; which family auto takes, and where it falls back.
"""
from __future__ import annotations

import dataclasses
import threading
from functools import partial

import pytest
import torch

import flashkiln
from backward_log import backward_plans
from reference import GRAD_FLOOR, attention_grad_reference, check_grads_against, repro_line, seed_of

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_hopper_backward_gpu.py")

FAMILIES = ("hopper", "portable")
CAUSAL = (None, "top_left", "bottom_right")
SEQLENS = [(1, 1), (2, 2), (7, 7), (17, 17), (113, 113), (129, 129), (1, 300), (300, 1), (17, 129), (129, 17),
           (1000, 1000), (1023, 300), (300, 1023), (2048, 2048)]


@pytest.fixture(autouse=True)
def _needs_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper family runs on compute capability 9.0")


# Every head dim (d_qk, d_v) of specs/hopper.yaml's backward: split by keys (64, 96, 128) or by
# columns (192/128, 256).
DIMS = (64, 96, 128, (192, 128), 256)


def _dims_id(d) -> str:
    return f"d{d[0]}x{d[1]}" if isinstance(d, tuple) else f"d{d}"


def _tensors(seed: int, b: int, hq: int, hkv: int, sq: int, sk: int, d: int | tuple[int, int], dtype: torch.dtype):
    """q, k, v, dout; `d`: one head dim, or (d_qk, d_v)."""
    d_qk, d_v = d if isinstance(d, tuple) else (d, d)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h, s, dim: torch.randn(b, h, s, dim, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    return make(hq, sq, d_qk), make(hkv, sk, d_qk), make(hkv, sk, d_v), make(hq, sq, d_v)


def _peak_memory(call) -> tuple[int, tuple]:
    """The bytes `call` allocates at its peak above what was allocated before it, and its result."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


def _backward(dout, q, k, v, causal, backend, route=None, **kw):
    """Gradients written into NaN buffers framed by NaN canary rows; the family that ran them (and
    the dq route, where `route` names the one expected)."""
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, **{n: kw[n] for n in ("bias", "sink") if n in kw})
    storages = [torch.full((*t.shape[:2], t.shape[2] + 2, t.shape[3]), float("nan"), device="cuda", dtype=t.dtype)
                for t in (q, k, v)]
    with backward_plans() as plans:
        grads = flashkiln.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend,
                                             dq=storages[0][:, :, 1:-1], dk=storages[1][:, :, 1:-1],
                                             dv=storages[2][:, :, 1:-1], **kw)
    torch.cuda.synchronize()
    for storage in storages:
        assert torch.isnan(storage[:, :, 0]).all() and torch.isnan(storage[:, :, -1]).all(), "canary overwritten"
    families = {plan.family for plan in plans}
    assert len(families) == 1, plans
    if route is not None:
        assert {plan.route for plan in plans} == {route}, plans
    return grads, families.pop()


def _check_both(q, k, v, dout, causal, repro, **kw):
    """Each family against the references, then hopper against portable within FA-style(3). `kw`:
    attention_backward's bias, bias_grad, sink and sink_grad."""
    scores = {n: kw.get(n) for n in ("bias", "sink")}
    unasked = {grad: None for grad, flag in (("dbias", "bias_grad"), ("dsink", "sink_grad")) if not kw.get(flag)}
    ref32, reflp = (dataclasses.replace(attention_grad_reference(q, k, v, dout, causal, None, dtype, **scores),
                                        **unasked) for dtype in (torch.float32, q.dtype))
    results = {}
    for family in FAMILIES:
        grads, ran = _backward(dout, q, k, v, causal, family, **kw)
        assert ran == family
        check_grads_against(grads, ref32, reflp, f"{repro} backend={family}")
        results[family] = grads
    for name, hopper, portable, r32, rlp in zip(("dq", "dk", "dv"), results["hopper"], results["portable"],
                                                (ref32.dq, ref32.dk, ref32.dv), (reflp.dq, reflp.dk, reflp.dv)):
        # The two families agree within FA-style(3)'s bound.
        err = (hopper.float() - portable.float()).abs().max().item()
        bound = 3 * (rlp.float() - r32.float()).abs().max().item() + GRAD_FLOOR
        assert err <= bound, f"{name}: max|hopper - portable| = {err:.3g} exceeds {bound:.3g}\n{repro}"


@pytest.mark.parametrize("d", DIMS, ids=_dims_id)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_sweep_gqa_bf16(sq, sk, causal, d):
    seed = seed_of("hopper-bwd", sq, sk, causal, d)
    q, k, v, dout = _tensors(seed, 2, 6, 2, sq, sk, d, torch.bfloat16)
    _check_both(q, k, v, dout, causal, _repro("test_sweep_gqa_bf16", seed=seed, sq=sq, sk=sk, causal=causal, d=d))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", DIMS, ids=_dims_id)
def test_heads_and_fp16(d, causal, hq, hkv):
    seed = seed_of("hopper-bwd-heads", d, causal, hq, hkv)
    q, k, v, dout = _tensors(seed, 3, hq, hkv, 777, 555, d, torch.float16)
    _check_both(q, k, v, dout, causal, _repro("test_heads_and_fp16", seed=seed, d=d, causal=causal, hq=hq, hkv=hkv))


def test_rows_without_keys_get_zero_dq():
    seed = seed_of("hopper-no-keys")
    q, k, v, dout = _tensors(seed, 1, 2, 2, 300, 100, 128, torch.bfloat16)
    (dq, dk, dv), family = _backward(dout, q, k, v, "bottom_right", "hopper")
    assert (dq[:, :, :200] == 0).all()
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


def test_layouts_strides_and_lse_gradient():
    """(B, S, H, D) inputs, a non-contiguous dout and an LSE gradient, against the portable family."""
    seed = seed_of("hopper-layout")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, s, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
               for s in (333, 444, 444))
    dout = torch.randn(2, 4, 128, 333, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(2, 3)
    out, lse = flashkiln.attention_forward(q, k, v, causal="top_left", scale=0.2)
    dlse = torch.randn(lse.shape, device="cuda", generator=gen)
    grads = {family: flashkiln.attention_backward(dout, q, k, v, out, lse, dlse=dlse, causal="top_left", scale=0.2,
                                                  backend=family) for family in FAMILIES}
    for hopper, portable, inp in zip(grads["hopper"], grads["portable"], (q, k, v)):
        assert hopper.stride() == inp.stride()
        torch.testing.assert_close(hopper, portable, atol=2e-2, rtol=2e-2)


def _auto_family(**kw) -> str:
    seed = seed_of("hopper-auto", sorted(kw))
    d = kw.pop("d", 128)
    q, k, v, dout = _tensors(seed, 1, 2, 2, 200, 200, d, torch.bfloat16)
    if kw.pop("with_bias", False):
        kw["bias"] = torch.randn(1, 1, 200, 200, device="cuda", dtype=torch.bfloat16)
    if kw.pop("with_sink", False):
        kw["sink"] = torch.randn(2, device="cuda")
    _, family = _backward(dout, q, k, v, None, None, **kw)
    return family


@pytest.mark.parametrize("kw, family", [
    ({}, "hopper"),
    ({"d": 64}, "hopper"),
    ({"d": 96}, "hopper"),  # 64-byte swizzled boxes
    ({"d": 96, "with_bias": True, "bias_grad": True}, "hopper"),
    ({"d": (192, 128)}, "hopper"),  # split columns, d_qk 192 in 64-byte swizzled boxes
    ({"d": 256}, "hopper"),
    ({"d": 256, "with_bias": True, "bias_grad": True}, "hopper"),  # split columns: dBias's key sums joined
    ({"deterministic": True}, "hopper"),
    ({"with_bias": True}, "hopper"),
    ({"with_bias": True, "bias_grad": True}, "hopper"),  # dBias of a key-varying bias: dS stored
    ({"with_sink": True}, "hopper"),     # the kernels read the LSE, which holds the sink
    ({"with_sink": True, "sink_grad": True}, "hopper"),
])
def test_auto_takes_hopper_where_it_has_the_call(kw, family):
    assert _auto_family(**kw) == family


def test_a_thread_without_a_current_context_plans_the_hopper_family_too():
    """Autograd runs backwards on threads of its own, where the driver may have no current context
    until something binds one; planning encodes tensor maps through the driver, so a plan made
    there must bind it first, not fall back to the portable family (and cache that plan)."""
    from cuda.bindings import driver as cu

    from flashkiln import tma

    q, k, v, dout = _tensors(5, 1, 4, 4, 333, 333, 64, torch.bfloat16)
    seen: dict = {}

    def fresh_thread():
        try:
            seen["context"] = int(cu.cuCtxGetCurrent()[1])
            tma._encoded.cache_clear()  # maps encoded earlier on this process's main thread
            with backward_plans() as plans:
                out, lse = flashkiln.attention_forward(q, k, v)
                flashkiln.attention_backward(dout, q, k, v, out, lse)
            seen["forward"] = flashkiln.forward.PLANS.newest().family
            seen["backward"] = [plan.family for plan in plans]
        except BaseException as exc:  # noqa: BLE001 (raised again on the test's thread)
            seen["error"] = exc

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    if "error" in seen:
        raise seen["error"]
    assert seen["context"] == 0, "the precondition: a new thread starts without a current context"
    assert (seen["forward"], seen["backward"]) == ("hopper", ["hopper"])


# Without a mask, (1500, 700) and (2048, 2048) stagger the key tiles' sweeps at every head dim (as
# many query tiles as key tiles or more), which wrap past the last query tile.
DETERMINISTIC_SHAPES = [(1, 1, 2, 2), (2, 7, 2, 2), (17, 129, 6, 2), (113, 113, 4, 4), (129, 17, 6, 1),
                        (1000, 1100, 6, 2), (1023, 300, 4, 4), (300, 1023, 6, 2), (1500, 700, 4, 2),
                        (2048, 2048, 4, 1)]


def _deterministic_runs(q, k, v, dout, causal, runs, **kw):
    """`runs` deterministic hopper backwards into fresh NaN buffers; each must equal the first bitwise."""
    first, _ = _backward(dout, q, k, v, causal, "hopper", route="ordered", deterministic=True, **kw)
    for _ in range(runs - 1):
        again, _ = _backward(dout, q, k, v, causal, "hopper", route="ordered", deterministic=True, **kw)
        for index, (a, b) in enumerate(zip(first, again)):
            assert torch.equal(a, b), f"output {index} differs between deterministic runs"
    return first


@pytest.mark.parametrize("d", DIMS, ids=_dims_id)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sq,sk,hq,hkv", DETERMINISTIC_SHAPES)
def test_deterministic_is_bitwise_reproducible(sq, sk, hq, hkv, causal, d):
    """20 runs of the ordered dQ route give identical dq, dk, dv, which match the references."""
    seed = seed_of("hopper-det", sq, sk, hq, hkv, causal, d)
    q, k, v, dout = _tensors(seed, 2, hq, hkv, sq, sk, d, torch.bfloat16)
    grads = _deterministic_runs(q, k, v, dout, causal, 20)
    check_grads_against(grads, attention_grad_reference(q, k, v, dout, causal, None, torch.float32),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype),
                        _repro("test_deterministic_is_bitwise_reproducible", seed=seed, sq=sq, sk=sk, hq=hq, hkv=hkv,
                               causal=causal, d=d))


@pytest.mark.parametrize("d", (128, (192, 128), 256), ids=_dims_id)
@pytest.mark.parametrize("causal", CAUSAL)
def test_deterministic_with_sink_gradient_and_fp16(causal, d):
    """GQA with sinks and dSink in fp16: dq, dk, dv and dsink bitwise equal over 20 runs, and close
    to the atomic route's."""
    seed = seed_of("hopper-det-sink", causal, d)
    q, k, v, dout = _tensors(seed, 2, 6, 2, 700, 900, d, torch.float16)
    sink = torch.randn(6, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    ordered = _deterministic_runs(q, k, v, dout, causal, 20, sink=sink, sink_grad=True)
    atomic, _ = _backward(dout, q, k, v, causal, "hopper", route="atomic", sink=sink, sink_grad=True)
    for a, b in zip(ordered, atomic):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


# Every broadcast shape of a bias over (B, H_q, S_q, S_k): "1" where it broadcasts.
BIAS_SHAPES = [f"{b}{h}{q}{k}" for b in "b1" for h in "h1" for q in "q1" for k in "k1"]


@pytest.mark.parametrize("d", DIMS, ids=_dims_id)
@pytest.mark.parametrize("causal", (None, "bottom_right"))
@pytest.mark.parametrize("shape", BIAS_SHAPES)
def test_every_bias_shape_with_gqa_and_sinks(shape, causal, d):
    """A bias of each broadcast shape with dBias (a closed form where it is key-constant, else from
    the dS the kernels store), GQA 6/2 and sinks with dSink on alternate shapes; a row the bias
    masks out entirely where it has rows."""
    seed = seed_of("hopper-bias", shape, causal, d)
    q, k, v, dout = _tensors(seed, 2, 6, 2, 129, 200, d, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sizes = dict(zip("bhqk", (2, 6, 129, 200)), **{"1": 1})
    bias = 2 * torch.randn(tuple(sizes[c] for c in shape), device="cuda", dtype=torch.bfloat16, generator=gen)
    if shape[2] == "q" and shape[3] == "k":
        bias[..., 7, :] = float("-inf")
    kw = {"bias": bias, "bias_grad": True}
    if BIAS_SHAPES.index(shape) % 2:
        kw.update(sink=torch.randn(6, device="cuda", generator=gen), sink_grad=True)
    _check_both(q, k, v, dout, causal, _repro("test_every_bias_shape_with_gqa_and_sinks", seed=seed, shape=shape,
                                             causal=causal, d=d), **kw)


def test_a_biased_backward_is_bitwise_reproducible():
    seed = seed_of("hopper-bias-det")
    q, k, v, dout = _tensors(seed, 2, 6, 2, 500, 700, 128, torch.bfloat16)
    bias = torch.randn(2, 1, 500, 700, device="cuda", dtype=torch.bfloat16)
    first, _ = _backward(dout, q, k, v, "top_left", "hopper", route="ordered", bias=bias, deterministic=True)
    for _ in range(19):
        again, _ = _backward(dout, q, k, v, "top_left", "hopper", bias=bias, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("d", (64, 128, (192, 128), 256), ids=_dims_id)
@pytest.mark.parametrize("shape, causal", [("11qk", None), ("1hqk", "bottom_right"), ("b1qk", None),
                                           ("bh1k", "bottom_right"), ("111k", None)])
def test_a_broadcast_dbias_is_reduced_in_the_kernel(shape, causal, d):
    """dBias of a bias shared over batch entries, heads or rows comes from the kernel's own sums
    (flashkiln.bias.reduction), not from a dense (B, H, S_q, S_k) dS: dBias adds less than half that
    dS's size to the peak memory of the unbiased deterministic backward (the same GQA accumulators;
    its gradients and fp32 accumulators alone outweigh a dS at d 192 and 256); 20 deterministic
    runs are bitwise equal; a call that is not deterministic gives the same dBias where the bias is
    broadcast over rows, or where bwd_dbias sums it (shared by batch entries or heads at d 64, by
    batch entries alone at d 128; elsewhere the main kernel adds the pairs' dS in any order); both
    match the references. At this shape bwd_dbias's CTAs take several tiles each where a tile has 8
    members (its persistent grid: "1h" and "b1"), and one each where it has 64 ("11"). At d 256
    both consumer warpgroups hold every key (split columns), and a row-broadcast bias's key sums
    join before one thread adds them."""
    b, hq, hkv, sq, sk = 8, 8, 2, 1024, 1000
    seed = seed_of("hopper-dbias-reduced", shape, causal, d)
    q, k, v, dout = _tensors(seed, b, hq, hkv, sq, sk, d, torch.bfloat16)
    sizes = dict(zip("bhqk", (b, hq, sq, sk)), **{"1": 1})
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bias = torch.randn(tuple(sizes[c] for c in shape), device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, bias=bias)
    call = partial(flashkiln.attention_backward, dout, q, k, v, out, lse, causal=causal, bias=bias, bias_grad=True,
                   backend="hopper", deterministic=True)
    unbiased = partial(flashkiln.attention_backward, dout, q, k, v, out, lse, causal=causal, deterministic=True,
                       backend="hopper")
    unbiased_peak, _ = _peak_memory(unbiased)
    peak, first = _peak_memory(call)
    dense_ds = b * hq * sq * sk * 2
    assert peak - unbiased_peak < dense_ds / 2, (f"dBias adds {(peak - unbiased_peak) / 2**20:.0f} MiB to the "
                                                 f"backward's peak; a dense dS alone is {dense_ds / 2**20:.0f} MiB")
    for _ in range(19):
        again = call()
        assert all(torch.equal(x, y) for x, y in zip(first, again)), "runs differ"
    unordered = call(deterministic=False)
    # Row-broadcast: one adder per address on either route; shared by batch entries or heads at d
    # 64, by batch entries alone at d 128 (hopper_family.dbias_kernel): bwd_dbias sums each tile in
    # one CTA.
    if shape[2] == "1" or d == 64 or (d == 128 and shape[:2] == "1h"):
        assert torch.equal(unordered[3], first[3]), "dBias differs without deterministic=True"
    refs = [attention_grad_reference(q, k, v, dout, causal, None, dtype, bias=bias) for dtype in (torch.float32,
                                                                                                 q.dtype)]
    repro = _repro("test_a_broadcast_dbias_is_reduced_in_the_kernel", shape=shape, causal=causal, d=d)
    check_grads_against(first, *refs, repro)
    check_grads_against(unordered, *refs, repro)
