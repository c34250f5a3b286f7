"""What each kernel family's templates need from a descriptor, and which tunings they accept.

A family module answers three questions for a descriptor: which template renders it, what the
template's parameters are (all derived from the descriptor), and whether its performance fields
fit the code and the target (threads, shared memory). The C++ side static_asserts the threads
and shared-memory bytes computed here, so the two formulas cannot drift apart.
"""
from __future__ import annotations

from typing import Any, Protocol

from flashkiln.archs import ARCHS
from flashkiln.descriptor import VariantDescriptor

_ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
_ELEMENT_BYTES = {"fp16": 2, "bf16": 2}


class Family(Protocol):
    def template_name(self, d: VariantDescriptor) -> str: ...

    def threads(self, d: VariantDescriptor) -> int: ...

    def smem_bytes(self, d: VariantDescriptor) -> int: ...

    def tuning_errors(self, d: VariantDescriptor) -> list[str]: ...

    def template_context(self, d: VariantDescriptor) -> dict[str, Any]: ...


class PortableFamily:
    """mma.sync kernels (templates/include/flashkiln/portable), for sm_80 and later."""

    def template_name(self, d: VariantDescriptor) -> str:
        return f"portable_{d.kernel}.cu.j2"

    def threads(self, d: VariantDescriptor) -> int:
        return 32 * d.warps

    def smem_bytes(self, d: VariantDescriptor) -> int:
        # Q (reused for O), then `stages` buffers of one K and one V tile.
        q_or_o = d.tile_m * max(d.d_qk, d.d_v)
        kv = d.tile_n * (d.d_qk + d.d_v)
        return _ELEMENT_BYTES[d.dtype] * (q_or_o + d.stages * kv)

    def tuning_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.warps not in (1, 2, 4, 8):
            errors.append(f"warps={d.warps}: must be 1, 2, 4 or 8")
        if d.stages not in (1, 2):
            errors.append(f"stages={d.stages}: must be 1 (staggered K/V) or 2 (double-buffered K/V)")
        if d.tile_m % (16 * d.warps):
            errors.append(f"tile_m={d.tile_m}: must be a multiple of 16 * warps = {16 * d.warps}")
        if d.tile_n % 16:
            errors.append(f"tile_n={d.tile_n}: must be a multiple of 16")
        # 16-byte global copies: each row of a tile is split among (atom width / 8) threads.
        for dim in {d.d_qk, d.d_v}:
            rows_per_pass = self.threads(d) // ((64 if dim % 64 == 0 else 32) // 8)
            for tile_name, rows in (("tile_m", d.tile_m), ("tile_n", d.tile_n)):
                if rows % rows_per_pass:
                    errors.append(f"{tile_name}={rows}: must be a multiple of {rows_per_pass} "
                                  f"(rows one pass of {self.threads(d)} threads copies at head dim {dim})")
        smem, limit = self.smem_bytes(d), ARCHS[d.arch].max_smem_per_block
        if smem > limit:
            errors.append(f"tile {d.tile_m}x{d.tile_n} with {d.stages} stage(s) needs {smem} bytes of shared "
                          f"memory at d_qk={d.d_qk}, d_v={d.d_v}; {d.arch} allows {limit}")
        return sorted(set(errors))

    def template_context(self, d: VariantDescriptor) -> dict[str, Any]:
        return {
            "element": _ELEMENT[d.dtype],
            "causal": d.causal,
            "threads": self.threads(d),
            "smem_bytes": self.smem_bytes(d),
        }


FAMILIES: dict[str, Family] = {"portable": PortableFamily()}
