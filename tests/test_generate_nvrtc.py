"""NVRTC end to end on the CPU: a tiny spec for both arches -> cubins, SASS, manifest, cache."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from flashkiln.generator import build
from flashkiln.generator.nvrtc import CompileError, compile_cubin, wgmma_advisories
from flashkiln.generator.render import render
from flashkiln.generator.sass import disassemble, opcode_counts
from flashkiln.generator.specs import load_variants
from flashkiln.generator.toolchain import toolchain
from flashkiln.manifest import Manifest
from flashkiln.registry import KernelRegistry

pytestmark = pytest.mark.nvrtc

@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_specs, build_cache) -> tuple[Path, Path, Manifest]:
    out = tmp_path_factory.mktemp("nvrtc") / "out"
    manifest = build.generate(tiny_specs, out, workers=2, cache_dir=build_cache, progress=False)
    return tiny_specs, build_cache, manifest


def test_manifest_records_each_cubin(generated):
    _, _, manifest = generated
    assert sorted(k.arch for k in manifest.kernels) == ["sm_80", "sm_80", "sm_90a", "sm_90a"]
    # The two causal modes of one arch differ only in masking: one compile unit, one cubin.
    cubins = {k.arch: {e.cubin for e in manifest.kernels if e.arch == k.arch} for k in manifest.kernels}
    assert all(len(names) == 1 for names in cubins.values()) and cubins["sm_80"] != cubins["sm_90a"]
    on_disk = json.loads((manifest.directory / "manifest.json").read_text())
    assert on_disk["build"]["toolchain"]["nvidia-cutlass"] == "4.2.0.0"
    for k in manifest.kernels:
        cubin = manifest.directory / k.cubin
        assert cubin.stat().st_size == k.cubin_bytes > 0
        assert k.threads == 32 and k.smem_bytes == 2 * (16 * 32 + 16 * 64)
        assert 0 < k.registers <= 255 and k.spill_bytes >= 0 and k.nvrtc_version == toolchain().versions["nvrtc"]
        assert k.symbol in (manifest.directory / "src" / k.cubin.replace(".cubin", ".cu")).read_text()
    # The runtime reads what the generator wrote.
    loaded = KernelRegistry(manifest.directory).manifest
    assert [k.hash for k in loaded.kernels] == [k.hash for k in manifest.kernels]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_sass_has_tensor_core_mma_and_async_copies(generated, arch):
    _, _, manifest = generated
    entries = [k for k in manifest.kernels if k.arch == arch]
    sass = disassemble(manifest.directory / entries[0].cubin)
    assert f".target\t{arch}" in sass
    ops = opcode_counts(sass)
    assert ops["HMMA"] > 0, "expected mma.sync (HMMA) in the portable family"
    assert ops["LDSM"] > 0, "expected ldmatrix (LDSM)"
    assert ops["LDGSTS"] > 0, "expected cp.async (LDGSTS)"
    assert ops["HGMMA"] == 0, "the portable family must not use wgmma"
    assert all(e.symbol in sass for e in entries)


def test_warm_cache_compiles_nothing(generated, tmp_path, monkeypatch):
    specs, cache, first = generated

    def no_compile(units, workers, progress):
        raise AssertionError(f"recompiled {[u.name for u in units]}")

    monkeypatch.setattr(build, "_compile_all", no_compile)
    second = build.generate(specs, tmp_path / "out", workers=2, cache_dir=cache, progress=False)
    assert [k.sha256 for k in second.kernels] == [k.sha256 for k in first.kernels]


def test_params_layout_mismatch_fails_the_compile(generated):
    """The static_asserts catch a C++ struct that differs from runtime/params.py."""
    specs, _, _ = generated
    variant = load_variants(specs)[0]
    source = render(variant.descriptor)
    tampered = source.replace("kBytes[8] == 2", "kBytes[16] == 2")  # claim `k` sits at offset 16
    assert tampered != source
    with pytest.raises(CompileError) as info:
        compile_cubin(tampered, variant.descriptor.name, toolchain().options(variant.descriptor.arch))
    assert "params.k: size or offset differs" in str(info.value)
    assert variant.descriptor.name in str(info.value)


def test_compile_error_survives_a_worker_process():
    """generate -j N reports a worker's CompileError through pickle: name and log must survive."""
    error = pickle.loads(pickle.dumps(CompileError("fwd_x", "error: bad")))
    assert (error.name, error.log) == ("fwd_x", "error: bad")
    assert "NVRTC failed to compile fwd_x" in str(error)


# One m64n8k16 wgmma; EARLY becomes nothing, or a read of its accumulator before the wait.
WGMMA_SOURCE = r"""
extern "C" __global__ void one_wgmma(float* out, unsigned long long a, unsigned long long b) {
  float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "l"(a), "l"(b), "r"(1));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  EARLY
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  out[threadIdx.x + 128] = d0 + d1 + d2 + d3;
}
"""


def test_a_wgmma_pipeline_that_ptxas_alters_fails_the_compile():
    """A kernel whose wgmma ptxas serializes or waits on (C75xx) runs, but without the overlap its
    template is written for: the build refuses it, naming ptxas's advisory and the function. The
    same kernel reading its accumulator after the wait compiles."""
    options = toolchain().options("sm_90a")
    clean = compile_cubin(WGMMA_SOURCE.replace("EARLY", ""), "one_wgmma", options)
    assert wgmma_advisories(clean.log) == [] and clean.cubin
    with pytest.raises(CompileError) as info:
        compile_cubin(WGMMA_SOURCE.replace("EARLY", "out[threadIdx.x] = d0;"), "one_wgmma", options)
    assert "ptxas altered a wgmma pipeline" in str(info.value) and "'one_wgmma'" in str(info.value)
    assert wgmma_advisories(info.value.log)[0].startswith("C75")


def test_wgmma_advisories_are_read_from_the_log():
    log = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
           "to non wgmma instructions reading accumulator registers of  a wgmma between start and end of the "
           "pipeline stage in the function 'k'\nptxas info    : 0 bytes gmem\n")
    assert wgmma_advisories(log) == [
        "C7514 Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma "
        "instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in "
        "the function 'k'"]
    assert wgmma_advisories("ptxas info    : Used 30 registers, used 0 barriers") == []
