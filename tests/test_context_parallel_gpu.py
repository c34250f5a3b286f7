"""Context parallelism on the GPU: flashkiln's kernels inside the ring.

One GPU: the ring simulated in one process (the sequence cut into W slices, every rank's steps
run in turn, flashkiln.ring_comm.SimulatedRing), W 2 and 4, d 64 and 128, causal with and without
head-tail load balancing and full attention, GQA 6/2 and MQA, bf16 and fp16, local lengths off
the tile grid, the LSE's gradient included: each rank's out and lse within FA-style(2) and dq, dk,
dv within FA-style(3) of the unsliced fp32 reference, as close to the unsliced flashkiln call,
no NaN (every allocation inside the ring starts as NaN); padding rows' gradients exactly 0; the
deterministic mode bitwise over 20 runs; the public entry over a process group of one.

Two GPUs (skipped with the reason below that): 2 NCCL processes through the public entry,
causal and not, d 64 and 128, GQA, up to 64k tokens per GPU, against the same references
(computed 1024-2048 query rows at a time) and the one-GPU call on the whole sequence.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from cp_support import (Case, check_ranks, entry_attend, free_port, nan_fresh_memory, nccl_matches_one_gpu,
                        run_ring, run_slices, spawn)
from flashkiln.context_parallel import FLASHKILN_STEPS
from flashkiln.ring_comm import SimulatedRing
from reference import repro_line, seed_of

pytestmark = pytest.mark.gpu
_repro = partial(repro_line, "test_context_parallel_gpu.py")
FILE = "tests/test_context_parallel_gpu.py"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (causal, load_balance); full attention does not depend on the layout.
MODES = {"causal-headtail": (True, True), "causal-contiguous": (True, False), "full": (False, True)}


def _case(world: int, mode: str, d: int, *, s_local: int | None = None, **kwargs) -> Case:
    causal, load_balance = MODES[mode]
    if s_local is None:  # off every tile grid: head-tail chunks of 67 rows, contiguous slices of 129
        s_local = 2 * 67 if load_balance else 129
    kwargs.setdefault("deterministic", False)  # explicit: nan_fresh_memory turns torch's flag on
    return Case(world, s_local, causal, load_balance, d=d, d_v=d,
                seed=seed_of("cp-gpu", world, mode, d, s_local, tuple(sorted(kwargs.items()))), **kwargs)


def _simulate(case: Case, dtype: torch.dtype) -> tuple[dict, dict]:
    whole = case.tensors(dtype, "cuda")
    with nan_fresh_memory():
        got = run_ring(SimulatedRing(case.world), case, whole, FLASHKILN_STEPS)
    return whole, got


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ring_matches_one_gpu(world, mode, d, dtype):
    case = _case(world, mode, d)
    whole, got = _simulate(case, dtype)
    check_ranks(case, got, range(world), whole, _repro("test_simulated_ring_matches_one_gpu", world=world, mode=mode,
                                                       d=d, dtype=dtype, seed=case.seed))


@pytest.mark.parametrize("hq,hkv,use_lse", [(6, 1, True), (4, 4, False)], ids=["mqa", "mha-no-lse"])
@pytest.mark.parametrize("mode", ["causal-headtail", "full"])
def test_simulated_ring_heads(mode, hq, hkv, use_lse):
    case = _case(4, mode, 128, hq=hq, hkv=hkv, use_lse=use_lse)
    whole, got = _simulate(case, torch.bfloat16)
    check_ranks(case, got, range(4), whole, _repro("test_simulated_ring_heads", mode=mode, hq=hq, hkv=hkv,
                                                   use_lse=use_lse, seed=case.seed))


@pytest.mark.parametrize("mode", MODES)
def test_simulated_ring_longer_slices(mode):
    """4096 tokens per rank: many tiles per step, the head-tail steps on half slices."""
    case = _case(2, mode, 128, s_local=4096, batch=1)
    whole, got = _simulate(case, torch.bfloat16)
    check_ranks(case, got, range(2), whole, _repro("test_simulated_ring_longer_slices", mode=mode, seed=case.seed),
                block_rows=2048)


@pytest.mark.parametrize("load_balance", [True, False], ids=["headtail", "contiguous"])
@pytest.mark.parametrize("world", [2, 4])
def test_padding_rows_get_exactly_zero_gradients(world, load_balance):
    """The sequence's last 100 tokens are padding (zero inputs and upstream gradients), across
    chunk boundaries: their dq, dk, dv rows are exactly 0 on every rank (check_ranks)."""
    case = _case(world, "causal-headtail" if load_balance else "causal-contiguous", 128, pad=100)
    whole, got = _simulate(case, torch.bfloat16)
    check_ranks(case, got, range(world), whole, _repro("test_padding_rows_get_exactly_zero_gradients", world=world,
                                                       load_balance=load_balance, seed=case.seed))


@pytest.mark.parametrize("mode", ["causal-headtail", "full"])
@pytest.mark.parametrize("world", [2, 4])
def test_deterministic_ring_is_bitwise_reproducible(world, mode):
    """20 runs with deterministic=True (fresh NaN allocations each run): identical outputs and
    gradients on every rank."""
    case = _case(world, mode, 128, deterministic=True)
    whole, first = _simulate(case, torch.bfloat16)
    repro = _repro("test_deterministic_ring_is_bitwise_reproducible", world=world, mode=mode, seed=case.seed)
    for run in range(19):
        _, again = _simulate(case, torch.bfloat16)
        for name, values in first.items():
            for rank, (a, b) in enumerate(zip(values, again[name])):
                assert torch.equal(a, b), f"{name} of rank {rank} differs in run {run + 2}\n{repro}"
    check_ranks(case, first, range(world), whole, repro)


@pytest.fixture
def nccl_group_of_one():
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", MODES)
def test_entry_on_a_group_of_one(nccl_group_of_one, mode):
    """flashkiln.context_parallel_attention over a process group of one rank is attention itself."""
    case = _case(1, mode, 64, s_local=300)
    whole = case.tensors(torch.bfloat16, "cuda")
    with nan_fresh_memory():
        got = run_slices(case, whole, (0,), entry_attend(case))
    check_ranks(case, got, (0,), whole, _repro("test_entry_on_a_group_of_one", mode=mode, seed=case.seed))


# -- two GPUs, NCCL ---------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"needs 2 CUDA GPUs for 2 NCCL ranks, this machine has "
                                     f"{torch.cuda.device_count()}")


@two_gpus
def test_nccl_two_gpus_match_one_gpu():
    """World size 2 through the public entry: causal (head-tail, contiguous, padded) and full, d 64
    and 128, GQA 6/2, bf16 and fp16, deterministic cases twice (bitwise equal)."""
    cases = [(_case(2, mode, d, s_local=4096, batch=1, deterministic=d == 128), torch.bfloat16)
             for mode in MODES for d in (64, 128)]
    cases += [(_case(2, "causal-headtail", 128, s_local=2 * 1000 + 2, pad=777), torch.bfloat16),
              (_case(2, "causal-contiguous", 64, s_local=1023), torch.float16)]
    spawn(nccl_matches_one_gpu, 2, "nccl", cases, f"{FILE}::test_nccl_two_gpus_match_one_gpu", 2048)


@two_gpus
@pytest.mark.parametrize("s_local,d,mode", [(65536, 128, "causal-headtail"), (32768, 64, "full")],
                         ids=["64k-d128-causal-headtail", "32k-d64-full"])
def test_nccl_two_gpus_long_sequences(s_local, d, mode):
    """Up to 64k tokens per GPU (GQA 2/1), against references computed 1024 query rows at a time."""
    cases = [(_case(2, mode, d, s_local=s_local, batch=1, hq=2, hkv=1), torch.bfloat16)]
    spawn(nccl_matches_one_gpu, 2, "nccl", cases, f"{FILE}::test_nccl_two_gpus_long_sequences", 1024)
