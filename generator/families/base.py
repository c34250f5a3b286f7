"""The kernel-family interface and what every family shares.

A family answers three questions for a descriptor: which template renders it, what the
template's parameters are (all derived from the descriptor), and whether its fields fit the
code and the target (threads, shared memory). The C++ side static_asserts the threads and
shared-memory bytes computed here, so the two formulas cannot drift apart.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from flashkiln.archs import ARCHS
from flashkiln.descriptor import VariantDescriptor

ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
ELEMENT_BYTES = {"fp16": 2, "bf16": 2}
# How errors name a kernel a family lacks.
KERNEL_TITLES = {"fwd": "the forward", "bwd_pre": "the backward's row preprocessing", "bwd": "the backward",
                 "bwd_post": "the backward's row postprocessing", "bwd_dq": "the backward's dQ pass",
                 "bwd_dbias": "the backward's dBias of a shared bias"}


class Family(ABC):
    """One kernel family: the data that declares it, and its rules for a descriptor."""

    name: ClassVar[str]
    # The targets it builds for (functional_errors rejects the others), and what the others lack.
    archs: ClassVar[tuple[str, ...]]
    arch_needs: ClassVar[str]
    # The kernels it has (functional_errors rejects the others), each with its template.
    kernels: ClassVar[dict[str, str]]
    # Kernels whose tile fields must equal another kernel's for the same arch and head dims (the
    # tuning table is checked against this): kernel -> (the kernel it follows, the fields).
    shared_tiles: ClassVar[dict[str, tuple[str, tuple[str, ...]]]]

    def template_name(self, d: VariantDescriptor) -> str:
        return self.kernels[d.kernel]  # KeyError for a kernel the family lacks

    def threads(self, d: VariantDescriptor) -> int:
        return 32 * d.warps

    @abstractmethod
    def smem_bytes(self, d: VariantDescriptor) -> int:
        """Dynamic shared memory a block of d's kernel takes."""

    def functional_errors(self, d: VariantDescriptor) -> list[str]:
        """Combinations of functional fields the family does not implement."""
        errors = []
        if d.kernel not in self.kernels:
            have = " and ".join(f"{KERNEL_TITLES[k]} ({k})" for k in self.kernels)
            errors.append(f"kernel={d.kernel}: the {self.name} family has only {have}")
        if d.arch not in self.archs:
            errors.append(f"arch={d.arch}: the {self.name} family needs {self.arch_needs}: "
                          f"{', '.join(self.archs)} only")
        return errors + self.combination_errors(d)

    @abstractmethod
    def combination_errors(self, d: VariantDescriptor) -> list[str]:
        """The family's own rules on functional fields (beyond which kernels and archs it has)."""

    @abstractmethod
    def tuning_errors(self, d: VariantDescriptor) -> list[str]:
        """Performance fields that the kernel's code or the target's shared memory cannot take."""

    def template_context(self, d: VariantDescriptor) -> dict[str, Any]:
        """What every family's kernel templates read besides the descriptor."""
        return {
            "element": ELEMENT[d.dtype],
            "causal": "none" if d.causal == "none" else "masked",  # common/visibility.hpp's Causal
            "threads": self.threads(d),
            "smem_bytes": self.smem_bytes(d),
        }


def smem_limit_errors(d: VariantDescriptor, smem: int) -> list[str]:
    """The error of a tile whose `smem` bytes of shared memory exceed what d.arch gives a block."""
    limit = ARCHS[d.arch].max_smem_per_block
    if smem <= limit:
        return []
    return [f"tile {d.tile_m}x{d.tile_n} with {d.stages} stage(s) needs {smem} bytes of shared memory at "
            f"d_qk={d.d_qk}, d_v={d.d_v}; {d.arch} allows {limit}"]
