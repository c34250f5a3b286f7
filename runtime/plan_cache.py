"""Plans cached by everything that changes a launch, so that a repeated call only runs its plan.

A key holds, for every tensor argument, its type, shape, strides, dtype, device and whether its
address is 16-byte aligned (the checks and the kernels' layout rules read nothing else of it), and
every other argument by value. A call whose key equals a cached one passes every check that call
passed, and gets the same kernels, grids and scratch: the checks and the planning are skipped.
Calls the key cannot describe (given output buffers, whose overlap with the inputs depends on
their addresses; boolean masks, converted per call) are planned every time.
"""
from __future__ import annotations

import threading
from typing import Any, Hashable

import torch

CAPACITY = 1024


def tensor_key(t: Any) -> Hashable:
    """What the checks and the planning read of a tensor argument (None stays None)."""
    if t is None:
        return None
    return type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def value_key(value: Any) -> Hashable:
    """A plain argument by type and value (True must not hit the plan of 1, nor [1, 2] that of (1, 2))."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple(value_key(x) for x in value)
    return type(value), value


def storage_key(t: torch.Tensor) -> Hashable:
    """tensor_key and the room its storage leaves after it (a bias is read in whole 16-byte pieces)."""
    return tensor_key(t), t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()


def packed_key(packed: Any) -> Hashable:
    """A packed batch's boundaries (flashkiln.varlen.PackedBatch) as tensor_key sees tensors."""
    if packed is None:
        return None
    return (type(packed), tensor_key(packed.cu_seqlens_q), tensor_key(packed.cu_seqlens_k),
            type(packed.max_seqlen_q), packed.max_seqlen_q, type(packed.max_seqlen_k), packed.max_seqlen_k)


class PlanCache:
    """A bounded map from keys to plans; the oldest plan leaves first."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._plans: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        return self._plans.get(key)

    def put(self, key: Hashable, plan: Any) -> None:
        with self._lock:
            while len(self._plans) >= self.capacity:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan

    def newest(self) -> Any:
        """The plan stored last (None when empty): what the last call that missed the cache planned."""
        with self._lock:
            return next(reversed(self._plans.values()), None)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
