"""The loops of a function's SASS (generator/sass.py, natural_loops; tools/sass_loops.py) on made-up
disassembly: nested loops, predicated branches and exits, and a block laid out inside a loop's
address range that the loop never reaches; and the pairing of two builds' loops by their role."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

from flashkiln.generator.sass import Loop, functions, natural_loops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sass_loops  # noqa: E402  (tools/ is a folder of scripts)


def _sass(*lines: str) -> str:
    """cuobjdump's layout: an address comment, the instruction, its encoding."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {line} ;    /* 0x000 */"
                     for i, line in enumerate(lines))


NESTED = _sass(
    "@P5 BRA 0x70",          # 0x00 into a block inside the outer loop's range
    "MOV R1, RZ",            # 0x10 outer header
    "HGMMA.64x128x16.F32 R24, gdesc[UR4], R24",  # 0x20 inner header
    "LDL R2, [R1]",          # 0x30
    "ISETP.NE.AND P0, PT, R2, RZ, PT",  # 0x40
    "@P0 BRA 0x20",          # 0x50 inner back edge
    "BRA 0x90",              # 0x60 past 0x70-0x80
    "STS.128 [R3], RZ",      # 0x70 reached from 0x00 only
    "EXIT",                  # 0x80
    "@P2 BRA 0x10",          # 0x90 outer back edge
    "@P3 EXIT",              # 0xa0
    "BRA 0xa0",              # 0xb0 a loop of two: back to the predicated exit
    "NOP",                   # 0xc0 unreachable
)


def _loops() -> dict[tuple[int, int], Loop]:
    return {(loop.head, loop.tail): loop for loop in natural_loops(NESTED)}


def test_the_inner_loop_holds_its_own_instructions_only():
    inner = _loops()[(0x20, 0x50)]
    assert inner.size == 4
    assert inner.opcodes["HGMMA"] == 1 and inner.opcodes["LDL"] == 1


def test_the_outer_loop_leaves_out_the_block_inside_its_range():
    outer = _loops()[(0x10, 0x90)]
    assert outer.size == 7  # 0x10-0x60 and 0x90
    assert outer.opcodes["STS"] == 0 and outer.opcodes["EXIT"] == 0 and outer.opcodes["HGMMA"] == 1


def test_loops_come_smallest_first():
    loops = natural_loops(NESTED)
    assert [(loop.head, loop.tail) for loop in loops] == [(0xa0, 0xb0), (0x20, 0x50), (0x10, 0x90)]
    assert all(loop.opcodes["NOP"] == 0 for loop in loops)


def test_functions_split_at_each_header():
    text = f"Function : first\n{_sass('BRA 0x0')}\nFunction : second\n{_sass('EXIT')}\n"
    parts = functions(text)
    assert list(parts) == ["first", "second"]
    assert len(natural_loops(parts["first"])) == 1 and natural_loops(parts["second"]) == []


def _loop(head: int, **opcodes: int) -> Loop:
    return Loop(head, head + 0x100, collections.Counter(opcodes))


def test_loops_are_compared_with_the_other_build_s_loop_of_their_role():
    """A kernel's loops come smallest first, so a build whose store route grew past its sum route
    lists them in another order; each still meets its own kind, the closest in size of several."""
    store, columns, store_sink = (_loop(0x0, HGMMA=32, MUFU=127, FFMA=900), _loop(0x100, HGMMA=32, MUFU=127, ATOMG=2),
                                  _loop(0x200, HGMMA=32, MUFU=129, FFMA=950))
    grown_store, grown_store_twin = _loop(0x1000, HGMMA=32, MUFU=127, FFMA=1200), _loop(0x2000, HGMMA=32, MUFU=127)
    other_build = [columns, store_sink, store, _loop(0x300, HGMMA=32, MUFU=127, FFMA=100)]
    pairs = sass_loops.paired([columns, grown_store, store_sink, grown_store_twin], other_build)
    assert pairs == [columns, store, store_sink, other_build[3]]
    assert sass_loops.paired([_loop(0x0, HGMMA=8, REDG=16)], other_build) == [None]
    assert "(HGMMA 32 MUFU 127 ATOMG 2)" in sass_loops.describe(columns)
