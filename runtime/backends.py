"""Which kernel family runs a forward call: `backend=` ("hopper", "portable", or None for auto).

Auto takes the Hopper family on compute capability 9.0 when the call is one it implements and its
variant was generated, and the portable family otherwise. Asking for "hopper" explicitly never
falls back: what it cannot run raises UnsupportedError (or VariantNotFoundError at lookup).
"""
from __future__ import annotations

from typing import Any

from .errors import InvalidInputError, UnsupportedError
from .registry import KernelRegistry

BACKENDS = ("hopper", "portable")
HOPPER_CAPABILITY = (9, 0)


def check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise InvalidInputError(f"backend must be None (auto), {' or '.join(map(repr, BACKENDS))}; got {backend!r}")


def hopper_unsupported(capability: tuple[int, int]) -> str | None:
    """Why the Hopper forward cannot run on this GPU (None: it can, given its variant)."""
    if capability != HOPPER_CAPABILITY:
        return (f"the hopper backend needs compute capability {HOPPER_CAPABILITY[0]}.{HOPPER_CAPABILITY[1]} "
                f"(sm_90a), this GPU has {capability[0]}.{capability[1]}")
    return None


def forward_family(backend: str | None, capability: tuple[int, int], registry: KernelRegistry,
                   hopper_request: dict[str, Any]) -> str:
    """The family a forward call runs: "hopper" or "portable"."""
    check_backend(backend)
    if backend == "portable":
        return "portable"
    reason = hopper_unsupported(capability)
    if backend == "hopper":
        if reason:
            raise UnsupportedError(reason)
        return "hopper"
    if reason is None and registry.has(hopper_request, capability):
        return "hopper"
    return "portable"
