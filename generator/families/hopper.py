"""The hopper family (templates/include/flashkiln/hopper): TMA + wgmma, sm_90a only.

One producer warpgroup and one consumer warpgroup per 64 query rows; K/V (and bias tiles, with a
bias) stream through a ring of `stages` shared-memory buffers. The formulas here are
static_asserted by the C++ side (threads, shared-memory bytes), like the portable family's.
"""
from __future__ import annotations

from flashkiln.archs import ARCHS
from flashkiln.descriptor import VariantDescriptor
from flashkiln.tma import BOX_COLS as _BOX_COLS  # TMA box width in elements: one 128-byte swizzle atom

from .base import ELEMENT_BYTES, Family, smem_limit_errors

# Shared memory beyond the tiles: the mbarriers (rounded up to the 1024-byte alignment of the
# storage struct) and the slack for aligning the dynamic allocation to 1024 bytes.
_BARRIER_BLOCK = 1024
_ALIGN_SLACK = 1024 - 16


class HopperFamily(Family):
    """Warp-specialized forward for sm_90a (hopper/fwd_kernel.hpp)."""

    name = "hopper"
    archs = ("sm_90a",)
    arch_needs = "wgmma and setmaxnreg"
    kernels = {"fwd": "hopper_fwd.cu.j2"}
    shared_tiles: dict[str, str] = {}

    def consumer_warpgroups(self, d: VariantDescriptor) -> int:
        return d.tile_m // 64

    def smem_bytes(self, d: VariantDescriptor) -> int:
        return self._smem_bytes(d, own_o=self.own_o_buffer(d), q_slots=self.q_slots(d))

    def own_o_buffer(self, d: VariantDescriptor) -> bool:
        """O gets its own shared-memory buffer (Q's then loads early) wherever it fits (fwd_traits.hpp)."""
        return self._fits(self._smem_bytes(d, own_o=True, q_slots=1), d)

    def q_slots(self, d: VariantDescriptor) -> int:
        """Two Q buffers (the next tile's Q loads a tile ahead) where they fit beside O's own (fwd_traits.hpp)."""
        two = self.consumer_warpgroups(d) == 3 and self.own_o_buffer(d)
        return 2 if two and self._fits(self._smem_bytes(d, own_o=True, q_slots=2), d) else 1

    @staticmethod
    def _fits(smem: int, d: VariantDescriptor) -> bool:
        return smem <= ARCHS[d.arch].max_smem_per_block

    def _smem_bytes(self, d: VariantDescriptor, own_o: bool, q_slots: int) -> int:
        elem = ELEMENT_BYTES[d.dtype]
        bias = d.bias != "none"
        tiles = elem * (q_slots * d.tile_m * d.d_qk + d.stages * d.tile_n * (d.d_qk + d.d_v)
                        + own_o * d.tile_m * d.d_v + bias * d.stages * d.tile_m * d.tile_n)
        # The bias ring's barriers take a block of their own (after its 1024-byte aligned tiles).
        return tiles + _BARRIER_BLOCK * (1 + bias) + _ALIGN_SLACK

    def combination_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.deterministic:
            errors.append("deterministic=true: only bwd has the axis")
        for name, dim in (("d_qk", d.d_qk), ("d_v", d.d_v)):
            if dim % _BOX_COLS:
                errors.append(f"{name}={dim}: must be a multiple of {_BOX_COLS} (whole 128-byte swizzle atoms)")
        if d.d_v > d.d_qk:
            errors.append(f"d_v={d.d_v} > d_qk={d.d_qk}: O is staged in Q's shared-memory buffer")
        return errors

    def tuning_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.tile_m not in (64, 128, 192):
            errors.append(f"tile_m={d.tile_m}: must be 64, 128 or 192 (64 rows per consumer warpgroup)")
        else:
            warps = 4 * (1 + self.consumer_warpgroups(d))
            if d.warps != warps:
                errors.append(f"warps={d.warps}: tile_m={d.tile_m} needs {warps} (a producer warpgroup and "
                              f"{self.consumer_warpgroups(d)} consumer warpgroup(s))")
        if d.tile_n % 16 or not 16 <= d.tile_n <= 256:
            errors.append(f"tile_n={d.tile_n}: must be a multiple of 16 between 16 and 256 (wgmma N, TMA box)")
        if d.bias != "none" and d.tile_n % _BOX_COLS:
            errors.append(f"tile_n={d.tile_n}: with a bias, a multiple of {_BOX_COLS} (bias tiles load in "
                          f"{_BOX_COLS}-key TMA boxes)")
        if d.stages < 2:
            errors.append(f"stages={d.stages}: the K/V ring needs at least 2 buffers")
        return errors + smem_limit_errors(d, self.smem_bytes(d))
