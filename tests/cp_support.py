"""Context-parallel test support: a pure-torch step op for the ring, sharded test cases, and
spawned torch.distributed workers (gloo on the CPU, NCCL on GPUs).

The reference step op has the interface of flashkiln.ring.StepOps and runs on any device and
dtype: its backward takes O and LSE from outside and applies the FlashAttention backward formulas
(dS = P * (dP - delta + dLSE)), so the ring with it is checked against autograd of the unsliced
reference (tests/reference.py), an independent computation.
"""
from __future__ import annotations

import contextlib
import math
import socket
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashkiln
from flashkiln.context_parallel import shard_sequence, unshard_sequence
from flashkiln.ring import RingConfig, StepOps, ring_attention
from flashkiln.ring_comm import ProcessGroupRing, SimulatedRing
from reference import GRAD_FLOOR, attention_reference, fa_style_check


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:  # square blocks only (the ring's diagonal)
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    empty = torch.isneginf(lse)[..., None]
    return torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None]).masked_fill(empty, 0.0)


def _group_sum(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """Per-query-head gradients summed over each kv head's group (GQA)."""
    b, hq, s, d = t.shape
    return t.view(b, hkv, hq // hkv, s, d).sum(2)


def reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.matmul(_probs(scores, lse), v), lse


def reference_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool, scale: float,
                       deterministic: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    probs = _probs(_scores(q, k, causal, scale), lse)
    k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k, v))
    dp = torch.matmul(dout, v_rep.transpose(-1, -2))
    row = (dout * out).sum(-1) - (0 if dlse is None else dlse)
    ds = probs * (dp - row[..., None])
    dq = torch.matmul(ds, k_rep) * scale
    dk = _group_sum(torch.matmul(ds.transpose(-1, -2), q) * scale, k.shape[1])
    dv = _group_sum(torch.matmul(probs.transpose(-1, -2), dout), k.shape[1])
    return dq, dk, dv


REFERENCE_STEPS = StepOps(reference_forward, reference_backward)


@dataclass(frozen=True)
class Case:
    """One ring test case: the whole sequence is world * s_local tokens."""

    world: int
    s_local: int
    causal: bool
    load_balance: bool
    hq: int = 6
    hkv: int = 2
    d: int = 8
    d_v: int = 8
    batch: int = 2
    seed: int = 0
    use_lse: bool = True  # the loss also reads the LSE (its gradient enters the backward)
    pad: int = 0  # the sequence's last `pad` tokens are padding: zero inputs and zero upstream gradients
    deterministic: bool | None = None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)

    def config(self) -> RingConfig:
        return RingConfig(self.causal, self.load_balance, self.scale, self.deterministic)

    def tensors(self, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The whole sequence's q, k, v and upstream gradients dout, dlse (fresh, from the seed)."""
        gen = torch.Generator(device=device).manual_seed(self.seed)
        s = self.world * self.s_local

        def make(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

        whole = {"q": make(self.batch, self.hq, s, self.d), "k": make(self.batch, self.hkv, s, self.d),
                 "v": make(self.batch, self.hkv, s, self.d_v), "dout": make(self.batch, self.hq, s, self.d_v),
                 "dlse": make(self.batch, self.hq, s, dt=torch.promote_types(dtype, torch.float32))}
        for t in whole.values():
            t[:, :, s - self.pad:] = 0
        return whole

    def padding(self, rank: int) -> torch.Tensor:
        """Bool (S_local,): which of `rank`'s rows are padding."""
        s = self.world * self.s_local
        return self.shard(torch.arange(s) >= s - self.pad, rank, dim=0)

    def shard(self, whole: torch.Tensor, rank: int, dim: int = 2) -> torch.Tensor:
        return shard_sequence(whole, rank, self.world, load_balance=self.load_balance, dim=dim)

    def unshard(self, slices: list[torch.Tensor]) -> torch.Tensor:
        return unshard_sequence(slices, load_balance=self.load_balance)


Attend = Callable[[list, list, list], tuple[list, list]]


def run_slices(case: Case, whole: dict[str, torch.Tensor], ranks: Sequence[int],
               attend: Attend) -> dict[str, list[torch.Tensor]]:
    """out, lse and the gradients dq, dk, dv (through autograd) of `ranks`' slices, by
    attend(qs, ks, vs) -> (outs, lses), lists over `ranks`."""
    leaves = {name: [case.shard(whole[name], r).detach().requires_grad_() for r in ranks] for name in ("q", "k", "v")}
    outs, lses = attend(leaves["q"], leaves["k"], leaves["v"])
    tensors = list(outs) + (list(lses) if case.use_lse else [])
    grads = [case.shard(whole["dout"], r) for r in ranks]
    grads += [case.shard(whole["dlse"], r).to(lses[0].dtype) for r in ranks] if case.use_lse else []
    torch.autograd.backward(tensors, grads)
    return {"out": [o.detach() for o in outs], "lse": [lse.detach() for lse in lses],
            **{f"d{name}": [t.grad for t in leaves[name]] for name in ("q", "k", "v")}}


def run_ring(ring, case: Case, whole: dict[str, torch.Tensor], ops: StepOps) -> dict[str, list[torch.Tensor]]:
    """run_slices through flashkiln.ring.ring_attention, for the ranks `ring` runs."""
    return run_slices(case, whole, ring.ranks,
                      lambda qs, ks, vs: ring_attention(ring, qs, ks, vs, case.config(), ops))


def reference_results(case: Case, whole: dict[str, torch.Tensor], dtype: torch.dtype,
                      block_rows: int | None = None) -> dict[str, torch.Tensor]:
    """out, lse, dq, dk, dv of the whole sequence by tests/reference.py, computed in `dtype` (REF32
    in fp32, REFLP in the inputs' dtype), `block_rows` query rows at a time (None: all), so that
    long sequences fit: a block's rows see the keys up to its end, causal bottom-right aligned,
    which is the whole sequence's causal mask. dK and dV add up over the blocks in fp32 (fp64 for
    fp64). lse: fp32 as tests/reference.py gives it (fp64 for fp64)."""
    q, k, v, dout, dlse = (whole[n] for n in ("q", "k", "v", "dout", "dlse"))
    s = q.shape[2]
    block_rows = block_rows or s
    acc = torch.promote_types(dtype, torch.float32)
    dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
    parts: dict[str, list[torch.Tensor]] = {"out": [], "lse": [], "dq": []}
    for start in range(0, s, block_rows):
        end = min(s, start + block_rows)
        keys = end if case.causal else s
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q[:, :, start:end], k[:, :, :keys],
                                                                   v[:, :, :keys])]
        ref = attention_reference(*leaves, "bottom_right" if case.causal else None, case.scale, dtype)
        outputs, grads = [ref.out], [dout[:, :, start:end].to(dtype)]
        if case.use_lse:
            outputs.append(ref.lse_graph)
            grads.append(dlse[:, :, start:end].to(dtype))
        dq, block_dk, block_dv = torch.autograd.grad(outputs, leaves, grads)
        parts["out"].append(ref.out.detach())
        parts["lse"].append(ref.lse_graph.detach() if dtype == torch.float64 else ref.lse)
        parts["dq"].append(dq)
        dk[:, :, :keys] += block_dk
        dv[:, :, :keys] += block_dv
    return {**{n: torch.cat(p, dim=2) for n, p in parts.items()}, "dk": dk.to(dtype), "dv": dv.to(dtype)}


# -- spawned processes ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, world_size: int, backend: str, *args) -> None:
    """Run worker(rank, world_size, *args) in `world_size` processes joined by a process group of
    `backend`; a failure in any of them fails here with its traceback."""
    mp.spawn(_entry, args=(world_size, free_port(), backend, worker, args), nprocs=world_size, join=True)


def _entry(rank: int, world_size: int, port: int, backend: str, worker, args: tuple) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # the CPU ranks share the machine's cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def p2p_matches_simulation(rank: int, world_size: int, cases: list[Case]) -> None:
    """Each case through the process group's ring and through the simulated ring: this rank's
    outputs and gradients bitwise equal (the same calls and sums, in the same order)."""
    for case in cases:
        whole = case.tensors(torch.float64)
        got = run_ring(ProcessGroupRing(), case, whole, REFERENCE_STEPS)
        simulated = run_ring(SimulatedRing(world_size), case, whole, REFERENCE_STEPS)
        for name, values in got.items():
            assert torch.equal(values[0], simulated[name][rank]), f"{name} differs from the simulation: {case}"


# -- GPU checks -------------------------------------------------------------------------------

FA_RULE = {"out": 2, "lse": 2, "dq": 3, "dk": 3, "dv": 3}  # shared/CONVENTIONS.md's FA-style(k)


@contextlib.contextmanager
def nan_fresh_memory():
    """Every tensor allocated inside starts as NaN (torch's deterministic mode fills fresh memory),
    so whatever the ring leaves unwritten shows. Give the cases an explicit `deterministic`: the
    kernels' backward would otherwise follow the flag."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def one_gpu_results(case: Case, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The unsliced flashkiln call on this GPU."""
    q, k, v, dout = (whole[n] for n in ("q", "k", "v", "dout"))
    causal = "bottom_right" if case.causal else None
    out, lse = flashkiln.attention_forward(q, k, v, causal=causal, scale=case.scale)
    dq, dk, dv = flashkiln.attention_backward(dout, q, k, v, out, lse, dlse=whole["dlse"] if case.use_lse else None,
                                              causal=causal, scale=case.scale, deterministic=case.deterministic)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def check_ranks(case: Case, got: dict[str, list[torch.Tensor]], ranks: Sequence[int], whole: dict[str, torch.Tensor],
                repro: str, block_rows: int | None = None) -> None:
    """Each rank's slices of out and lse within FA-style(2), of dq, dk and dv within FA-style(3)
    (REF32 and REFLP from reference_results), no NaN; as close to the unsliced one-GPU call as the
    rule's bound; and, with padding, its gradient rows exactly 0."""
    refs = [reference_results(case, whole, dtype, block_rows) for dtype in (torch.float32, whole["q"].dtype)]
    single = one_gpu_results(case, whole)
    for name, k in FA_RULE.items():
        floor = GRAD_FLOOR if name.startswith("d") else 1e-5
        for value, rank in zip(got[name], ranks, strict=True):
            ref32, reflp, one = (case.shard(results[name], rank) for results in (*refs, single))
            where = f"{name} (rank {rank})"
            fa_style_check(where, value, ref32, reflp, k, repro, floor)
            finite = torch.isfinite(ref32)
            bound = k * (reflp.float() - ref32)[finite].abs().max().item() + floor
            err = (value.float() - one.float())[finite].abs().max().item()
            assert err <= bound, f"{where}: max|ring - one GPU| = {err:.3g} exceeds {bound:.3g}\n{repro}"
            if case.pad and name.startswith("d"):
                padding = case.padding(rank).to(value.device)
                assert (value[:, :, padding] == 0).all(), f"{where}: padding rows are not exactly 0\n{repro}"


def entry_attend(case: Case) -> Attend:
    """run_slices' attend through the public entry over the default process group (scale: its default)."""
    def attend(qs, ks, vs):
        out, lse = flashkiln.context_parallel_attention(qs[0], ks[0], vs[0], causal=case.causal,
                                                        load_balance=case.load_balance,
                                                        deterministic=case.deterministic, return_lse=True)
        return [out], [lse]
    return attend


def nccl_matches_one_gpu(rank: int, world_size: int, cases: list[tuple[Case, torch.dtype]], test: str,
                         block_rows: int) -> None:
    """Each case through flashkiln.context_parallel_attention on this rank's GPU, checked by
    check_ranks; deterministic cases twice, bitwise equal."""
    torch.backends.cuda.matmul.allow_tf32 = False  # REF32 in fp32 (conftest's fixture does not reach here)
    for case, dtype in cases:
        whole = case.tensors(dtype, "cuda")
        for t in whole.values():
            dist.broadcast(t, 0)  # one sequence on every rank, whatever each GPU's generator gives
        attend = entry_attend(case)
        repro = f"repro: pytest -q '{test}'  (world size {world_size}, {dtype}, {case})"
        with nan_fresh_memory():
            got = run_slices(case, whole, (rank,), attend)
            if case.deterministic:
                again = run_slices(case, whole, (rank,), attend)
                for name, values in got.items():
                    assert torch.equal(values[0], again[name][0]), f"{name} differs between runs\n{repro}"
        check_ranks(case, got, (rank,), whole, repro, block_rows)
