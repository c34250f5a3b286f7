"""Packed variable-length batches on the GPU, against the fp32 reference run on each sequence alone.

Token tensors hold NaN tokens past the last sequence and sit between NaN canary tokens: the
kernels must not use them (NaN would spread into the results), and their rows of out and lse,
given NaN-filled, come back as O = 0 and LSE = -inf (flashkiln.varlen's rule for tokens in no
sequence). Zero-length query and key sequences are in every case.
The forwards and backwards run on both families (the hopper one on compute capability 9.0).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import pytest
import torch

import flashkiln
from backward_log import backward_plans
from flashkiln.dq_routes import ROUTES
from reference import (GradReference, attention_grad_reference, attention_reference, check_grads_against,
                       fa_style_check, repro_line, seed_of)
from test_backward_gpu import _forced_route

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_varlen_gpu.py")

PAD = 3  # NaN canary tokens on each side of every token tensor
EXTRA = 5  # NaN tokens past the last sequence, inside the tensors
# (query lengths, key lengths): zero-length queries and keys, a single token, partial tiles, a
# sequence longer than the others by several tiles; "long" (forward only): several query and
# key tiles per sequence, fewer keys than queries (rows that see none under bottom_right).
LENGTHS = {
    "mixed": ((130, 0, 17, 256, 1), (200, 33, 0, 256, 64)),
    "self": ((1, 129, 64, 0, 300), (1, 129, 64, 0, 300)),
    "long": ((700, 3, 0, 513, 129), (700, 900, 5, 300, 0)),
}
SHORT = ["mixed", "self"]
BACKENDS = ["hopper", "portable"]


def _skip_unless_runs(backend: str) -> None:
    if backend == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper backend runs on compute capability 9.0 only")


@dataclass
class Packed:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    storages: list[torch.Tensor]

    @property
    def max_q(self) -> int:
        return max(self.lengths_q)

    @property
    def max_k(self) -> int:
        return max(self.lengths_k)

    def packed(self) -> flashkiln.PackedBatch:
        return flashkiln.PackedBatch(self.cu_q, self.cu_k, self.max_q, self.max_k)

    def sequence(self, t: torch.Tensor, b: int, keys: bool) -> torch.Tensor:
        """Sequence b of a (total, H, d) tensor as a (1, H, S, d) tensor."""
        cu = self.cu_k if keys else self.cu_q
        return t[int(cu[b]):int(cu[b + 1])].transpose(0, 1)[None]

    def canaries_intact(self) -> bool:
        return all(torch.isnan(s[:PAD]).all() and torch.isnan(s[-PAD:]).all() for s in self.storages)


def _token_tensor(total: int, extra: int, heads: int, d: int, gen, dtype, storages) -> torch.Tensor:
    """Random (total, heads, d) inside NaN storage: PAD canaries each side, `extra` NaN tokens at the end."""
    storage = torch.full((total + extra + 2 * PAD, heads, d), float("nan"), device="cuda", dtype=dtype)
    storage[PAD:PAD + total] = torch.randn(total, heads, d, device="cuda", dtype=dtype, generator=gen)
    storages.append(storage)
    return storage[PAD:-PAD]


def _packed_case(seed: int, lengths: str, hq: int, hkv: int, dims=(128, 128), dtype=torch.bfloat16,
                 extra: int = EXTRA) -> Packed:
    lengths_q, lengths_k = LENGTHS[lengths]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    storages: list[torch.Tensor] = []
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q, dout = (_token_tensor(total_q, extra, hq, d, gen, dtype, storages) for d in dims)
    k, v = (_token_tensor(total_k, extra, hkv, d, gen, dtype, storages) for d in dims)
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                      device="cuda")
    return Packed(q, k, v, dout, cu(lengths_q), cu(lengths_k), lengths_q, lengths_k, storages)


def _bias_of(case: Packed, shape: str | None, gen) -> torch.Tensor | None:
    if shape is None:
        return None
    b, h = len(case.lengths_q), case.q.shape[1]
    dims = {"full": (b, h), "heads": (1, h), "batch": (b, 1)}[shape]
    return torch.randn(*dims, case.max_q, case.max_k, device="cuda", dtype=case.q.dtype, generator=gen)


def _sequence_bias(bias: torch.Tensor | None, b: int, lq: int, lk: int) -> torch.Tensor | None:
    if bias is None:
        return None
    return bias[min(b, bias.shape[0] - 1)][None, :, :lq, :lk]


def _reference_forward(case: Packed, causal, bias, sink, dtype, **mods):
    """out (total, H, d_v) and lse (H, total) of every sequence alone (`mods`: the reference's window
    and softcap); NaN rows past the last sequence."""
    out = torch.full((case.q.shape[0], case.q.shape[1], case.v.shape[2]), float("nan"), device="cuda")
    lse = torch.full((case.q.shape[1], case.q.shape[0]), float("nan"), device="cuda")
    for b, (lq, lk) in enumerate(zip(case.lengths_q, case.lengths_k)):
        if lq == 0:
            continue
        ref = attention_reference(case.sequence(case.q, b, False), case.sequence(case.k, b, True),
                                  case.sequence(case.v, b, True), causal, None, dtype,
                                  bias=_sequence_bias(bias, b, lq, lk), sink=sink, **mods)
        start = int(case.cu_q[b])
        out[start:start + lq] = ref.out[0].transpose(0, 1).float()
        lse[:, start:start + lq] = ref.lse[0]
    return out, lse


def _reference_grads(case: Packed, causal, bias, sink, dtype, **mods) -> GradReference:
    """Per-token gradients of every sequence alone (zeros for tokens in no sequence); dbias in the
    bias's shape; dsink summed over the sequences (`mods`: the reference's window and softcap)."""
    dq = torch.zeros(case.q.shape, device="cuda")
    dk, dv = torch.zeros(case.k.shape, device="cuda"), torch.zeros(case.v.shape, device="cuda")
    dbias = None if bias is None else torch.zeros(bias.shape, device="cuda")
    dsink = None if sink is None else torch.zeros(sink.shape, device="cuda")
    for b, (lq, lk) in enumerate(zip(case.lengths_q, case.lengths_k)):
        if lq == 0 or lk == 0:
            continue  # nothing to differentiate: zero gradients
        ref = attention_grad_reference(case.sequence(case.q, b, False), case.sequence(case.k, b, True),
                                       case.sequence(case.v, b, True), case.sequence(case.dout, b, False), causal,
                                       None, dtype, bias=_sequence_bias(bias, b, lq, lk), sink=sink, **mods)
        sq, sk = int(case.cu_q[b]), int(case.cu_k[b])
        dq[sq:sq + lq] = ref.dq[0].transpose(0, 1).float()
        dk[sk:sk + lk] = ref.dk[0].transpose(0, 1).float()
        dv[sk:sk + lk] = ref.dv[0].transpose(0, 1).float()
        if dbias is not None:
            dbias[min(b, bias.shape[0] - 1), :, :lq, :lk] += ref.dbias[0].float()
        if dsink is not None:
            dsink += ref.dsink.float()
    return GradReference(dq, dk, dv, dbias, dsink)


def _check_forward(case: Packed, out, lse, causal, bias, sink, repro: str, **mods) -> None:
    ref32 = _reference_forward(case, causal, bias, sink, torch.float32, **mods)
    reflp = _reference_forward(case, causal, bias, sink, case.q.dtype, **mods)
    inside = ~torch.isnan(ref32[1][0])  # query tokens of some sequence
    assert inside.sum() == sum(case.lengths_q)
    fa_style_check("out", out[inside], ref32[0][inside], reflp[0][inside], 2, repro)
    fa_style_check("lse", lse[:, inside], ref32[1][:, inside], reflp[1][:, inside], 2, repro)


def _forward(case: Packed, causal, bias=None, sink=None, backend=None, **mods):
    """attention_forward into NaN-filled out and lse (`mods`: window_size, softcap): rows of tokens
    past the last sequence come back as O = 0 and LSE = -inf."""
    out = torch.full((case.q.shape[0], case.q.shape[1], case.v.shape[2]), float("nan"), device="cuda",
                     dtype=case.q.dtype)
    lse = torch.full((case.q.shape[1], case.q.shape[0]), float("nan"), device="cuda")
    flashkiln.attention_forward(case.q, case.k, case.v, causal=causal, bias=bias, sink=sink, packed=case.packed(),
                                out=out, lse=lse, backend=backend, **mods)
    torch.cuda.synchronize()
    tail = slice(int(case.cu_q[-1]), None)
    assert (out[tail] == 0).all() and torch.isneginf(lse[:, tail]).all(), "rows past the last sequence: not O = 0, LSE = -inf"
    assert case.canaries_intact(), "canary overwritten"
    return out, lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256)], ids=lambda d: f"d{d[0]}x{d[1]}")
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_forward_matches_each_sequence_alone(lengths, causal, dims, backend):
    _skip_unless_runs(backend)
    seed = seed_of("varlen-fwd", lengths, causal, dims)
    case = _packed_case(seed, lengths, hq=6, hkv=2, dims=dims)
    out, lse = _forward(case, causal, backend=backend)
    _check_forward(case, out, lse, causal, None, None,
                   _repro("test_forward_matches_each_sequence_alone", lengths=lengths, causal=causal, dims=dims,
                          backend=backend))


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=lambda d: f"d{d[0]}x{d[1]}")
def test_each_hopper_tuning_on_packed_batches(monkeypatch, dims, causal):
    """The packed hopper variants with two tunings (specs/tuning/hopper.yaml), each forced in turn."""
    _skip_unless_runs("hopper")
    forced = {"index": 0, "count": 0}

    def choose(entries, seqlen_q, seqlen_k, window=None):
        forced["count"] = len(entries)
        return entries[forced["index"]]

    monkeypatch.setattr(flashkiln.tile_choice, "choose", choose)
    case = _packed_case(seed_of("varlen-tunings", dims, causal), "long", hq=6, hkv=2, dims=dims)
    while True:
        flashkiln.forward.PLANS.clear()  # plan again with the next tuning
        out, lse = _forward(case, causal, backend="hopper")
        _check_forward(case, out, lse, causal, None, None,
                       _repro("test_each_hopper_tuning_on_packed_batches", dims=dims, causal=causal,
                              tuning=forced["index"]))
        forced["index"] += 1
        if forced["index"] >= forced["count"]:
            break
    assert forced["count"] == 2


def test_hopper_plan_of_a_packed_batch():
    """Packed tiles differ in length with or without a mask: CTAs claim them from a counter; the
    causal grid starts at row 0 (the sequences end at different rows)."""
    _skip_unless_runs("hopper")
    from flashkiln import hopper_family
    from flashkiln.calls import ForwardCall
    from flashkiln.launch import ScratchSet, Target
    from flashkiln.registry import default_registry
    from flashkiln.varlen import as_batched

    case = _packed_case(seed_of("varlen-plan"), "long", hq=6, hkv=2)
    q, k, v = (as_batched(t) for t in (case.q, case.k, case.v))
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    for causal in ("none", "top_left"):
        scratch = ScratchSet(q.device)
        call = ForwardCall(q, k, v, out, lse, causal, 0.1, packed=case.packed())
        (launch,) = hopper_family.plan_forward(call, Target.of(q), default_registry(), scratch)
        assert launch.entry.descriptor["packed"]
        counter = scratch.tensors["tile_counter"]
        assert launch.params.tile_counter == counter.data_ptr() and launch.params.row_shift == 0
        assert launch.params.batch == len(case.lengths_q) and launch.params.seqlen_q == case.max_q
        assert launch.params.total_q == case.q.shape[0] and launch.params.cu_seqlens_q == case.cu_q.data_ptr()


# The hopper backward has the atomic and ordered routes; the workspace route is the portable family's.
BACKWARD_CASES = [(route, backend) for route in ROUTES for backend in BACKENDS
                  if route != "workspace" or backend == "portable"]


@pytest.mark.parametrize("route,backend", BACKWARD_CASES)
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256)], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_backward_matches_each_sequence_alone(hq, hkv, lengths, causal, dims, route, backend):
    _skip_unless_runs(backend)
    seed = seed_of("varlen-bwd", hq, hkv, lengths, causal, dims)
    case = _packed_case(seed, lengths, hq, hkv, dims)
    repro = _repro("test_backward_matches_each_sequence_alone", hq=hq, hkv=hkv, lengths=lengths, causal=causal,
                   dims=dims, route=route, backend=backend)
    out, lse = _forward(case, causal)
    with _forced_route(route):
        grads = flashkiln.attention_backward(case.dout, case.q, case.k, case.v, out, lse, causal=causal,
                                             packed=case.packed(), deterministic=route != "atomic",
                                             backend=backend)
    torch.cuda.synchronize()
    assert case.canaries_intact(), "canary overwritten"
    # Tokens in no sequence get exact zeros; the reference has zeros there too.
    check_grads_against(grads, _reference_grads(case, causal, None, None, torch.float32),
                        _reference_grads(case, causal, None, None, case.q.dtype), repro)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias_shape", ["full", "heads", "batch"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_bias_sinks_gqa_and_causal_combine(causal, bias_shape, backend):
    """Item 4 of the issue: bias (with dBias), sinks (with dSink), a packed batch, causal, GQA, and
    the deterministic backward, together; dBias and dSink bitwise reproducible. `backend` runs the
    forward."""
    _skip_unless_runs(backend)
    seed = seed_of("varlen-all", causal, bias_shape)
    case = _packed_case(seed, "mixed", hq=6, hkv=2)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    bias = _bias_of(case, bias_shape, gen)
    sink = torch.linspace(-2.0, 3.0, case.q.shape[1], device="cuda")
    repro = _repro("test_bias_sinks_gqa_and_causal_combine", causal=causal, bias_shape=bias_shape, backend=backend)
    out, lse = _forward(case, causal, bias, sink, backend)
    _check_forward(case, out, lse, causal, bias, sink, repro)
    runs = [flashkiln.attention_backward(case.dout, case.q, case.k, case.v, out, lse, causal=causal, bias=bias,
                                         bias_grad=True, sink=sink, sink_grad=True, packed=case.packed(),
                                         deterministic=True) for _ in range(5)]
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsink"), runs[0], run):
            assert torch.equal(a, b), f"{name} differs between runs\n{repro}"
    ref32 = _reference_grads(case, causal, bias, sink, torch.float32)
    reflp = _reference_grads(case, causal, bias, sink, case.q.dtype)
    check_grads_against(runs[0], ref32, reflp, repro)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=["d64", "d128"])
@pytest.mark.parametrize("bias_shape", ["full", "heads", "batch", "key-constant"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_hopper_backward_with_a_bias_on_packed_batches(causal, bias_shape, dims):
    """The hopper backward reads a packed batch's bias per sequence (its rows and keys from the
    sequence's corner, its batch coordinate the sequence's index): forced, with GQA and sinks,
    against every sequence alone, deterministic (bitwise over runs) and not; dBias where it is
    key-constant (closed form)."""
    _skip_unless_runs("hopper")
    seed = seed_of("varlen-hopper-bias", causal, bias_shape, dims)
    case = _packed_case(seed, "mixed", hq=6, hkv=2, dims=dims)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    if bias_shape == "key-constant":
        bias = torch.randn(len(case.lengths_q), case.q.shape[1], case.max_q, 1, device="cuda",
                           dtype=case.q.dtype, generator=gen)
    else:
        bias = _bias_of(case, bias_shape, gen)
    sink = torch.linspace(-2.0, 3.0, case.q.shape[1], device="cuda")
    repro = _repro("test_hopper_backward_with_a_bias_on_packed_batches", causal=causal, bias_shape=bias_shape,
                   dims=dims)
    out, lse = _forward(case, causal, bias, sink)
    bias_grad = bias_shape == "key-constant"
    call = partial(flashkiln.attention_backward, case.dout, case.q, case.k, case.v, out, lse, causal=causal,
                   bias=bias, bias_grad=bias_grad, sink=sink, sink_grad=True, packed=case.packed(), backend="hopper")
    with backward_plans() as plans:
        runs = [call(deterministic=True) for _ in range(3)]
    assert {(p.family, p.route) for p in plans} == {("hopper", "ordered")}, f"planned {plans}\n{repro}"
    with backward_plans() as plans:
        unordered = call(deterministic=False)
    assert {(p.family, p.route) for p in plans} == {("hopper", "atomic")}, f"planned {plans}\n{repro}"
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run)), f"gradients differ between runs\n{repro}"
    assert case.canaries_intact(), f"canary overwritten\n{repro}"
    ref32 = _reference_grads(case, causal, bias, sink, torch.float32)
    reflp = _reference_grads(case, causal, bias, sink, case.q.dtype)
    if not bias_grad:
        ref32, reflp = (dataclasses.replace(r, dbias=None) for r in (ref32, reflp))
    check_grads_against(runs[0], ref32, reflp, repro)
    check_grads_against(unordered, ref32, reflp, repro)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=["d64", "d128"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("order", ["heads", "batch"])
def test_hopper_tile_orders_on_packed_batches(order, causal, dims, force_tile_order):
    """The hopper forward's tile orders for broadcast biases (forced; flashkiln.hopper_family.tile_order)
    on a packed batch with a bias broadcast along the innermost dim: query tiles past a shorter
    sequence's end are skipped in either order too."""
    _skip_unless_runs("hopper")
    forced, plans = force_tile_order(order)
    seed = seed_of("varlen-tile-order", order, causal, dims)
    case = _packed_case(seed, "long", hq=6, hkv=2, dims=dims)
    bias = _bias_of(case, {"heads": "batch", "batch": "heads"}[order],
                    torch.Generator(device="cuda").manual_seed(seed + 1))
    out, lse = _forward(case, causal, bias, None, "hopper")
    _check_forward(case, out, lse, causal, bias, None,
                   _repro("test_hopper_tile_orders_on_packed_batches", order=order, causal=causal, dims=dims))
    assert [launches[0].params.tile_order for launches in plans] == [forced]


def test_varlen_attention_autograd_and_compile(deterministic_algorithms):
    """Compiled and eager give the same output and gradients, bitwise: in deterministic mode, since
    otherwise dQ and GQA's dK and dV are added in any order; and the gradients match the reference."""
    seed = seed_of("varlen-autograd")
    case = _packed_case(seed, "self", hq=4, hkv=2, dtype=torch.float16)
    q, k, v = (t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))
    args = (case.cu_q, case.cu_k, case.max_q, case.max_k)
    # Tokens past the last sequence hold NaN inputs: they must not reach the loss.
    inside = slice(0, int(case.cu_q[-1]))

    def loss(fn):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, *args, causal="top_left")
        (out[inside].float() * case.dout[inside].float()).sum().backward()
        return out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()

    eager = loss(flashkiln.varlen_attention)
    compiled = loss(torch.compile(flashkiln.varlen_attention, fullgraph=True))
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, compiled):
        assert torch.equal(a[inside] if name == "out" else a, b[inside] if name == "out" else b), name
    check_grads_against(eager[1:], _reference_grads(case, "top_left", None, None, torch.float32),
                        _reference_grads(case, "top_left", None, None, case.q.dtype),
                        _repro("test_varlen_attention_autograd_and_compile"))


def test_opcheck_packed():
    # Zero-length sequences, and tokens in no sequence (O = 0).
    case = _packed_case(seed_of("varlen-opcheck"), "mixed", hq=4, hkv=2, dims=(64, 64))
    q, k, v = case.q, case.k, case.v
    sink = torch.linspace(-1, 1, 4, device="cuda")
    args = (q, k, v, None, sink, "bottom_right", 0.125, True, case.cu_q, case.cu_k, case.max_q, case.max_k)
    torch.library.opcheck(torch.ops.flashkiln.attention_forward.default, args)
    out, lse = torch.ops.flashkiln.attention_forward(*args)
    torch.library.opcheck(torch.ops.flashkiln.attention_backward.default,
                          (case.dout, q, k, v, out, lse, None, None, False, sink, True, "bottom_right", 0.125, True,
                           case.cu_q, case.cu_k, case.max_q, case.max_k))


def test_validate_checks_offsets_on_the_device_tensors():
    case = _packed_case(seed_of("varlen-validate"), "self", hq=2, hkv=2, dims=(64, 64))
    args = (case.q, case.k, case.v, case.cu_q, case.cu_k, case.max_q, case.max_k)
    out = flashkiln.varlen_attention(*args, validate=True)
    assert torch.equal(out, flashkiln.varlen_attention(*args))
    with pytest.raises(flashkiln.InvalidInputError, match="not in \\[0, max_seqlen"):
        flashkiln.varlen_attention(*args[:5], case.max_q - 1, case.max_k, validate=True)


@pytest.mark.parametrize("d", (128, 256))
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_hopper_deterministic_backward_with_sinks(lengths, causal, d):
    """The hopper backward's ordered dQ on packed batches with GQA and sinks: dq, dk, dv and dSink
    bitwise equal over 20 runs, and against each sequence alone."""
    _skip_unless_runs("hopper")
    seed = seed_of("varlen-hopper-det", lengths, causal, d)
    case = _packed_case(seed, lengths, hq=6, hkv=2, dims=(d, d))
    sink = torch.linspace(-2.0, 3.0, case.q.shape[1], device="cuda")
    repro = _repro("test_hopper_deterministic_backward_with_sinks", lengths=lengths, causal=causal, d=d)
    out, lse = _forward(case, causal, None, sink)
    with _forced_route("ordered"):  # the first call plans (and logs its route); the others hit the plan cache
        runs = [flashkiln.attention_backward(case.dout, case.q, case.k, case.v, out, lse, causal=causal, sink=sink,
                                             sink_grad=True, packed=case.packed(), deterministic=True,
                                             backend="hopper") for _ in range(20)]
    torch.cuda.synchronize()
    assert case.canaries_intact(), "canary overwritten"
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), runs[0], run):
            assert torch.equal(a, b), f"{name} differs between runs\n{repro}"
    check_grads_against(runs[0], _reference_grads(case, causal, None, sink, torch.float32),
                        _reference_grads(case, causal, None, sink, case.q.dtype), repro)
