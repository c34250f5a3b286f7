"""Disassemble cubins with cuobjdump from pip (nvidia-cuda-cuobjdump): look, don't guess."""
from __future__ import annotations

import collections
import dataclasses
import re
import subprocess
from importlib import metadata
from pathlib import Path


def cuobjdump_path() -> Path:
    try:
        path = Path(str(metadata.distribution("nvidia-cuda-cuobjdump").locate_file("nvidia/cu13/bin/cuobjdump")))
    except metadata.PackageNotFoundError:
        raise FileNotFoundError("cuobjdump is not installed: pip install 'flashkiln[dev]'") from None
    if not path.is_file():
        raise FileNotFoundError(f"nvidia-cuda-cuobjdump has no cuobjdump at {path}")
    return path


def disassemble(cubin: Path) -> str:
    return subprocess.run([str(cuobjdump_path()), "--dump-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout


def opcode_counts(sass: str) -> collections.Counter:
    """How often each opcode (without modifiers: HMMA.16816.F32.BF16 counts as HMMA) occurs."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return collections.Counter(ops)


def resource_usage(cubin: Path) -> dict[str, dict[str, int]]:
    """Per kernel symbol, cuobjdump's resource counts (REG, STACK, SHARED: static bytes, LOCAL, ...)."""
    text = subprocess.run([str(cuobjdump_path()), "--dump-resource-usage", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    usage = {}
    for symbol, counts in re.findall(r"Function (\S+):\s*\n\s*(.+)", text):
        usage[symbol] = {key: int(value) for key, value in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", counts)}
    return usage


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A natural loop of one function's SASS: the instructions that reach the back edge's branch
    (at `tail`) without passing the loop's header (at `head`), counted per opcode."""

    head: int
    tail: int
    opcodes: collections.Counter

    @property
    def size(self) -> int:
        return sum(self.opcodes.values())


def functions(sass: str) -> dict[str, str]:
    """cuobjdump --dump-sass output split at each `Function : <symbol>` header."""
    return {part.split(None, 1)[0]: part for part in sass.split("Function : ")[1:]}


def natural_loops(function_sass: str) -> list[Loop]:
    """Every loop of one function (a back edge: a branch to an address at or before its own), smallest
    first. Control flow from the branches: a predicated branch or EXIT falls through as well; an
    unpredicated BRA (not BRA.DIV, which branches for divergent warps only), EXIT or RET does not."""
    code = [(int(a, 16), bool(predicate), opcode, operands)
            for a, predicate, opcode, operands in _INSTRUCTION.findall(function_sass)]
    predecessors: dict[int, set[int]] = collections.defaultdict(set)
    back_edges: list[tuple[int, int]] = []
    for i, (address, predicated, opcode, operands) in enumerate(code):
        ends = not predicated and (opcode in ("EXIT", "RET") or (opcode == "BRA" and not operands.startswith(".DIV")))
        if opcode == "BRA" and (match := _TARGET.search(operands)):
            target = int(match.group(1), 16)
            predecessors[target].add(address)
            if target <= address:
                back_edges.append((target, address))
        if not ends and i + 1 < len(code):
            predecessors[code[i + 1][0]].add(address)
    opcode_at = {address: opcode for address, _, opcode, _ in code}
    loops = []
    for head, tail in sorted(set(back_edges)):
        body, pending = {head}, [tail]
        while pending:
            address = pending.pop()
            if address not in body:
                body.add(address)
                pending.extend(predecessors[address])
        loops.append(Loop(head, tail, collections.Counter(opcode_at[a] for a in body if a in opcode_at)))
    return sorted(loops, key=lambda loop: loop.size)
