"""What a built kernel must satisfy to run on its arch, checked from its cubin and the manifest
alone, without the hardware: the right tensor-core instructions, a launch the arch allows, and
spills within a stated bound.
"""
from __future__ import annotations

from pathlib import Path

from flashkiln.archs import ARCHS
from flashkiln.manifest import KernelEntry, Manifest

from .sass import disassemble, functions, opcode_counts, resource_usage

MAX_THREADS_PER_BLOCK = 1024
REGISTERS_PER_SM = 65536
# Spill bytes (stores + loads, ptxas's count) a kernel may have: the specs' most is 1380, the
# hopper backward at d 128 with a bias, a window and dBias (docs/perf.md, v25).
SPILL_BOUND = 1536
# Which tensor-core instructions a family's kernels must issue (those with GEMMs), and which none may.
TENSOR_OPS = {"portable": ("HMMA", "HGMMA"), "hopper": ("HGMMA", None)}
GEMM_KERNELS = ("fwd", "bwd", "bwd_dq")


def entry_problems(entry: KernelEntry, opcodes: dict[str, int], usage: dict[str, int]) -> list[str]:
    """Every way `entry` (its SASS opcode counts and cuobjdump resource usage) breaks its arch's limits."""
    arch = ARCHS[entry.arch]
    problems = []
    required, forbidden = TENSOR_OPS[entry.descriptor["family"]]
    if entry.descriptor["kernel"] in GEMM_KERNELS and not opcodes.get(required):
        problems.append(f"issues no {required}")
    if forbidden and opcodes.get(forbidden):
        problems.append(f"issues {opcodes[forbidden]} {forbidden} (not on {entry.arch})")
    static = max(0, usage.get("SHARED", 0) - arch.reserved_static_smem)
    if entry.smem_bytes + static > arch.max_smem_per_block:
        problems.append(f"{entry.smem_bytes + static} bytes of shared memory ({entry.smem_bytes} dynamic + {static} "
                        f"static) exceed {entry.arch}'s {arch.max_smem_per_block}")
    if entry.threads > MAX_THREADS_PER_BLOCK or entry.threads % 32:
        problems.append(f"{entry.threads} threads per block")
    registers = usage.get("REG", entry.registers)
    if registers * entry.threads > REGISTERS_PER_SM:
        problems.append(f"{registers} registers x {entry.threads} threads exceed {REGISTERS_PER_SM} per SM")
    if entry.spill_bytes > SPILL_BOUND:
        problems.append(f"spills {entry.spill_bytes} bytes (bound {SPILL_BOUND})")
    return problems


def check_directory(directory: Path, archs: tuple[str, ...] | None = None) -> dict[str, list[str]]:
    """Problems per kernel name of a generated directory's kernels (of `archs`, or all); each cubin
    is disassembled once."""
    manifest = Manifest.load(directory)
    problems = {}
    by_cubin: dict[str, list[KernelEntry]] = {}
    for entry in manifest.kernels:
        if archs is None or entry.arch in archs:
            by_cubin.setdefault(entry.cubin, []).append(entry)
    for cubin, entries in by_cubin.items():
        sass = disassemble(directory / cubin)
        usage = resource_usage(directory / cubin)
        per_symbol = _opcodes_per_symbol(sass)
        for entry in entries:
            found = entry_problems(entry, per_symbol.get(entry.symbol, {}), usage.get(entry.symbol, {}))
            if found:
                problems[entry.name] = found
    return problems


def _opcodes_per_symbol(sass: str) -> dict[str, dict[str, int]]:
    """cuobjdump --dump-sass output's opcodes, counted per function."""
    return {symbol: dict(opcode_counts(part)) for symbol, part in functions(sass).items()}
