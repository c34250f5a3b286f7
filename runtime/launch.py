"""Launching planned kernels on PyTorch's current stream of the inputs' device."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .manifest import KernelEntry

if TYPE_CHECKING:  # the registry chooses tiles with tile_choice, which uses ceil_div from here
    from .registry import KernelRegistry


@dataclass(frozen=True)
class KernelLaunch:
    """One planned launch: the chosen kernel, its grid and its packed parameter block."""

    entry: KernelEntry
    grid: tuple[int, int, int]
    params: ctypes.Structure
    # Buffers the parameters point at that the caller holds no reference to (scratch made while
    # planning): kept until the launch is enqueued, after which the stream orders their reuse.
    keep_alive: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Target:
    """The device a call runs on."""

    device: int
    capability: tuple[int, int]
    memory: int  # bytes of device memory

    @classmethod
    def of(cls, t: torch.Tensor) -> "Target":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)  # cached by torch
        return cls(index, (props.major, props.minor), props.total_memory)


def request(kernel: str, dtype: str, d_qk: int, d_v: int, causal: str = "none", deterministic: bool = False,
            bias: bool = False, family: str = "portable", packed: bool = False) -> dict[str, Any]:
    """The functional fields (all but arch) of the kernel a call needs (portable family by default;
    `packed`: a hopper kernel for packed batches, flashkiln.descriptor)."""
    return {"kernel": kernel, "family": family, "dtype": dtype, "d_qk": d_qk, "d_v": d_v, "causal": causal,
            "bias": "additive" if bias else "none", "deterministic": deterministic, "packed": packed}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def run(registry: KernelRegistry, target: Target, launches: list[KernelLaunch]) -> None:
    """Launch in order on the current stream (kernels of one call are ordered by that stream)."""
    with torch.cuda.device(target.device):
        stream = torch.cuda.current_stream(target.device).cuda_stream
        for launch in launches:
            registry.launch(launch.entry, target.device, target.capability, launch.grid, launch.params, stream)
