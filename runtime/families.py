"""The kernel families the runtime can plan for, and which one runs a call (`backend=`).

Each family is one module (portable_family, hopper_family) that declares its name, the GPUs it
runs on (`runs_on`) and a planner per direction it has kernels for. Forward and backward dispatch
through this table alike: `backend=None` (auto) takes the first family in FAMILIES that runs on
the GPU, has the direction, has the call's variant generated, and can address its tensors; else
the next. An explicit backend never falls back: what it cannot run raises UnsupportedError (or
VariantNotFoundError at lookup). The route taken is logged at DEBUG.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import hopper_family, portable_family
from .errors import InvalidInputError, UnsupportedError
from .launch import ScratchSet, Target
from .registry import KernelRegistry

log = logging.getLogger("flashkiln")

DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Family:
    name: str
    runs_on: Callable[[tuple[int, int]], str | None]  # why it cannot run on a capability, or None
    planners: dict[str, Callable[..., Any]]  # direction -> planner(call, target, registry, scratch)
    # direction -> the functional fields of the call's main kernel, where they are not call.request's
    requests: dict[str, Callable[[Any], dict]] = field(default_factory=dict)

    def request(self, direction: str, call: Any) -> dict:
        make = self.requests.get(direction)
        return make(call) if make is not None else call.request(self.name)


# In auto's order of preference.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(hopper_family.NAME, hopper_family.runs_on,
           {"forward": hopper_family.plan_forward, "backward": hopper_family.plan_backward},
           {"backward": hopper_family.backward_request}),
    Family(portable_family.NAME, portable_family.runs_on,
           {"forward": portable_family.plan_forward, "backward": portable_family.plan_backward},
           {"backward": portable_family.backward_request}),
)}
BACKENDS = tuple(FAMILIES)


def check_backend(backend: str | None) -> None:
    if backend is not None and backend not in FAMILIES:
        raise InvalidInputError(f"backend must be None (auto), {' or '.join(map(repr, BACKENDS))}; got {backend!r}")


def plan(direction: str, call: Any, backend: str | None, target: Target, registry: KernelRegistry,
         device: torch.device) -> tuple[str, Any, ScratchSet]:
    """(family name, its planner's result, the scratch it took) for `call` in `direction`."""
    check_backend(backend)
    # The planners encode tensor maps through the driver, which refuses without a current context:
    # bound first, for a thread where torch made no call that binds one (autograd's).
    registry.driver.bind_context(target.device)
    if backend is not None:
        family = FAMILIES[backend]
        reason = family.runs_on(target.capability)
        if reason is None and direction not in family.planners:
            reason = f"the {family.name} family has no {direction} kernels"
        if reason:
            raise UnsupportedError(reason)
        scratch = ScratchSet(device)
        return family.name, family.planners[direction](call, target, registry, scratch), scratch
    candidates = [f for f in FAMILIES.values() if direction in f.planners and f.runs_on(target.capability) is None]
    for family in candidates:
        last = family is candidates[-1]
        # The last candidate looks its variant up itself: its errors name what is missing (or JIT builds it).
        if not last and not registry.has(family.request(direction, call), target.capability):
            continue
        scratch = ScratchSet(device)
        try:
            return family.name, family.planners[direction](call, target, registry, scratch), scratch
        except UnsupportedError as exc:
            if last:
                raise
            log.debug("flashkiln %s: the %s family cannot run the call (%s)", direction, family.name, exc)
    raise UnsupportedError(f"no kernel family runs the {direction} on compute capability "
                           f"{target.capability[0]}.{target.capability[1]}")
