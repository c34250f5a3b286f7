"""Sliding-window (local) attention, window_size=(left, right) as FlashAttention's, on the GPU:
forward (O, LSE) and backward (dq, dk, dv, dsink, dbias) of both kernel families against the
fp32 reference (FA-style(2) and (3), shared/CONVENTIONS.md) and against each other, with causal
masks, S_q != S_k both ways (rows that see no key), GQA, sinks and a bias, packed batches with empty
sequences, the deterministic backward, autograd through the SDPA drop-in and varlen_attention,
and the typed errors of malformed windows.

Query row i of a sequence sees key j iff 0 <= j < S_k and i + off - left <= j <= i + off + right
(off = S_k - S_q, or 0 under "top_left"; -1 leaves a side unbounded; a causal mask sets right to
0): tests/reference.py's visible_mask. Outputs and gradients are written into NaN-poisoned
buffers framed by NaN canaries; inputs are fresh random tensors from a printed seed. Top-left
windows run on the same kernels as bottom-right ones (the alignment is a run-time value), so
every case runs on both families.

The CPU tests at the top check the reference's window rule itself (no GPU needed); everything
else carries the gpu marker.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

import flashkiln
from backward_log import backward_plans
from reference import (GRAD_FLOOR, attention_grad_reference, attention_reference,
                       check_grads_against, fa_style_check, repro_line, seed_of, visible_mask)
from test_backward_gpu import _forced_route
from test_varlen_gpu import Packed, _reference_forward, _reference_grads, _token_tensor

gpu = pytest.mark.gpu
_repro = partial(repro_line, "test_window_gpu.py")

FAMILIES = ("hopper", "portable")
CAUSAL = (None, "bottom_right", "top_left")
DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# Left only, right only, both, a single key, wider than every sequence, and edges off the tile grid.
WINDOWS = [(32, -1), (-1, 16), (48, 16), (0, 0), (4096, 4096), (127, 64)]
# S in {1, 2, 7, 17, 113, 129, 300}, square and S_q != S_k both ways; each pair with one of the
# four (head dim, dtype) pairs in turn, so that every window and causal mode meets all four.
_PAIRS = [(1, 1), (2, 2), (7, 7), (17, 17), (113, 113), (129, 129), (300, 300), (1, 129),
          (129, 1), (7, 300), (300, 7), (17, 113), (113, 17), (129, 300), (300, 129), (2, 300)]
_DIMS_DTYPES = [(64, torch.bfloat16), (128, torch.float16), (64, torch.float16), (128, torch.bfloat16)]
SWEEP = [(sq, sk, *_DIMS_DTYPES[n % 4]) for n, (sq, sk) in enumerate(_PAIRS)]


def _window_id(w) -> str:
    return "none" if w is None else f"w{w[0]}_{w[1]}"


def _sweep_id(case) -> str:
    sq, sk, d, dtype = case
    return f"{sq}x{sk}-d{d}-{DTYPE_IDS[dtype]}"


# -- the reference's window rule (CPU) ------------------------------------------------------------

def _by_element(sq: int, sk: int, causal, window) -> torch.Tensor:
    """The window rule written out per element, from the API's description."""
    seen = torch.zeros(sq, sk, dtype=torch.bool)
    left, right = window
    if causal is not None:
        right = 0
    off = 0 if causal == "top_left" else sk - sq
    for i in range(sq):
        for j in range(sk):
            seen[i, j] = (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
    return seen


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", WINDOWS + [(-1, 0), (0, -1), (3, 1), (1, 3), (-1, -1)], ids=_window_id)
@pytest.mark.parametrize("sq,sk", [(1, 1), (2, 7), (7, 2), (17, 17), (5, 40), (40, 5)])
def test_reference_window_mask_is_the_rule(sq, sk, window, causal):
    mask = visible_mask(sq, sk, causal, torch.device("cpu"), window=window)
    full = torch.ones(sq, sk, dtype=torch.bool)
    got = full if mask is None else mask
    assert torch.equal(got, _by_element(sq, sk, causal, window)), (sq, sk, window, causal)
    # No window and (-1, -1) leave the causal masks as they were.
    if window == (-1, -1):
        plain = visible_mask(sq, sk, causal, torch.device("cpu"))
        assert (mask is None) == (plain is None) and (plain is None or torch.equal(mask, plain))


def test_reference_window_examples():
    """Hand-written cases: bottom-right alignment without a causal mask, causal forcing right = 0,
    top-left alignment, and rows that see no key."""
    cpu = torch.device("cpu")
    t = lambda rows: torch.tensor(rows, dtype=torch.bool)  # noqa: E731
    # S_q 3, S_k 5, off 2: row i sees keys i + 1 .. i + 2.
    assert torch.equal(visible_mask(3, 5, None, cpu, window=(1, 0)),
                       t([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]))
    # A causal mask ignores right = 2.
    assert torch.equal(visible_mask(3, 5, "bottom_right", cpu, window=(1, 2)), visible_mask(3, 5, None, cpu,
                                                                                            window=(1, 0)))
    # top_left: row i sees keys i - 1 .. i.
    assert torch.equal(visible_mask(3, 5, "top_left", cpu, window=(1, 7)),
                       t([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0]]))
    # S_q 4, S_k 2, off -2, window (0, 0): rows 0 and 1 see nothing, row 2 key 0, row 3 key 1.
    assert torch.equal(visible_mask(4, 2, None, cpu, window=(0, 0)), t([[0, 0], [0, 0], [1, 0], [0, 1]]))
    # Right only, no causal mask: row i sees keys up to i + off + 1.
    assert torch.equal(visible_mask(2, 4, None, cpu, window=(-1, 1)), t([[1, 1, 1, 1], [1, 1, 1, 1]]))
    assert torch.equal(visible_mask(2, 4, None, cpu, window=(-1, 0)), visible_mask(2, 4, "bottom_right", cpu))


def test_reference_window_equals_the_same_bool_bias():
    """attention_reference with a window is the same math as with the window's mask as a bias; rows
    that see no key get O = 0, LSE = -inf and zero gradients (no NaN)."""
    gen = torch.Generator().manual_seed(seed_of("ref-window-bias"))
    q, dout = torch.randn(2, 4, 40, 16, generator=gen), torch.randn(2, 4, 40, 16, generator=gen)
    k, v = torch.randn(2, 2, 9, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen)
    window = (2, 1)
    mask = visible_mask(40, 9, None, q.device, window=window)
    windowed = attention_reference(q, k, v, None, None, torch.float32, window=window)
    biased = attention_reference(q, k, v, None, None, torch.float32, bias=mask)
    assert torch.equal(windowed.out, biased.out) and torch.equal(windowed.lse, biased.lse)
    assert torch.equal(windowed.empty_rows[0, 0], ~mask.any(1))
    assert windowed.empty_rows.any() and (windowed.out[windowed.empty_rows] == 0).all()
    assert torch.isneginf(windowed.lse[windowed.empty_rows]).all()
    grads = attention_grad_reference(q, k, v, dout, None, None, torch.float32, window=window)
    assert not any(torch.isnan(g).any() for g in (grads.dq, grads.dk, grads.dv))
    assert (grads.dq[windowed.empty_rows] == 0).all()
    assert torch.equal(grads.dk, attention_grad_reference(q, k, v, dout, None, None, torch.float32, bias=mask).dk)


# -- helpers (GPU) ------------------------------------------------------------------------------

def _on_hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _families() -> tuple[str, ...]:
    """Both families on compute capability 9.0 (the hopper one runs there only), else portable."""
    return FAMILIES if _on_hopper() else ("portable",)


def _tensors(seed: int, b: int, hq: int, hkv: int, sq: int, sk: int, d: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h, s: torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    return make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq), gen


def _framed_nan(shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN (B, H, S, d) buffer inside storage with a NaN canary row on each side: (storage, view)."""
    b, h, s, d = shape
    storage = torch.full((b, h, s + 2, d), float("nan"), device="cuda", dtype=dtype)
    return storage, storage[:, :, 1:-1]


def _canaries_intact(storage: torch.Tensor) -> bool:
    return bool(torch.isnan(storage[:, :, 0]).all() and torch.isnan(storage[:, :, -1]).all())


def _forward(q, k, v, causal, window, backend, repro, sink=None, bias=None):
    """attention_forward into NaN-filled out and lse framed by NaN canaries."""
    out_storage, out = _framed_nan((*q.shape[:3], v.shape[3]), q.dtype)
    lse_storage = torch.full((q.shape[0] * q.shape[1] * q.shape[2] + 2,), float("nan"), device="cuda")
    lse = lse_storage[1:-1].view(q.shape[:3])
    got_out, got_lse = flashkiln.attention_forward(q, k, v, causal=causal, sink=sink, bias=bias, window_size=window,
                                                   out=out, lse=lse, backend=backend)
    torch.cuda.synchronize()
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr(), repro
    assert _canaries_intact(out_storage), f"canary rows around out were overwritten\n{repro}"
    assert torch.isnan(lse_storage[0]) and torch.isnan(lse_storage[-1]), \
        f"canaries around lse were overwritten\n{repro}"
    return got_out, got_lse


def _backward(dout, q, k, v, out, lse, causal, window, backend, repro, route=None, **kw):
    """attention_backward into NaN-filled dq, dk, dv framed by NaN canaries; checks that `backend`
    (and `route`, where given) ran it."""
    storages, buffers = zip(*(_framed_nan(t.shape, t.dtype) for t in (q, k, v)))
    with backward_plans() as plans:
        grads = flashkiln.attention_backward(dout, q, k, v, out, lse, causal=causal, window_size=window,
                                             backend=backend, dq=buffers[0], dk=buffers[1], dv=buffers[2], **kw)
    torch.cuda.synchronize()
    assert all(_canaries_intact(s) for s in storages), f"canary rows around dq, dk or dv were overwritten\n{repro}"
    assert all(g.data_ptr() == b.data_ptr() for g, b in zip(grads, buffers)), repro
    assert plans and {p.family for p in plans} == {backend}, f"expected the {backend} family, planned {plans}\n{repro}"
    if route is not None:
        assert {p.route for p in plans} == {route}, f"expected dq route {route}, planned {plans}\n{repro}"
    return grads


def _check_agree(name: str, a: torch.Tensor, b: torch.Tensor, ref32: torch.Tensor, reflp: torch.Tensor, k: float,
                 floor: float, repro: str) -> None:
    """The two families agree within FA-style(k)'s bound: max|a - b| <= k * max|REFLP - REF32| + floor
    (infinite reference entries equal in both)."""
    a, b, ref32, reflp = a.float(), b.float(), ref32.float(), reflp.float()
    finite = torch.isfinite(ref32)
    assert torch.equal(a[~finite], b[~finite]), f"{name}: the families differ where the reference is infinite\n{repro}"
    if not finite.any():
        return
    err = (a[finite] - b[finite]).abs().max().item()
    bound = k * (reflp[finite] - ref32[finite]).abs().max().item() + floor
    assert err <= bound, f"{name}: max|hopper - portable| = {err:.3g} exceeds {bound:.3g}\n{repro}"


def _check_families(q, k, v, dout, causal, window, repro, sink=None, bias=None,
                    families: tuple[str, ...] | None = None) -> None:
    """Forward and backward of each family (`families`, by default _families()) against REF32/REFLP
    (FA-style(2) for O and LSE, (3) for dq, dk, dv, dbias and dsink), exact zeros where nothing is
    visible, then hopper against portable (dbias where `bias` is given)."""
    ref32 = attention_reference(q, k, v, causal, None, torch.float32, bias, sink, window=window)
    reflp = attention_reference(q, k, v, causal, None, q.dtype, bias, sink, window=window)
    grad32 = attention_grad_reference(q, k, v, dout, causal, None, torch.float32, bias, sink, window=window)
    gradlp = attention_grad_reference(q, k, v, dout, causal, None, q.dtype, bias, sink, window=window)
    mask = visible_mask(q.shape[2], k.shape[2], causal, q.device, window=window)
    unseen_keys = torch.zeros(k.shape[2], dtype=torch.bool, device="cuda") if mask is None else ~mask.any(0)
    empty = ref32.empty_rows
    extra = {} if sink is None else {"sink": sink, "sink_grad": True}
    if bias is not None:
        extra.update(bias=bias, bias_grad=True)
    results = {}
    for family in families or _families():
        r = f"{repro} backend={family}"
        out, lse = _forward(q, k, v, causal, window, family, r, sink, bias)
        fa_style_check("out", out, ref32.out, reflp.out, 2, r)
        fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, r)
        # Rows that see no key: exactly O = 0, and LSE = -inf (checked above) or the sink.
        assert (out[empty] == 0).all(), f"rows that see no key are not 0\n{r}"
        if sink is not None:
            assert torch.equal(lse[empty], sink.float()[None, :, None].expand_as(lse)[empty]), \
                f"rows that see no key: LSE is not the sink\n{r}"
        grads = _backward(dout, q, k, v, out, lse, causal, window, family, r, **extra)
        check_grads_against(grads, grad32, gradlp, r)
        dq, dk, dv = grads[:3]
        assert (dq[empty] == 0).all(), f"dq rows of queries that see no key are not 0\n{r}"
        assert (dk[:, :, unseen_keys] == 0).all() and (dv[:, :, unseen_keys] == 0).all(), \
            f"dk/dv rows of keys no query sees are not 0\n{r}"
        results[family] = (out, lse, *grads)
    if len(results) == 2:  # hopper against portable, where both run (compute capability 9.0)
        names = ["out", "lse", "dq", "dk", "dv"] + ([] if bias is None else ["dbias"]) + \
            ([] if sink is None else ["dsink"])
        refs32 = [ref32.out, ref32.lse, grad32.dq, grad32.dk, grad32.dv] + \
            [r for r in (grad32.dbias, grad32.dsink) if r is not None]
        refslp = [reflp.out, reflp.lse, gradlp.dq, gradlp.dk, gradlp.dv] + \
            [r for r in (gradlp.dbias, gradlp.dsink) if r is not None]
        for n, name in enumerate(names):
            k_rule, floor = (2, 1e-5) if n < 2 else (3, GRAD_FLOOR)
            _check_agree(name, results["hopper"][n], results["portable"][n], refs32[n], refslp[n], k_rule, floor,
                         repro)


# -- dense batches ------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", WINDOWS, ids=_window_id)
@pytest.mark.parametrize("case", SWEEP, ids=_sweep_id)
def test_forward_and_backward(case, window, causal):
    """Every window shape and causal mode over tails, S_q != S_k both ways (rows that see no key,
    keys no query sees), head dims 64 and 128, fp16 and bf16, GQA 4/2: both families against
    the references and each other."""
    sq, sk, d, dtype = case
    seed = seed_of("window", sq, sk, d, dtype, window, causal)
    q, k, v, dout, _ = _tensors(seed, 2, 4, 2, sq, sk, d, dtype)
    _check_families(q, k, v, dout, causal, window,
                    _repro("test_forward_and_backward", seed=seed, sq=sq, sk=sk, d=d, dtype=dtype, window=window,
                           causal=causal))


@gpu
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(32, -1), (-1, 16), (48, 16), (0, 0), (127, 64)], ids=_window_id)
@pytest.mark.parametrize("sq,sk,dtype", [(1, 1, torch.bfloat16), (17, 113, torch.float16), (113, 17, torch.bfloat16),
                                         (129, 300, torch.float16), (300, 129, torch.bfloat16)],
                         ids=lambda x: DTYPE_IDS.get(x, str(x)))
def test_head_dim_256(sq, sk, dtype, window, causal):
    """d 256 (Gemma 2 and 3), which the hopper family alone generates (its backward splits the
    columns of dK and dV between the consumers): against the references, GQA 4/2."""
    if not _on_hopper():
        pytest.skip("windows at d 256 are generated for the hopper family (compute capability 9.0) only")
    seed = seed_of("window-d256", sq, sk, dtype, window, causal)
    q, k, v, dout, _ = _tensors(seed, 2, 4, 2, sq, sk, 256, dtype)
    _check_families(q, k, v, dout, causal, window,
                    _repro("test_head_dim_256", seed=seed, sq=sq, sk=sk, dtype=dtype, window=window, causal=causal),
                    families=("hopper",))


@gpu
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(32, -1), (48, 16), (0, 0)], ids=_window_id)
@pytest.mark.parametrize("sq,sk,d,dtype", [(129, 300, 64, torch.bfloat16), (300, 129, 128, torch.float16),
                                           (17, 17, 128, torch.bfloat16)],
                         ids=lambda x: DTYPE_IDS.get(x, str(x)))
def test_gqa_with_sinks(sq, sk, d, dtype, window, causal):
    """GQA 4/2 with fp32 sink logits and a window: O, the sink-inclusive LSE (the sink itself for
    rows that see no key), dq, dk, dv and dsink, both families."""
    seed = seed_of("window-sinks", sq, sk, d, dtype, window, causal)
    q, k, v, dout, gen = _tensors(seed, 2, 4, 2, sq, sk, d, dtype)
    sink = 2.0 * torch.randn(4, device="cuda", generator=gen) + 1.0
    _check_families(q, k, v, dout, causal, window,
                    _repro("test_gqa_with_sinks", seed=seed, sq=sq, sk=sk, d=d, dtype=dtype, window=window,
                           causal=causal), sink=sink)


@gpu
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("backend", FAMILIES)
def test_unbounded_window_is_the_plain_call_bitwise(backend, causal):
    """window_size=(-1, -1) and None are no window: forward and deterministic backward bitwise equal
    to the call without window_size."""
    if backend == "hopper" and not _on_hopper():
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    seed = seed_of("window-unbounded", backend, causal)
    q, k, v, dout, _ = _tensors(seed, 2, 4, 2, 129, 300, 128, torch.bfloat16)
    repro = _repro("test_unbounded_window_is_the_plain_call_bitwise", seed=seed, backend=backend, causal=causal)
    plain = flashkiln.attention_forward(q, k, v, causal=causal, backend=backend)
    plain_grads = flashkiln.attention_backward(dout, q, k, v, *plain, causal=causal, backend=backend,
                                               deterministic=True)
    for window in (None, (-1, -1)):
        r = f"{repro} window={window}"
        out, lse = _forward(q, k, v, causal, window, backend, r)
        assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1]), f"forward differs from no window\n{r}"
        grads = _backward(dout, q, k, v, out, lse, causal, window, backend, r, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), grads, plain_grads):
            assert torch.equal(a, b), f"{name} differs from no window\n{r}"


@gpu
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("backend", FAMILIES)
def test_lse_gradient(backend, causal):
    """An upstream LSE gradient (dlse) with a window: dq, dk, dv of O and LSE together, rows that see
    no key (S_q > S_k) taking none of it."""
    if backend == "hopper" and not _on_hopper():
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    seed = seed_of("window-dlse", backend, causal)
    q, k, v, dout, gen = _tensors(seed, 2, 4, 2, 300, 129, 128, torch.bfloat16)
    window = (48, 16)
    dlse = torch.randn(2, 4, 300, device="cuda", generator=gen)
    repro = _repro("test_lse_gradient", seed=seed, backend=backend, causal=causal)
    out, lse = _forward(q, k, v, causal, window, backend, repro)
    grads = _backward(dout, q, k, v, out, lse, causal, window, backend, repro, dlse=dlse)
    check_grads_against(grads, attention_grad_reference(q, k, v, dout, causal, None, torch.float32, dlse=dlse,
                                                        window=window),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype, dlse=dlse, window=window),
                        repro)


@gpu
def test_compiled_sdpa_matches_eager():
    """torch.compile(fullgraph=True) of the SDPA drop-in with a window (the custom ops' path) gives
    the eager results bitwise (deterministic backward), and those match the reference."""
    seed = seed_of("window-compile")
    q, k, v, dout, _ = _tensors(seed, 2, 4, 2, 200, 333, 64, torch.bfloat16)
    repro = _repro("test_compiled_sdpa_matches_eager", seed=seed)
    window = (32, 8)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, enable_gqa=True, window_size=window, deterministic=True)
        out.backward(dout)
        return out.detach(), *(t.grad for t in leaves)

    eager = run(flashkiln.scaled_dot_product_attention)
    compiled = run(torch.compile(flashkiln.scaled_dot_product_attention, fullgraph=True))
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, compiled):
        assert torch.equal(a, b), f"{name}: compiled differs from eager\n{repro}"
    fa_style_check("out", compiled[0], attention_reference(q, k, v, None, None, torch.float32, window=window).out,
                   attention_reference(q, k, v, None, None, q.dtype, window=window).out, 2, repro)
    check_grads_against(compiled[1:], attention_grad_reference(q, k, v, dout, None, None, torch.float32, window=window),
                        attention_grad_reference(q, k, v, dout, None, None, q.dtype, window=window), repro)


# (family, dq route) pairs with a deterministic route: the hopper family has "ordered", the
# portable one "ordered" and "workspace".
DETERMINISTIC = [("hopper", "ordered"), ("portable", "ordered"), ("portable", "workspace")]


@gpu
@pytest.mark.parametrize("sq,sk", [(700, 900), (900, 700)])
@pytest.mark.parametrize("window", [(48, 16), (300, -1), (0, 0)], ids=_window_id)
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("backend,route", DETERMINISTIC, ids=lambda x: str(x))
def test_deterministic_backward_is_bitwise_reproducible(backend, route, causal, window, sq, sk):
    """deterministic=True with a window: 20 backwards into freshly poisoned buffers give identical
    dq, dk, dv, which match the references (query tiles that meet no key tile, key tiles that no
    query tile visits, in the ordered dQ's turns)."""
    if backend == "hopper" and not _on_hopper():
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    seed = seed_of("window-det", backend, route, causal, window, sq, sk)
    q, k, v, dout, _ = _tensors(seed, 2, 6, 2, sq, sk, 128, torch.bfloat16)
    repro = _repro("test_deterministic_backward_is_bitwise_reproducible", seed=seed, backend=backend, route=route,
                   causal=causal, window=window, sq=sq, sk=sk)
    out, lse = _forward(q, k, v, causal, window, backend, repro)
    with _forced_route(route):
        first = _backward(dout, q, k, v, out, lse, causal, window, backend, repro, route=route, deterministic=True)
        for run in range(19):
            again = _backward(dout, q, k, v, out, lse, causal, window, backend, repro, route=route,
                              deterministic=True)
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert torch.equal(a, b), f"{name} differs between deterministic runs (run {run + 2})\n{repro}"
    check_grads_against(first, attention_grad_reference(q, k, v, dout, causal, None, torch.float32, window=window),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype, window=window), repro)


@gpu
@pytest.mark.parametrize("window", [(32, -1), (48, 16), (0, 0)], ids=_window_id)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sq,sk,d,dtype", [(129, 300, 64, torch.float16), (300, 129, 128, torch.bfloat16),
                                           (200, 200, 128, torch.float16)],
                         ids=lambda x: DTYPE_IDS.get(x, str(x)))
def test_sdpa_autograd(sq, sk, d, dtype, is_causal, window):
    """flashkiln.scaled_dot_product_attention(..., window_size=) forward and gradients through
    autograd (is_causal: top-left, as in PyTorch; without it the window is bottom-right aligned)."""
    seed = seed_of("window-sdpa", sq, sk, d, dtype, is_causal, window)
    q, k, v, dout, _ = _tensors(seed, 2, 4, 2, sq, sk, d, dtype)
    causal = "top_left" if is_causal else None
    repro = _repro("test_sdpa_autograd", seed=seed, sq=sq, sk=sk, d=d, dtype=dtype, is_causal=is_causal,
                   window=window)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashkiln.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=True, window_size=window)
    ref32 = attention_reference(q, k, v, causal, None, torch.float32, window=window)
    reflp = attention_reference(q, k, v, causal, None, q.dtype, window=window)
    fa_style_check("out", out.detach(), ref32.out, reflp.out, 2, repro)
    assert (out.detach()[ref32.empty_rows] == 0).all(), f"rows that see no key are not 0\n{repro}"
    out.backward(dout)
    check_grads_against([t.grad for t in leaves],
                        attention_grad_reference(q, k, v, dout, causal, None, torch.float32, window=window),
                        attention_grad_reference(q, k, v, dout, causal, None, q.dtype, window=window), repro)


@gpu
def test_ungenerated_head_dim_is_a_typed_error_or_correct():
    """A window at a head dim without window variants (256 in the portable family) is a typed
    flashkiln error, never a silent no-window run (or, where some build has it, correct)."""
    seed = seed_of("window-d256")
    q, k, v, _, _ = _tensors(seed, 1, 2, 2, 200, 200, 256, torch.bfloat16)
    repro = _repro("test_ungenerated_head_dim_is_a_typed_error_or_correct", seed=seed)
    try:
        out, lse = flashkiln.attention_forward(q, k, v, window_size=(16, 16), backend="portable")
    except flashkiln.FlashkilnError:
        return
    ref32 = attention_reference(q, k, v, None, None, torch.float32, window=(16, 16))
    reflp = attention_reference(q, k, v, None, None, q.dtype, window=(16, 16))
    fa_style_check("out", out, ref32.out, reflp.out, 2, repro)
    fa_style_check("lse", lse, ref32.lse, reflp.lse, 2, repro)


# -- packed batches -----------------------------------------------------------------------------

EXTRA = 5  # NaN tokens past the last sequence, inside the token tensors
# (query lengths, key lengths) per sequence: empty query and key sequences, single tokens, S_q > S_k
# (rows that see no key) and S_q < S_k, lengths off the tile grid; each sequence aligns its window
# with its own lengths.
PACKED_LENGTHS = {
    "mixed": ((130, 0, 17, 300, 1, 7), (200, 33, 0, 113, 129, 2)),
    "self": ((1, 129, 2, 0, 300, 17), (1, 129, 2, 0, 300, 17)),
}
PACKED_CASES = [("mixed", 128, torch.bfloat16), ("self", 64, torch.float16)]


def _packed(seed: int, lengths: str, hq: int, hkv: int, d: int, dtype: torch.dtype) -> Packed:
    lengths_q, lengths_k = PACKED_LENGTHS[lengths]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    storages: list[torch.Tensor] = []
    q, dout = (_token_tensor(sum(lengths_q), EXTRA, hq, d, gen, dtype, storages) for _ in range(2))
    k, v = (_token_tensor(sum(lengths_k), EXTRA, hkv, d, gen, dtype, storages) for _ in range(2))
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                      device="cuda")
    return Packed(q, k, v, dout, cu(lengths_q), cu(lengths_k), lengths_q, lengths_k, storages)


@gpu
@pytest.mark.parametrize("backend", FAMILIES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(32, -1), (-1, 16), (48, 16), (0, 0)], ids=_window_id)
@pytest.mark.parametrize("lengths,d,dtype", PACKED_CASES, ids=lambda x: DTYPE_IDS.get(x, str(x)))
def test_packed_batches(lengths, d, dtype, window, causal, backend):
    """attention_forward/backward(packed=...) with a window against each sequence alone (its own
    S_q and S_k align its window), GQA 4/2: out and lse given NaN-filled come back with O = 0 and
    LSE = -inf for tokens in no sequence, gradients given NaN-filled come back zero there; NaN
    tokens past the last sequence and NaN canaries around every token tensor stay unread."""
    if backend == "hopper" and not _on_hopper():
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    seed = seed_of("window-packed", lengths, d, dtype, window, causal)
    case = _packed(seed, lengths, 4, 2, d, dtype)
    repro = _repro("test_packed_batches", seed=seed, lengths=lengths, d=d, dtype=dtype, window=window, causal=causal,
                   backend=backend)
    out = torch.full((case.q.shape[0], 4, d), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((4, case.q.shape[0]), float("nan"), device="cuda")
    flashkiln.attention_forward(case.q, case.k, case.v, causal=causal, window_size=window, packed=case.packed(),
                                out=out, lse=lse, backend=backend)
    torch.cuda.synchronize()
    tail_q, tail_k = slice(int(case.cu_q[-1]), None), slice(int(case.cu_k[-1]), None)
    assert (out[tail_q] == 0).all() and torch.isneginf(lse[:, tail_q]).all(), \
        f"rows past the last sequence: not O = 0, LSE = -inf\n{repro}"
    assert case.canaries_intact(), f"canary overwritten\n{repro}"
    ref32, reflp = (_reference_forward(case, causal, None, None, t, window=window) for t in (torch.float32, dtype))
    inside = ~torch.isnan(ref32[1][0])
    assert inside.sum() == sum(case.lengths_q)
    fa_style_check("out", out[inside], ref32[0][inside], reflp[0][inside], 2, repro)
    fa_style_check("lse", lse[:, inside], ref32[1][:, inside], reflp[1][:, inside], 2, repro)
    empty = torch.isneginf(ref32[1])  # (H, total_q): rows that see no key
    assert (out.transpose(0, 1)[empty] == 0).all(), f"rows that see no key are not 0\n{repro}"

    buffers = [torch.full(t.shape, float("nan"), device="cuda", dtype=dtype) for t in (case.q, case.k, case.v)]
    grads = flashkiln.attention_backward(case.dout, case.q, case.k, case.v, out, lse, causal=causal,
                                         window_size=window, packed=case.packed(), dq=buffers[0], dk=buffers[1],
                                         dv=buffers[2], backend=backend)
    torch.cuda.synchronize()
    assert case.canaries_intact(), f"canary overwritten\n{repro}"
    dq, dk, dv = grads
    assert (dq[tail_q] == 0).all() and (dk[tail_k] == 0).all() and (dv[tail_k] == 0).all(), \
        f"gradients of tokens in no sequence are not 0\n{repro}"
    assert (dq.transpose(0, 1)[empty] == 0).all(), f"dq rows of queries that see no key are not 0\n{repro}"
    check_grads_against(grads, _reference_grads(case, causal, None, None, torch.float32, window=window),
                        _reference_grads(case, causal, None, None, dtype, window=window), repro)


@gpu
@pytest.mark.parametrize("window", [(32, -1), (48, 16)], ids=_window_id)
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_varlen_attention_autograd(causal, window):
    """flashkiln.varlen_attention(..., window_size=) forward and gradients through autograd."""
    seed = seed_of("window-varlen-autograd", causal, window)
    case = _packed(seed, "mixed", 4, 2, 128, torch.float16)
    repro = _repro("test_varlen_attention_autograd", seed=seed, causal=causal, window=window)
    q, k, v = (t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))
    out = flashkiln.varlen_attention(q, k, v, case.cu_q, case.cu_k, case.max_q, case.max_k, causal=causal,
                                     window_size=window)
    # Tokens past the last sequence hold NaN inputs: they must not reach the loss.
    inside = slice(0, int(case.cu_q[-1]))
    ref32, reflp = (_reference_forward(case, causal, None, None, t, window=window)
                    for t in (torch.float32, torch.float16))
    fa_style_check("out", out.detach()[inside], ref32[0][inside], reflp[0][inside], 2, repro)
    (out[inside].float() * case.dout[inside].float()).sum().backward()
    check_grads_against((q.grad, k.grad, v.grad),
                        *(_reference_grads(case, causal, None, None, t, window=window)
                          for t in (torch.float32, torch.float16)), repro)


# -- typed errors -------------------------------------------------------------------------------

def _dense_call(api: str, window):
    """(the call, a NaN-filled output it would write or None) for one API entry point on small CUDA
    inputs."""
    seed = seed_of("window-errors", api)
    q, k, v, dout, _ = _tensors(seed, 1, 2, 2, 64, 80, 64, torch.bfloat16)
    if api == "forward":
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        return (lambda: flashkiln.attention_forward(q, k, v, window_size=window, out=out, lse=lse)), out
    if api == "backward":
        out, lse = flashkiln.attention_forward(q, k, v)
        dq = torch.full_like(q, float("nan"))
        return (lambda: flashkiln.attention_backward(dout, q, k, v, out, lse, window_size=window, dq=dq)), dq
    if api == "sdpa":
        return (lambda: flashkiln.scaled_dot_product_attention(q, k, v, window_size=window)), None
    case = _packed(seed, "mixed", 2, 2, 64, torch.bfloat16)
    return (lambda: flashkiln.varlen_attention(case.q, case.k, case.v, case.cu_q, case.cu_k, case.max_q, case.max_k,
                                               window_size=window)), None


APIS = ("forward", "backward", "sdpa", "varlen")


@gpu
@pytest.mark.parametrize("bias_shape", ["full", "key-constant"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(32, -1), (48, 16)], ids=_window_id)
@pytest.mark.parametrize("sq,sk,d,dtype", [(113, 129, 64, torch.bfloat16), (129, 113, 128, torch.float16),
                                           (200, 200, 128, torch.bfloat16)],
                         ids=lambda x: DTYPE_IDS.get(x, str(x)))
def test_a_window_with_a_bias(sq, sk, d, dtype, window, causal, bias_shape):
    """A window and an additive bias together, with dBias (from the kernels' dS where the bias
    varies along the keys, in closed form where it does not), GQA 4/2 and sinks with dSink: both
    families against the references and each other."""
    seed = seed_of("window-bias", sq, sk, d, dtype, window, causal, bias_shape)
    q, k, v, dout, gen = _tensors(seed, 2, 4, 2, sq, sk, d, dtype)
    bias = torch.randn(2, 4, sq, sk if bias_shape == "full" else 1, device="cuda", dtype=dtype, generator=gen)
    sink = torch.linspace(-1.0, 2.0, 4, device="cuda")
    repro = _repro("test_a_window_with_a_bias", seed=seed, sq=sq, sk=sk, d=d, dtype=dtype, window=window,
                   causal=causal, bias_shape=bias_shape)
    _check_families(q, k, v, dout, causal, window, repro, sink=sink, bias=bias)


@gpu
@pytest.mark.parametrize("backend", FAMILIES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_a_window_with_a_bias_on_packed_batches(causal, backend):
    """A packed batch with a window and a per-sequence bias (each sequence reads its corner),
    against every sequence alone."""
    if backend == "hopper" and not _on_hopper():
        pytest.skip("the hopper backend runs on compute capability 9.0 only")
    seed = seed_of("window-bias-packed", causal, backend)
    case = _packed(seed, "mixed", 4, 2, 128, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    bias = torch.randn(len(case.lengths_q), 4, case.max_q, case.max_k, device="cuda", dtype=torch.bfloat16,
                       generator=gen)
    window = (48, 16)
    repro = _repro("test_a_window_with_a_bias_on_packed_batches", seed=seed, causal=causal, backend=backend)
    out, lse = flashkiln.attention_forward(case.q, case.k, case.v, causal=causal, window_size=window, bias=bias,
                                           packed=case.packed(), backend=backend)
    dtypes = (torch.float32, torch.bfloat16)
    ref32, reflp = (_reference_forward(case, causal, bias, None, t, window=window) for t in dtypes)
    inside = ~torch.isnan(ref32[1][0])
    fa_style_check("out", out[inside], ref32[0][inside], reflp[0][inside], 2, repro)
    fa_style_check("lse", lse[:, inside], ref32[1][:, inside], reflp[1][:, inside], 2, repro)
    grads = flashkiln.attention_backward(case.dout, case.q, case.k, case.v, out, lse, causal=causal,
                                         window_size=window, bias=bias, packed=case.packed(), backend=backend)
    ref32, reflp = (_reference_grads(case, causal, bias, None, t, window=window) for t in dtypes)
    check_grads_against(grads, dataclasses.replace(ref32, dbias=None), dataclasses.replace(reflp, dbias=None),
                        repro)


# Below -1, the wrong length, not a sequence, not ints ("ab" has length 2).
BAD_WINDOWS = [(-2, 0), (0, -2), (-5, -5), (1,), (1, 2, 3), (), "a", "ab", 3, (1.5, 2), ("1", 2), (None, 0)]


@gpu
@pytest.mark.parametrize("window", BAD_WINDOWS, ids=repr)
@pytest.mark.parametrize("api", APIS)
def test_malformed_window_is_invalid_input(api, window):
    """window_size must be None or two ints >= -1: anything else is an InvalidInputError naming it,
    before any launch."""
    call, written = _dense_call(api, window)
    repro = _repro("test_malformed_window_is_invalid_input", api=api, window=window)
    with pytest.raises(flashkiln.InvalidInputError, match="window"):
        call()
    torch.cuda.synchronize()
    if written is not None:
        assert torch.isnan(written).all(), f"an output was written before the error\n{repro}"
