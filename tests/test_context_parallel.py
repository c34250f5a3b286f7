"""Context parallelism on the CPU: the ring's step plan, the LSE merge, the whole ring (forward and
backward through autograd) with a pure-torch step op through the simulated ring and through real
torch.distributed processes (gloo), the shard helpers, and the entry's typed errors.

The ring runs tests/cp_support.py's reference step op (FlashAttention's backward formulas, O and
LSE given from outside) in fp64 and is compared with autograd of the unsliced reference
(tests/reference.py): every visible block must be computed exactly once, with the right mask, and
every gradient must come home.
"""
from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
import torch.distributed as dist

import flashkiln
from cp_support import (REFERENCE_STEPS, Case, free_port, p2p_matches_simulation, reference_results, run_ring,
                        spawn)
from flashkiln.context_parallel import shard_sequence, unshard_sequence
from flashkiln.lse_merge import merge_into
from flashkiln.ring import RingConfig, StepOps, ring_attention
from flashkiln.ring_comm import ProcessGroupRing, SimulatedRing
from flashkiln.ring_plan import CAUSAL, FULL, SKIP, blocks, chunks_of, source_of, step_plan
from reference import repro_line, seed_of

_repro = partial(repro_line, "test_context_parallel.py")
WORLDS = (1, 2, 3, 4)


# -- the step plan ----------------------------------------------------------------------------

def _truth(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """The whole sequence's causal mask on one (query chunk, key chunk) block."""
    if not causal or k_chunk < q_chunk:
        return FULL
    return CAUSAL if k_chunk == q_chunk else SKIP


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "head-tail"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", WORLDS)
def test_plan_runs_every_visible_block_once(world, causal, load_balance):
    ran: list[tuple[int, int]] = []
    met: list[tuple[int, int]] = []
    for rank, step in itertools.product(range(world), range(world)):
        if step == 0:  # the own slice: every row of it meets every row (the ring starts its sums there)
            plan = step_plan(rank, world, 0, causal=causal, load_balance=load_balance)
            assert (plan.q_rows(10), plan.kv_rows(10), plan.mask != SKIP) == (slice(0, 10), slice(0, 10), True)
        covered = {(a, b): mask for a, b, mask in blocks(rank, world, step, causal=causal, load_balance=load_balance)}
        for (a, b), mask in covered.items():
            assert mask == _truth(a, b, causal), (rank, step, a, b, mask)
            if mask != SKIP:
                ran.append((a, b))
        # The blocks the call leaves out of its rectangle must be invisible.
        theirs = chunks_of(source_of(rank, world, step), world, load_balance)
        for a, b in itertools.product(chunks_of(rank, world, load_balance), theirs):
            met.append((a, b))
            if (a, b) not in covered:
                assert _truth(a, b, causal) == SKIP, (rank, step, a, b)
    chunks = 2 * world if load_balance else world
    everything = list(itertools.product(range(chunks), range(chunks)))
    assert sorted(met) == everything, "the ring must bring every key chunk to every query chunk once"
    assert sorted(ran) == [p for p in everything if _truth(*p, causal) != SKIP]


def _work(rank: int, world: int, step: int, load_balance: bool) -> float:
    """Block work of one step (a chunk-sized block 1, a causal diagonal block 1/2)."""
    return sum({FULL: 1.0, CAUSAL: 0.5, SKIP: 0.0}[mask]
               for _, _, mask in blocks(rank, world, step, causal=True, load_balance=load_balance))


@pytest.mark.parametrize("world", WORLDS)
def test_head_tail_balances_causal_work_at_every_step(world):
    for step in range(world):
        assert {_work(r, world, step, True) for r in range(world)} == {2.0}, step
    # Contiguous slices: rank r works r + 1/2 (in its own chunk's blocks), the last rank most.
    totals = [sum(_work(r, world, s, False) for s in range(world)) for r in range(world)]
    assert totals == [r + 0.5 for r in range(world)]


@pytest.mark.parametrize("load_balance", [False, True])
def test_plan_rows_and_modes(load_balance):
    own = step_plan(1, 3, 0, causal=True, load_balance=load_balance)
    assert own.mask == CAUSAL and own.q_rows(10) == slice(0, 10) and own.kv_rows(10) == slice(0, 10)
    assert step_plan(1, 3, 2, causal=False, load_balance=load_balance).mask == FULL
    earlier, later = (step_plan(1, 3, s, causal=True, load_balance=load_balance) for s in (1, 2))  # sources 0, 2
    if load_balance:  # head chunk only of an earlier source; our tail chunk only against a later one
        assert (earlier.mask, earlier.q_rows(10), earlier.kv_rows(10)) == (FULL, slice(0, 10), slice(0, 5))
        assert (later.mask, later.q_rows(10), later.kv_rows(10)) == (FULL, slice(5, 10), slice(0, 10))
    else:
        assert (earlier.mask, later.mask) == (FULL, SKIP)


# -- the LSE merge ----------------------------------------------------------------------------

@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_merge_equals_attention_over_all_keys(parts):
    """Partial attention over disjoint key sets, merged in turn, equals attention over their union,
    with rows that see no key in some parts, and rows that see none at all (O = 0, LSE = -inf)."""
    seed = seed_of("merge", parts)
    gen = torch.Generator().manual_seed(seed)
    rows, keys, d = 9, 4 * parts, 5
    scores = torch.randn(2, 3, rows, keys, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(2, 3, keys, d, generator=gen, dtype=torch.float64)
    hidden = torch.rand(2, 3, rows, keys, generator=gen) < 0.3
    hidden[..., 0, :] = True  # sees nothing at all
    hidden[..., 1, : keys // 2] = True  # sees nothing in the first parts
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.full((2, 3, rows), float("-inf"), dtype=torch.float64)
    out = torch.zeros(2, 3, rows, d, dtype=torch.float64)
    for part_scores, part_values in zip(scores.chunk(parts, -1), values.chunk(parts, -2)):
        part_lse = torch.logsumexp(part_scores, -1)
        probs = torch.exp(part_scores - part_lse.masked_fill(torch.isneginf(part_lse), 0)[..., None])
        merge_into(out, lse, probs @ part_values, part_lse)
    want_lse = torch.logsumexp(scores, -1)
    unseen = hidden.all(-1, keepdim=True)
    want = (torch.softmax(scores.masked_fill(unseen, 0), -1) @ values).masked_fill(unseen, 0)
    repro = _repro("test_merge_equals_attention_over_all_keys", parts=parts, seed=seed)
    assert not out.isnan().any() and not lse.isnan().any(), repro
    assert torch.isneginf(lse[..., 0]).all() and (out[..., 0, :] == 0).all(), repro
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12, msg=lambda m: f"lse: {m}\n{repro}")
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12, msg=lambda m: f"out: {m}\n{repro}")


# -- the whole ring, simulated ----------------------------------------------------------------

def _ring_cases() -> list[Case]:
    cases = []
    for world, causal, load_balance in itertools.product(WORLDS, (False, True), (False, True)):
        lengths = (2, 8, 18) if load_balance else (1, 7, 17)  # head-tail slices: two equal chunks
        for s_local in lengths:
            cases.append(Case(world, s_local, causal, load_balance, seed=seed_of("ring", world, s_local, causal,
                                                                                 load_balance)))
    return cases


def _case_id(case: Case) -> str:
    return (f"w{case.world}-s{case.s_local}-{'causal' if case.causal else 'full'}"
            f"-{'headtail' if case.load_balance else 'contiguous'}")


def _check_against_unsliced(case: Case, got: dict, whole: dict, dtype: torch.dtype, atol: float, repro: str,
                            block_rows: int | None = None) -> None:
    want = reference_results(case, whole, dtype, block_rows)
    for name in ("out", "lse", "dq", "dk", "dv"):
        value = case.unshard(got[name])
        assert not value.isnan().any(), f"{name}: NaN\n{repro}"
        torch.testing.assert_close(value, want[name].to(value.dtype), rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}\n{repro}")


@pytest.mark.parametrize("case", _ring_cases(), ids=_case_id)
def test_simulated_ring_equals_unsliced_attention(case):
    """W 1-4, causal or not, head-tail or contiguous, GQA 6/2, odd local lengths: the ring's out, LSE,
    dq, dk and dv (fp64, the LSE's gradient included) equal the unsliced reference's."""
    whole = case.tensors(torch.float64)
    got = run_ring(SimulatedRing(case.world), case, whole, REFERENCE_STEPS)
    # The reference a third of the sequence at a time (as the GPU tests run it on long sequences).
    _check_against_unsliced(case, got, whole, torch.float64, 1e-10,
                            _repro("test_simulated_ring_equals_unsliced_attention", case=case),
                            block_rows=max(1, case.world * case.s_local // 3))


@pytest.mark.parametrize("world,load_balance", [(2, True), (3, False), (4, True)])
def test_padding_rows_get_exactly_zero_gradients(world, load_balance):
    """A causal sequence padded at its end (zero inputs, zero upstream gradients): the padding's
    dq, dk and dv rows are exactly 0 on every rank, and the rest is the padded sequence's."""
    case = Case(world, 8, True, load_balance, pad=5, seed=seed_of("pad", world, load_balance))
    whole = case.tensors(torch.float64)
    got = run_ring(SimulatedRing(world), case, whole, REFERENCE_STEPS)
    repro = _repro("test_padding_rows_get_exactly_zero_gradients", world=world, load_balance=load_balance)
    assert sum(int(case.padding(r).sum()) for r in range(world)) == case.pad  # across two chunks under head-tail
    for rank in range(world):
        padding = case.padding(rank)
        for name in ("dq", "dk", "dv"):
            assert (got[name][rank][:, :, padding] == 0).all(), f"{name} of padding rows on rank {rank}\n{repro}"
    _check_against_unsliced(case, got, whole, torch.float64, 1e-10, repro)


@pytest.mark.parametrize("use_lse", [False, True])
@pytest.mark.parametrize("hq,hkv,d,d_v", [(6, 2, 16, 8), (4, 1, 8, 8), (3, 3, 8, 12)], ids=["gqa", "mqa", "mha"])
def test_simulated_ring_fp32(hq, hkv, d, d_v, use_lse):
    """fp32 inputs (accumulated in fp32), d_qk != d_v, with and without the LSE in the loss."""
    case = Case(3, 10, True, True, hq=hq, hkv=hkv, d=d, d_v=d_v, seed=seed_of("fp32", hq, hkv, d), use_lse=use_lse)
    whole = case.tensors(torch.float32)
    got = run_ring(SimulatedRing(case.world), case, whole, REFERENCE_STEPS)
    assert all(t.dtype == torch.float32 for t in got["lse"])
    _check_against_unsliced(case, got, whole, torch.float64, 2e-5,
                            _repro("test_simulated_ring_fp32", hq=hq, hkv=hkv, d=d, d_v=d_v, use_lse=use_lse))


def test_ring_calls_follow_the_plan():
    """The op is called once per step and rank that the plan does not skip, on the plan's rows, with
    the plan's mask and the config's deterministic flag; skipped steps call nothing."""
    case = Case(3, 6, True, True, seed=seed_of("calls"), deterministic=True)
    calls: list[tuple] = []

    def forward(q, k, v, causal, scale):
        calls.append(("fwd", q.shape[2], k.shape[2], causal, scale))
        return REFERENCE_STEPS.forward(q, k, v, causal, scale)

    def backward(dout, q, k, v, out, lse, dlse, causal, scale, deterministic):
        calls.append(("bwd", q.shape[2], k.shape[2], causal, deterministic))
        return REFERENCE_STEPS.backward(dout, q, k, v, out, lse, dlse, causal, scale, deterministic)

    run_ring(SimulatedRing(3), case, case.tensors(torch.float64), StepOps(forward, backward))
    want = []
    for kind in ("fwd", "bwd"):
        for step, rank in itertools.product(range(3), range(3)):
            plan = step_plan(rank, 3, step, causal=True, load_balance=True)
            rows, keys = plan.q_rows(6), plan.kv_rows(6)
            last = case.scale if kind == "fwd" else True
            want.append((kind, rows.stop - rows.start, keys.stop - keys.start, plan.mask == CAUSAL, last))
    assert calls == want


def test_ring_skips_without_calls_under_contiguous_causal():
    calls = []
    ops = StepOps(lambda *a: calls.append(1) or REFERENCE_STEPS.forward(*a), REFERENCE_STEPS.backward)
    case = Case(4, 3, True, False, seed=seed_of("skips"))
    run_ring(SimulatedRing(4), case, case.tensors(torch.float64), ops)
    assert len(calls) == 4 + 3 + 2 + 1  # rank r sees r earlier slices and its own


def test_ring_keeps_memory_order_and_gradient_strides():
    """q, k, v as (B, S, H, D) storage viewed (B, H, S, D): the output comes back in that memory
    order and the gradients with their inputs' strides."""
    case = Case(2, 4, True, True, seed=seed_of("layout"))
    whole = case.tensors(torch.float64)
    slices = {n: [case.shard(whole[n], r).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                  for r in range(2)] for n in ("q", "k", "v")}
    outs, _ = ring_attention(SimulatedRing(2), slices["q"], slices["k"], slices["v"], case.config(), REFERENCE_STEPS)
    torch.autograd.backward(outs, [case.shard(whole["dout"], r) for r in range(2)])
    assert outs[0].stride() == slices["q"][0].stride()
    for name in ("q", "k", "v"):
        assert slices[name][1].grad.stride() == slices[name][1].stride(), name
    want = reference_results(Case(2, 4, True, True, use_lse=False, seed=case.seed), whole, torch.float64)
    torch.testing.assert_close(case.unshard(outs), want["out"], rtol=0, atol=1e-10)
    torch.testing.assert_close(case.unshard([t.grad for t in slices["k"]]), want["dk"], rtol=0, atol=1e-10)


# -- shard helpers ----------------------------------------------------------------------------

@pytest.mark.parametrize("load_balance", [False, True])
@pytest.mark.parametrize("world", WORLDS)
def test_shard_unshard_round_trip(world, load_balance):
    x = torch.arange(2 * 3 * 4 * world * 5, dtype=torch.float32).view(2, 3, 4 * world, 5)
    slices = [shard_sequence(x, r, world, load_balance=load_balance) for r in range(world)]
    assert torch.equal(unshard_sequence(slices, load_balance=load_balance), x)
    positions = torch.arange(4 * world)
    held = shard_sequence(positions, 0, world, load_balance=load_balance, dim=0).tolist()
    chunk = 4 * world // (2 * world if load_balance else world)
    assert held == [c * chunk + i for c in chunks_of(0, world, load_balance) for i in range(chunk)]


def test_shard_errors():
    x = torch.zeros(1, 1, 6, 2)
    with pytest.raises(flashkiln.InvalidInputError, match="equal chunks"):
        shard_sequence(x, 0, 2, load_balance=True)  # 6 tokens into 4 chunks
    with pytest.raises(flashkiln.InvalidInputError, match="rank"):
        shard_sequence(x, 2, 2, load_balance=False)
    with pytest.raises(flashkiln.InvalidInputError, match="one length"):
        unshard_sequence([x, x[:, :, :4]], load_balance=False)


# -- typed errors before anything is sent -----------------------------------------------------

def _qkv(s=8, s_k=None, dtype=torch.bfloat16, hq=4, hkv=2, d=64):
    s_k = s if s_k is None else s_k
    return torch.zeros(1, hq, s, d, dtype=dtype), torch.zeros(1, hkv, s_k, d, dtype=dtype), \
        torch.zeros(1, hkv, s_k, d, dtype=dtype)


@pytest.mark.parametrize("kwargs,args,match", [
    ({}, _qkv(dtype=torch.float32), "dtype"),
    ({}, ("q",) + _qkv()[1:], "q must be a torch.Tensor"),
    ({}, _qkv(hq=3), "multiple"),
    ({"causal": True}, _qkv(s=7), "must be even"),
    ({"causal": True}, _qkv(s=8, s_k=6), "one length"),
    ({"causal": 1}, _qkv(), "causal must be a bool"),
    ({"deterministic": "yes"}, _qkv(), "deterministic must be None or a bool"),
    ({"scale": -1.0}, _qkv(), "scale"),
    ({}, _qkv(), "init_process_group"),
])
def test_entry_errors_without_communication(kwargs, args, match):
    assert not dist.is_initialized()
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.context_parallel_attention(*args, **kwargs)


def test_ring_input_errors():
    ring = SimulatedRing(2)
    q, k, v = (t.double() for t in _qkv())
    config = RingConfig(True, True, 0.125, None)
    with pytest.raises(flashkiln.InvalidInputError, match="one q, k and v per local rank"):
        ring_attention(ring, [q], [k], [v], config, REFERENCE_STEPS)
    with pytest.raises(flashkiln.InvalidInputError, match="same shape"):
        ring_attention(ring, [q, q[:, :, :6]], [k, k], [v, v], config, REFERENCE_STEPS)
    with pytest.raises(flashkiln.InvalidInputError, match="do not fit"):
        ring_attention(ring, [q, q], [k, k], [v[:, :, :4]] * 2, config, REFERENCE_STEPS)


@pytest.fixture
def one_process_group():
    """A gloo group of this process alone (world size 1)."""
    if not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_entry_needs_cuda_tensors(one_process_group):
    with pytest.raises(flashkiln.InvalidInputError, match="CUDA tensors"):
        flashkiln.context_parallel_attention(*_qkv(), causal=True)


def test_process_group_ring_of_one(one_process_group):
    case = Case(1, 5, True, False, seed=seed_of("one"))
    whole = case.tensors(torch.float64)
    got = run_ring(ProcessGroupRing(), case, whole, REFERENCE_STEPS)
    simulated = run_ring(SimulatedRing(1), case, whole, REFERENCE_STEPS)
    assert all(torch.equal(got[n][0], simulated[n][0]) for n in got)


# -- real processes (gloo) --------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_process_group_ring_equals_simulation(world):
    """world processes over gloo (point-to-point batches) give bitwise the simulation's results, for
    causal head-tail, causal contiguous and full attention (3 ranks: the ring's direction matters)."""
    if not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    cases = [Case(world, 6, True, True, seed=seed_of("p2p", world, 0)),
             Case(world, 5, True, False, hq=4, hkv=1, seed=seed_of("p2p", world, 1)),
             Case(world, 4, False, True, hq=2, hkv=2, d_v=4, seed=seed_of("p2p", world, 2), use_lse=False)]
    spawn(p2p_matches_simulation, world, "gloo", cases)

