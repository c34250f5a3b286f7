"""How the backward accumulates dQ (its three routes), and which route a call takes.

- "atomic": key tiles add dS K into an fp32 accumulator with unordered atomics (not deterministic).
- "ordered": they add in a fixed key-tile order behind per-query-tile semaphores (deterministic).
- "workspace": the main kernel stores dS in a workspace, and a second kernel computes dQ = dS K
  per query tile, summing in key-tile order (deterministic). It needs a workspace of
  B * H_q * S_q * S_k elements (rows padded to 16 bytes), so no call takes it by default: only
  within a budget the user sets, or where dBias needs dS.
"""
from __future__ import annotations

import os

from .errors import InvalidInputError

ROUTES = ("atomic", "ordered", "workspace")
DETERMINISTIC_ROUTES = ("ordered", "workspace")
# Forces a route (tests, benchmarks); a deterministic call refuses "atomic".
ROUTE_ENV = "FLASHKILN_BACKWARD_ROUTE"
# The workspace route's budget in MiB; default 0 (no O(S_q * S_k) memory on a default route).
WORKSPACE_BUDGET_ENV = "FLASHKILN_BACKWARD_WORKSPACE_MIB"


def _setting(name: str) -> str | None:
    """os.environ.get(name) without its exception: settings() runs on every backward call (its
    plan-cache key), and os.environ.get raises and catches a KeyError for each unset name, the
    common case. CPython's os.environ keeps the encoded mapping that its every change updates
    (`_data`), which a dict lookup reads without one (docs/perf.md, v39)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if data is None:
        return environ.get(name)
    value = data.get(environ.encodekey(name))
    return None if value is None else environ.decodevalue(value)


def settings() -> tuple[str | None, str | None]:
    """The environment's route settings, as read by forced_route and workspace_budget_bytes."""
    return _setting(ROUTE_ENV), _setting(WORKSPACE_BUDGET_ENV)


def workspace_budget_bytes() -> int:
    """$FLASHKILN_BACKWARD_WORKSPACE_MIB in bytes, or 0."""
    raw = _setting(WORKSPACE_BUDGET_ENV)
    if raw is None:
        return 0
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise InvalidInputError(f"{WORKSPACE_BUDGET_ENV}={raw!r}: expected a whole number of MiB (0 turns the "
                                "workspace route off)")
    return mib << 20


def preferred_route(d_qk: int, deterministic: bool) -> str:
    """The faster route, as measured on an H200 (docs/perf.md, 2026-11-30, v3).

    The workspace route beat the others wherever it was measured except against the atomic route
    at d_qk = 64 (there 0.99-1.03x): without the dQ GEMM and its reductions the main kernel spills
    less and never waits, and the dQ kernel is a plain GEMM. Against the ordered route it gained
    9-61%, against the atomic one 7-11% at d_qk = 128 and 24-32% at d_qk = 256. Below d_qk = 128
    a call that is not deterministic keeps the atomic route and spares the memory. (Taken only
    within the workspace budget, which is 0 unless the user sets one.)
    """
    return "workspace" if deterministic or d_qk >= 128 else "atomic"


def forced_route(deterministic: bool) -> str | None:
    """The route $FLASHKILN_BACKWARD_ROUTE forces, or None."""
    forced = _setting(ROUTE_ENV)
    if not forced:
        return None
    if forced not in ROUTES:
        raise InvalidInputError(f"{ROUTE_ENV}={forced!r}: expected one of {', '.join(ROUTES)}")
    if deterministic and forced not in DETERMINISTIC_ROUTES:
        raise InvalidInputError(f"{ROUTE_ENV}={forced!r} is not deterministic; a deterministic backward takes "
                                f"{' or '.join(DETERMINISTIC_ROUTES)}")
    return forced


def fallback_route(deterministic: bool) -> str:
    """The route that needs no workspace."""
    return "ordered" if deterministic else "atomic"
