"""Where a call's host time goes: the parts of a planned forward and of a training step, timed alone.

B = 1, H = 1, S = 128, d = 64, bf16 (bench/host_overhead.py's shape); each row is the median of
5 loops of 1000 calls, µs per call. Then a cProfile of training steps, by own time, to rank the
Python functions of a step (cProfile's own overhead inflates every row alike).

Usage (on a GPU machine): tools/pyenv.sh python3 tools/profile_host.py > host-parts.txt
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkiln
from flashkiln import backward, forward, inputs, launch, ops
from flashkiln.calls import forward_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from host_overhead import _AllocateOnly, per_call_us, training_step  # noqa: E402  (bench/ is a folder of scripts)


def main() -> None:
    q, k, v, dout = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    rows: list[tuple[str, float]] = []

    def row(name: str, fn: Callable[[], object]) -> None:
        try:
            rows.append((name, statistics.median(per_call_us(fn) for _ in range(5))))
        except Exception as exc:  # a part that fails is reported, the others still run
            rows.append((f"{name} (failed: {type(exc).__name__}: {exc})", float("nan")))
        print(f"{rows[-1][1]:8.1f}  {rows[-1][0]}", flush=True)

    out, lse = flashkiln.attention_forward(q, k, v)
    key = forward._key(q, k, v, None, None, None, None, None, None, None, None, None)
    plan = forward.PLANS.get(key)
    driver = plan.registry.driver
    first = plan.launches[0]
    tensors = forward_tensors(q, k, v, out, lse, None, None, None)
    params = first.bound(tensors, driver.replace_tensor_map_address)
    stream = torch.cuda.current_stream().cuda_stream
    print(f"forward plan: family {plan.family}, {len(plan.launches)} launch(es), "
          f"{len(first.tensor_maps)} tensor map(s), {len(first.pointers)} pointer(s)")

    row("attention_forward (hit)", lambda: flashkiln.attention_forward(q, k, v))
    row("  forward._key", lambda: forward._key(q, k, v, None, None, None, None, None, None, None, None, None))
    row("  PLANS.get", lambda: forward.PLANS.get(key))
    row("  empty out + empty lse", lambda: (inputs.empty_in_memory_order(q, 64),
                                            torch.empty((1, 1, 128), dtype=torch.float32, device=q.device)))
    row("  torch.empty (one)", lambda: torch.empty((1, 1, 128), dtype=torch.float32, device=q.device))
    row("  forward_tensors", lambda: forward_tensors(q, k, v, out, lse, None, None, None))
    row("  launch.run", lambda: launch.run(plan, tensors))
    row("    torch.cuda.current_device", torch.cuda.current_device)
    row("    current raw stream", lambda: launch._current_stream(0))
    row("    bind_context", lambda: driver.bind_context(0))
    row("    KernelLaunch.bound", lambda: first.bound(tensors, driver.replace_tensor_map_address))
    row("    driver.launch", lambda: driver.launch(plan.kernels[0].handle, first.grid, (first.entry.threads, 1, 1),
                                                   first.entry.smem_bytes, stream, params))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        row("torch SDPA flash forward", lambda: F.scaled_dot_product_attention(q, k, v))

    def train(attend: Callable[..., torch.Tensor]) -> Callable[[], None]:
        return training_step(attend, leaves, dout)

    def graph_only() -> None:
        ops.scaled_dot_product_attention(*leaves)

    def raw_pair() -> None:
        o, stats = flashkiln.attention_forward(q, k, v)
        flashkiln.attention_backward(dout, q, k, v, o, stats)

    row("training step, flashkiln SDPA", train(ops.scaled_dot_product_attention))
    row("  SDPA forward with autograd inputs, no backward", graph_only)
    row("  raw forward + raw backward, no autograd", raw_pair)
    row("  attention_backward (hit)", lambda: flashkiln.attention_backward(dout, q, k, v, out, lse))
    row("floor: autograd.Function that only allocates", train(_AllocateOnly.apply))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        row("training step, torch SDPA flash", train(F.scaled_dot_product_attention))

    profiler = cProfile.Profile()
    step = train(ops.scaled_dot_product_attention)
    profiler.enable()
    for _ in range(2000):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    print(text.getvalue())
    backward.PLANS.clear()


if __name__ == "__main__":
    main()
