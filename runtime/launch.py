"""Planned launches and running them on PyTorch's current stream of the inputs' device.

A planner (a family's, flashkiln.families) turns one call's checked inputs into KernelLaunches:
the chosen kernel, its grid and a parameter block filled for that call. A launch also names the
block's pointer fields and tensor maps by role ("q", "lse", "delta", ...), so that a later call of
the same shape can reuse the block: `run` copies it and patches only those from the call's tensors
(a tensor map's address with cuTensorMapReplaceAddress, not a new encoding).
"""
from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .archs import arch_preference
from .manifest import KernelEntry

try:
    from ._launch import Steps as NativeSteps
except ImportError:  # a source tree whose C module is not built: the launches run from Python
    NativeSteps = None

if TYPE_CHECKING:  # the registry is handed in by the callers
    from .registry import KernelRegistry


@dataclass(frozen=True)
class KernelLaunch:
    """One planned launch: the chosen kernel, its grid and its packed parameter block."""

    entry: KernelEntry
    grid: tuple[int, int, int]
    params: ctypes.Structure
    # Pointer fields of `params`, each patched from the call's tensor of the same role (its name).
    pointers: tuple[str, ...] = ()
    # (field, role, address): TMA descriptors in `params`, each encoded for the planning call's
    # `role` tensor at that address, and re-pointed at the call's.
    tensor_maps: tuple[tuple[str, str, int], ...] = ()

    @classmethod
    def planned(cls, entry: KernelEntry, grid: tuple[int, int, int], params: ctypes.Structure,
                tensors: Mapping[str, torch.Tensor | None],
                tensor_maps: tuple[tuple[str, str, int], ...] = ()) -> "KernelLaunch":
        """The launch with every field of `params` that names a role of `tensors` set to its address.
        Roles that are None stay null for every call of the plan: which roles a call has is part of
        its plan-cache key."""
        fields = {name for name, _ in type(params)._fields_}
        for name in fields.intersection(tensors):
            setattr(params, name, _address(tensors[name]))
        pointers = tuple(name for name, t in tensors.items() if name in fields and t is not None)
        return cls(entry, grid, params, pointers, tensor_maps)

    def bound(self, tensors: Mapping[str, torch.Tensor | int | None], replace_address: Any) -> ctypes.Structure:
        """A copy of the parameter block pointing at `tensors` (scratch roles may be addresses)."""
        params = type(self.params).from_buffer_copy(self.params)
        for name in self.pointers:
            setattr(params, name, _bound_address(tensors[name]))
        if self.tensor_maps:
            base = ctypes.addressof(params)
            for offset, role, planned in self._map_offsets:
                address = _bound_address(tensors[role])
                if address != planned:
                    replace_address(base + offset, address)
        return params

    @functools.cached_property
    def _map_offsets(self) -> tuple[tuple[int, str, int], ...]:
        """`tensor_maps` with each field's byte offset in the block for its name."""
        fields = type(self.params)
        return tuple((getattr(fields, name).offset, role, planned) for name, role, planned in self.tensor_maps)


@dataclass(frozen=True)
class BackwardLaunches:
    """A backward planner's result (every family's): its launches in order, preprocess first, main
    kernel second, then what turns dQ's accumulator into dQ."""

    launches: list[KernelLaunch]
    route: str  # how dQ is accumulated: one of dq_routes.ROUTES


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _bound_address(t: torch.Tensor | int) -> int:
    """A call's tensor's address, or a scratch role's (ScratchBlock.addresses)."""
    return t if t.__class__ is int else t.data_ptr()


@dataclass(frozen=True)
class Scratch:
    """A buffer the kernels use besides the call's inputs and outputs, made again for every call
    (the stream orders the memory's reuse after the kernels)."""

    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    zeroed: bool  # else the kernels write it before they read it


@dataclass
class ScratchSet:
    """The scratch a planner asks for: made now, for the planning call, and recorded for later ones."""

    device: torch.device
    specs: list[Scratch] = field(default_factory=list)
    tensors: dict[str, torch.Tensor | None] = field(default_factory=dict)

    def take(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, zeroed: bool = False) -> torch.Tensor:
        spec = Scratch(role, tuple(shape), dtype, zeroed)
        self.specs.append(spec)
        t = self.tensors[role] = allocate(spec, self.device)
        return t

    def absent(self, role: str) -> None:
        """A role this plan does not use (a null pointer)."""
        self.tensors[role] = None


def allocate(spec: Scratch, device: torch.device) -> torch.Tensor:
    return (torch.zeros if spec.zeroed else torch.empty)(spec.shape, dtype=spec.dtype, device=device)


def allocate_all(specs: tuple[Scratch, ...], device: torch.device) -> dict[str, torch.Tensor]:
    return {s.role: allocate(s, device) for s in specs}


# Bytes: each role's offset in a ScratchBlock. torch's caching allocator rounds every allocation to
# 512 bytes, so each role keeps the alignment and slack it had as an allocation of its own.
SCRATCH_ALIGNMENT = 512


@dataclass(frozen=True)
class ScratchBlock:
    """A plan's scratch as one allocation per call, for the calls that hand it to the kernels alone
    (each allocation costs host time): each role at a fixed offset, the roles the kernels need
    zeroed side by side at the front, so that one fill zeroes them all. Calls that read scratch
    back, or return a view of it (a full bias's dBias), allocate each role apart (allocate_all), so
    that a returned view holds no other role's memory."""

    offsets: tuple[tuple[Scratch, int], ...]  # (spec, byte offset)
    zeroed_bytes: int
    nbytes: int

    @classmethod
    def of(cls, specs: tuple[Scratch, ...]) -> "ScratchBlock":
        offsets, end, zeroed_bytes = [], 0, 0
        for spec in sorted(specs, key=lambda s: not s.zeroed):  # stable: zeroed first, each in plan order
            offsets.append((spec, end))
            end += ceil_div(math.prod(spec.shape) * spec.dtype.itemsize, SCRATCH_ALIGNMENT) * SCRATCH_ALIGNMENT
            if spec.zeroed:
                zeroed_bytes = end
        return cls(tuple(offsets), zeroed_bytes, end)

    def allocate(self, device: torch.device) -> torch.Tensor:
        if self.zeroed_bytes == self.nbytes:
            return torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        block = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        if self.zeroed_bytes:
            block[:self.zeroed_bytes].zero_()
        return block

    def bind(self, block: torch.Tensor, tensors: dict[str, torch.Tensor | int | None]) -> None:
        """Each role's address in `block` put into a call's `tensors` (what `run` binds; the kernels
        need no tensor), in place: a dict of its own merged into them costs host time."""
        base = block.data_ptr()
        for spec, offset in self.offsets:
            tensors[spec.role] = base + offset


@dataclass(frozen=True)
class CallPlan:
    """What a call does, decided once for all calls of its plan-cache key (flashkiln.plan_cache):
    the fields a forward's and a backward's plans share."""

    registry: KernelRegistry
    target: Target
    family: str | None  # None: nothing to compute
    launches: tuple[KernelLaunch, ...]
    scratch: tuple[Scratch, ...]
    causal: str
    window: tuple[int, int] | None  # (left, right), inputs.check_window's
    softcap: float | None  # the cap, inputs.check_softcap's
    scale: float
    scores: tuple[int, int, int, int]  # (B, H_q, S_q, S_k), what a bias broadcasts to
    dims: tuple[int, int]  # the kernels' head dims (larger than the call's: zero-padded copies)
    kernels: tuple[Any, ...]  # the launches' loaded kernels (registry.load), loaded when planned

    @functools.cached_property
    def scratch_block(self) -> ScratchBlock:
        return ScratchBlock.of(self.scratch)

    @functools.cached_property
    def steps(self) -> tuple[tuple, ...]:
        """What `run` hands the driver per launch, fixed for the plan: (launch, kernel handle, grid,
        block, dynamic shared memory, the index of an earlier launch whose parameter block it
        shares, so whose binding it reuses, or None)."""
        first: dict[int, int] = {}  # id of a parameter block -> the first launch that has it
        steps = []
        for i, (launch, kernel) in enumerate(zip(self.launches, self.kernels)):
            shared = first.setdefault(id(launch.params), i)
            steps.append((launch, kernel.handle, launch.grid, (launch.entry.threads, 1, 1), launch.entry.smem_bytes,
                          None if shared == i else shared))
        return tuple(steps)

    @functools.cached_property
    def native(self) -> Any | None:
        """The plan's steps as flashkiln._launch runs them (it reads each role's address from a
        call's tensors itself); None where the module is not built or the driver offers no entry
        points."""
        entry_points = None if NativeSteps is None else self.registry.driver.entry_points()
        if entry_points is None:
            return None
        roles: dict[str, int] = {}
        items = []
        for launch, kernel, grid, block, smem_bytes, shared in self.steps:
            fields = type(launch.params)
            pointers = []
            for name in launch.pointers:
                field = getattr(fields, name)
                if field.size != ctypes.sizeof(ctypes.c_void_p):
                    raise TypeError(f"parameter field {name} is not pointer-sized")
                pointers.append((field.offset, roles.setdefault(name, len(roles))))
            maps = tuple((offset, roles.setdefault(role, len(roles)), planned)
                         for offset, role, planned in launch._map_offsets)
            items.append((int(kernel), grid, block, smem_bytes, bytes(launch.params), tuple(pointers), maps,
                          -1 if shared is None else shared))
        return NativeSteps(*entry_points, tuple(roles), items)


def load_kernels(registry: KernelRegistry, target: Target, launches: tuple[KernelLaunch, ...]) -> tuple[Any, ...]:
    """The launches' kernels, loaded (and configured for the target) when a plan is made."""
    return tuple(registry.load(launch.entry, target.device, target.capability) for launch in launches)


@dataclass(frozen=True)
class Target:
    """The device a call runs on."""

    device: int
    capability: tuple[int, int]
    memory: int  # bytes of device memory
    multiprocessors: int
    l2_bytes: int
    smem_per_block: int  # opt-in shared memory per block: the tunings a device can run (registry.tunings)

    @property
    def limits(self) -> tuple[tuple[int, int], int]:
        """What the registry picks a device's kernels by (KernelRegistry.find's capability, smem_limit)."""
        return self.capability, self.smem_per_block

    @classmethod
    def of(cls, t: torch.Tensor) -> "Target":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)  # cached by torch
        capability = (props.major, props.minor)
        smem = getattr(props, "shared_memory_per_block_optin", None)
        if smem is None:  # a torch without the field: the arch table's limit for the device's own arch
            known = arch_preference(capability)
            smem = known[0].max_smem_per_block if known else 0
        return cls(index, capability, props.total_memory, props.multi_processor_count, props.L2_cache_size, smem)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _current_stream(device: int) -> int:
    # The raw handle without building a torch.cuda.Stream object (a few microseconds per call).
    return torch._C._cuda_getCurrentRawStream(device)


def _current_device() -> int:
    # torch.cuda.current_device without its lazy-initialization check: the call's tensors are on
    # the GPU, so torch has initialized CUDA in this process.
    return torch._C._cuda_getDevice()


def run(plan: CallPlan, tensors: Mapping[str, torch.Tensor | int | None]) -> None:
    """Launch the plan's kernels in order on the current stream (kernels of one call are ordered
    by that stream), each launch's block patched to point at `tensors` first."""
    device = plan.target.device
    if _current_device() != device:
        with torch.cuda.device(device):
            return run(plan, tensors)
    driver = plan.registry.driver
    stream = _current_stream(device)
    driver.bind_context(device)
    native = plan.native
    if native is not None:
        failure = native.run(stream, tensors)
        if failure is not None:
            what, step, code = failure
            driver.raise_failure(f"{what} (launch {step} of {len(plan.steps)})", code)
        return
    replace_address = driver.replace_tensor_map_address
    blocks: list[ctypes.Structure] = []  # each launch's bound block; launches that share a block share its binding
    for launch, kernel, grid, block, smem_bytes, shared in plan.steps:
        params = launch.bound(tensors, replace_address) if shared is None else blocks[shared]
        blocks.append(params)
        driver.launch(kernel, grid, block, smem_bytes, stream, params)
