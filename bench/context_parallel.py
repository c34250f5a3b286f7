"""Context-parallel scaling efficiency: forward + backward of flashkiln.context_parallel_attention
at world size W against one GPU running flashkiln on one rank's share of the sequence (S / W).

Efficiency = per-GPU throughput of the ring / throughput of the one-GPU call, each in FLOP/s of
the visible (query, key) pairs it computes (shared/CONVENTIONS.md: forward 4 * B * H_q * pairs *
d, backward 2.5x that): the ring's W GPUs share the whole sequence's pairs, the one GPU computes
the pairs of S / W tokens. 1.0 means the ring costs nothing beyond the kernels' own work; the
target is >= 0.9 at S / W >= 32k, d 128, causal with head-tail load balancing.

Timing: back-to-back steps between CUDA events after a barrier (host time and the ring's waits
included, as a training loop sees them), the median of the repeats, the slowest rank's. Memory:
each rank's peak allocation during a ring step above its inputs (q, k, v, dO), beside the
one-GPU step's and the size of one K/V slice.

Usage (2 GPUs): tools/pyenv.sh torchrun --nproc_per_node 2 bench/context_parallel.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import flashkiln
from flashkiln.context_parallel import shard_sequence
from host_overhead import training_step  # bench/ is on sys.path when one of its scripts runs
from memory import step_peak_mib


def causal_pairs(s: int, causal: bool) -> int:
    return s * (s + 1) // 2 if causal else s * s


def step_flops(batch: int, heads: int, s: int, d: int, causal: bool) -> float:
    return 3.5 * 4 * batch * heads * causal_pairs(s, causal) * d  # forward + backward (2.5x)


def seconds_per_step(step: Callable[[], None], steps: int, repeats: int) -> float:
    """Median over `repeats` of `steps` back-to-back steps, the slowest rank's."""
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / steps)
    median = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def measure(s_local: int, d: int, heads: int, kv_heads: int, causal: bool, args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    s = s_local * world
    whole = [torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
             for h in (heads, kv_heads, kv_heads, heads)]
    # The ring: this rank's head-tail slices of the whole sequence.
    q, k, v, dout = (shard_sequence(t, rank, world, load_balance=True) for t in whole)
    del whole
    ring_leaves = [t.requires_grad_() for t in (q, k, v)]
    ring = training_step(lambda q, k, v: flashkiln.context_parallel_attention(q, k, v, causal=causal), ring_leaves,
                         dout)
    # One GPU on S / W tokens: attention over this rank's slice alone.
    one_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    one = training_step(lambda q, k, v: flashkiln.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                               enable_gqa=True), one_leaves, dout)
    t_ring = seconds_per_step(ring, args.steps, args.repeats)
    t_one = seconds_per_step(one, args.steps, args.repeats)
    ring_tflops = step_flops(1, heads, s, d, causal) / world / t_ring / 1e12
    one_tflops = step_flops(1, heads, s_local, d, causal) / t_one / 1e12
    for t in ring_leaves + one_leaves:
        t.grad = None
    memory = torch.tensor([step_peak_mib(ring), step_peak_mib(one)], device="cuda")
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    return {"s_local": s_local, "s": s, "d": d, "heads": heads, "kv_heads": kv_heads, "causal": causal,
            "ring_ms": t_ring * 1e3, "one_gpu_ms": t_one * 1e3, "ring_tflops_per_gpu": ring_tflops,
            "one_gpu_tflops": one_tflops, "efficiency": ring_tflops / one_tflops,
            "ring_peak_extra_mib": memory[0].item(), "one_gpu_peak_extra_mib": memory[1].item(),
            "kv_slice_mib": (k.numel() + v.numel()) * k.element_size() / 2**20}


def table(rows: list[dict], world: int) -> str:
    lines = [f"| S/GPU | d | H_q/H_kv | causal | ring ms | one GPU ms (S/{world}) | ring TFLOP/s/GPU | "
             "one GPU TFLOP/s | efficiency | ring peak MiB | one GPU peak MiB | K/V slice MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['s_local']} | {r['d']} | {r['heads']}/{r['kv_heads']} | {r['causal']} | "
                     f"{r['ring_ms']:.2f} | {r['one_gpu_ms']:.2f} | {r['ring_tflops_per_gpu']:.0f} | "
                     f"{r['one_gpu_tflops']:.0f} | {r['efficiency']:.3f} | {r['ring_peak_extra_mib']:.0f} | "
                     f"{r['one_gpu_peak_extra_mib']:.0f} | {r['kv_slice_mib']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="8192,16384,32768,65536", help="tokens per GPU")
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--kv-heads", type=int, default=0, help="0: as many as query heads (H_q = 2048 / d)")
    parser.add_argument("--causal", default="true,false")
    parser.add_argument("--steps", type=int, default=5, help="back-to-back steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("build/bench-context-parallel"))
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL's first use (torchrun sets it)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    rows = []
    for causal in (c.strip() == "true" for c in args.causal.split(",")):
        for d in (int(x) for x in args.dims.split(",")):
            heads = 2048 // d
            for s_local in (int(x) for x in args.seqlens.split(",")):
                rows.append(measure(s_local, d, heads, args.kv_heads or heads, causal, args))
                if rank == 0:
                    print(table(rows[-1:], dist.get_world_size()).splitlines()[-1], flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"world_size": dist.get_world_size(), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "rows": rows}
        (args.out / "context_parallel.json").write_text(json.dumps(result, indent=2))
        (args.out / "context_parallel.md").write_text(table(rows, dist.get_world_size()) + "\n")
        print(table(rows, dist.get_world_size()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
