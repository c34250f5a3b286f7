"""Compile one rendered translation unit to a cubin with NVRTC (no GPU, no nvcc)."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass


class CompileError(RuntimeError):
    """NVRTC rejected a variant's source; the message holds the variant's name and the log."""

    def __init__(self, name: str, log: str):
        self.name, self.log = name, log
        super().__init__(f"NVRTC failed to compile {name}:\n{log}")

    def __reduce__(self):  # rebuilt from both fields when a worker process reports it (generate -j N)
        return CompileError, (self.name, self.log)


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int  # spill stores + spill loads reported by ptxas


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    seconds: float

    def resources(self, symbol: str) -> Resources:
        """ptxas's report (-v) for one entry point of the unit."""
        return resource_usage(self.log).get(symbol, Resources(-1, -1))


def _check(result: tuple, what: str) -> tuple:
    from cuda.bindings import nvrtc

    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {result[0]}")
    return result[1:]


# ptxas's advisories about a wgmma pipeline it had to alter (C75xx: wgmma instructions serialized, a
# warpgroup wait injected), each naming the function.
_WGMMA_ADVISORY = re.compile(r"ptxas (?:info|warning)\s*: \((C75\d\d)\) (.*)")


def wgmma_advisories(log: str) -> list[str]:
    """ptxas's C75xx advisories in a compile log, one per line ("C7514 Potential Performance Loss: ...")."""
    return [f"{code} {text.strip()}" for code, text in _WGMMA_ADVISORY.findall(log)]


def resource_usage(log: str) -> dict[str, Resources]:
    """Registers and spill bytes per entry function, from ptxas's -v report."""
    usage = {}
    for block in re.split(r"ptxas info\s+: Compiling entry function ", log)[1:]:
        name = re.match(r"'(\w+)'", block)
        regs = re.search(r"Used (\d+) registers", block)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        if name and regs:
            spill = int(spills.group(1)) + int(spills.group(2)) if spills else 0
            usage[name.group(1)] = Resources(int(regs.group(1)), spill)
    return usage


def compile_cubin(source: str, name: str, options: list[str]) -> CompileResult:
    """Compile `source` with `options` (which name the real arch, -arch=sm_XY) into SASS."""
    from cuda.bindings import nvrtc

    start = time.perf_counter()
    (prog,) = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        (log_size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log_buf = b" " * log_size
        _check(nvrtc.nvrtcGetProgramLog(prog, log_buf), "nvrtcGetProgramLog")
        log = log_buf.rstrip(b"\0").decode(errors="replace").strip()
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, log)
        if advisories := wgmma_advisories(log):
            raise CompileError(name, "ptxas altered a wgmma pipeline (the kernel would run without the overlap its "
                                     "template is written for):\n" + "\n".join(advisories) + "\n\n" + log)
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompileResult(cubin, log, time.perf_counter() - start)
