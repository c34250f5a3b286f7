"""Target architectures flashkiln can build for, and which GPUs each one runs on.

Shared by the generator (NVRTC target, shared-memory limit for spec validation) and the
runtime (picking a cubin for the current device).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str  # NVRTC's spelling: sm_80, sm_90a
    capability: tuple[int, int]
    # sm_90a-style targets use instructions of exactly one chip (wgmma, setmaxnreg): their
    # cubins load only on that compute capability, not on later minors of the major.
    arch_specific: bool
    # Opt-in dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin).
    max_smem_per_block: int
    # Static shared memory ptxas reports for every kernel of the arch that the limit above does
    # not count: sm_90's 1 KB reserved for the system (cudaDevAttrReservedSharedMemoryPerBlock).
    reserved_static_smem: int = 0

    def capabilities(self) -> list[tuple[int, int]]:
        """The compute capabilities flashkiln knows this arch's SASS runs on."""
        return sorted({a.capability for a in ARCHS.values() if self.runs_on(a.capability)})

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """SASS runs on the same major and an equal or later minor; 'a' targets on one chip only."""
        if self.arch_specific:
            return capability == self.capability
        return capability[0] == self.capability[0] and capability[1] >= self.capability[1]


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", (8, 0), False, 166912),
        Arch("sm_86", (8, 6), False, 101376),
        Arch("sm_89", (8, 9), False, 101376),
        Arch("sm_90a", (9, 0), True, 232448, reserved_static_smem=1024),
        Arch("sm_120", (12, 0), False, 101376),
    )
}


@functools.lru_cache(maxsize=None)
def arch_preference(capability: tuple[int, int]) -> tuple[Arch, ...]:
    """Archs whose cubins run on `capability`, best first (the most specific target first)."""
    usable = [a for a in ARCHS.values() if a.runs_on(capability)]
    return tuple(sorted(usable, key=lambda a: (a.arch_specific, a.capability), reverse=True))
