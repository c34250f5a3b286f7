"""The loops of built kernels' SASS that hold a given opcode (by default HGMMA: the hopper kernels'
tile loops), with their size, local-memory accesses (spills) and opcode mix; a second build to
compare against gives each loop's opcode differences beside the first's. No GPU needed.

Usage: .venv/bin/python tools/sass_loops.py BUILD [--against OTHER_BUILD] [--kernel REGEX] [--opcode HGMMA]
  [--loops 2]
(BUILD: a `generated/` folder with its manifest.json; kernels by symbol, matched with re.search. Each
kernel's `--loops` smallest loops that hold the opcode are listed; loops are compared in that order.)
"""
from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

from flashkiln.generator.sass import Loop, disassemble, functions, natural_loops
from flashkiln.manifest import Manifest

_LOCAL = ("LDL", "STL")


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


def describe(loop: Loop) -> str:
    local = sum(loop.opcodes[op] for op in _LOCAL)
    return f"{loop.head:#x}-{loop.tail:#x}: {loop.size} instructions, {local} local accesses"


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
        for i, loop in enumerate(found):
            print(f"  {describe(loop)}")
            if i < len(others.get(symbol, [])):
                other = others[symbol][i]
                delta = collections.Counter(loop.opcodes)
                delta.subtract(other.opcodes)
                changes = ", ".join(f"{op} {n:+d}" for op, n in delta.most_common() if n) or "none"
                print(f"    against {describe(other)}; opcodes: {changes}")


if __name__ == "__main__":
    main()
