"""What the backward logs at DEBUG about the plan it made: family, main kernel and dQ route."""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Iterator

# runtime/backward.py: "flashkiln backward: %s family, %s, dq route %s"
_PLAN = re.compile(r"^flashkiln backward: (\S+) family, (\S+), dq route (\S+)$")


@dataclass(frozen=True)
class PlannedBackward:
    family: str
    kernel: str
    route: str


class _Plans(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.plans: list[PlannedBackward] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _PLAN.match(record.getMessage())
        if match:
            self.plans.append(PlannedBackward(*match.groups()))


@contextlib.contextmanager
def backward_plans() -> Iterator[list[PlannedBackward]]:
    """The plans of the backward calls made inside, in order (a cache hit logs none)."""
    logger, handler = logging.getLogger("flashkiln"), _Plans()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.plans
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
