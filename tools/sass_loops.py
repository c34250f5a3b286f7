"""The loops of built kernels' SASS that hold a given opcode (by default HGMMA: the hopper kernels'
tile loops), with their size, local-memory accesses (spills), role and opcode mix; a second build to
compare against gives each loop's opcode differences beside the first's. No GPU needed.

Usage: .venv/bin/python tools/sass_loops.py BUILD [--against OTHER_BUILD] [--kernel REGEX] [--opcode HGMMA]
  [--loops 2]
(BUILD: a `generated/` folder with its manifest.json; kernels by symbol, matched with re.search. Each
kernel's `--loops` smallest loops that hold the opcode are listed. A loop is compared with the other
build's loop of the same role (`role`: its tensor-core, special-function, reduction and atomic
instruction counts; of several, the closest in size), since the compiler may lay out a kernel's
loops in another order: a dBias route's loop has its own REDG or ATOMG, a dSink loop more MUFU.)
"""
from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

from flashkiln.generator.sass import Loop, disassemble, functions, natural_loops
from flashkiln.manifest import Manifest

_LOCAL = ("LDL", "STL")
_ROLE = ("HGMMA", "MUFU", "REDG", "ATOMG")


def kernel_loops(build: Path, kernel: str, opcode: str, count: int) -> dict[str, list[Loop]]:
    """Per kernel symbol matching `kernel`, its `count` smallest loops that hold `opcode`, read from the
    cubin its manifest entry names (a build laid over another may hold older copies of a symbol)."""
    by_cubin: dict[str, set[str]] = {}
    for entry in Manifest.load(build).kernels:
        if re.search(kernel, entry.symbol):
            by_cubin.setdefault(entry.cubin, set()).add(entry.symbol)
    loops: dict[str, list[Loop]] = {}
    for cubin, symbols in sorted(by_cubin.items()):
        for symbol, sass in functions(disassemble(build / cubin)).items():
            if symbol in symbols:
                loops[symbol] = [loop for loop in natural_loops(sass) if loop.opcodes[opcode]][:count]
    return loops


def role(loop: Loop) -> tuple[int, ...]:
    """What tells a loop's work apart from another's of the same kernel: the counts of _ROLE."""
    return tuple(loop.opcodes[op] for op in _ROLE)


def paired(loops: list[Loop], others: list[Loop]) -> list[Loop | None]:
    """For each of `loops`, in order, an unpaired loop of `others` with its role, the closest in
    size where several have it; None where none has."""
    free = list(others)
    pairs: list[Loop | None] = []
    for loop in loops:
        match = min((o for o in free if role(o) == role(loop)), key=lambda o: abs(o.size - loop.size), default=None)
        if match is not None:
            free.remove(match)
        pairs.append(match)
    return pairs


def describe(loop: Loop) -> str:
    local = sum(loop.opcodes[op] for op in _LOCAL)
    roles = " ".join(f"{op} {n}" for op, n in zip(_ROLE, role(loop)) if n)
    return f"{loop.head:#x}-{loop.tail:#x}: {loop.size} instructions, {local} local accesses ({roles})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--against", type=Path)
    parser.add_argument("--kernel", default="")
    parser.add_argument("--opcode", default="HGMMA")
    parser.add_argument("--loops", type=int, default=2)
    args = parser.parse_args()
    loops = kernel_loops(args.build, args.kernel, args.opcode, args.loops)
    others = kernel_loops(args.against, args.kernel, args.opcode, args.loops) if args.against else {}
    for symbol, found in sorted(loops.items()):
        print(symbol)
        for loop, other in zip(found, paired(found, others.get(symbol, []))):
            print(f"  {describe(loop)}")
            if other is not None:
                delta = collections.Counter(loop.opcodes)
                delta.subtract(other.opcodes)
                changes = ", ".join(f"{op} {n:+d}" for op, n in delta.most_common() if n) or "none"
                print(f"    against {describe(other)}; opcodes: {changes}")


if __name__ == "__main__":
    main()
