"""Wheels: build from a tiny spec, install into a fresh virtual environment, use with a faked loader."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from flashkiln.generator.build import Selection
from flashkiln.generator.wheel import WheelError, build_wheel, build_wheels_per_arch

pytestmark = pytest.mark.nvrtc

# The generator's own dependencies (tqdm is one too, but torch itself imports it).
GENERATOR_MODULES = ("jinja2", "yaml", "filelock", "cuda.bindings.nvrtc", "flashkiln.generator")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory, tiny_specs, build_cache):
    return build_wheel(tiny_specs, tmp_path_factory.mktemp("dist"), workers=2, cache_dir=build_cache, progress=False)


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh venv with the wheel installed. torch and cuda-bindings (the wheel's only requirements)
    come from this interpreter's site-packages through a path entry, which does not activate the
    checkout's editable install."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    python = root / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel.path)],
                   check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "host_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def run(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd="/")


def test_wheel_is_named_by_flavor_and_archs_and_requires_no_generator(wheel):
    assert wheel.path.name.startswith("flashkiln-0.1.0+cu13.sm80.sm90a-") and wheel.path.name.endswith(".whl")
    with zipfile.ZipFile(wheel.path) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith("dist-info/METADATA"))).decode()
        manifest = json.loads(z.read("flashkiln/kernels/manifest.json"))
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert sorted(r for r in requires if "extra ==" not in r) == ["cuda-bindings<14,>=13.0", "torch>=2.4"]
    assert all(f"flashkiln/kernels/{k['cubin']}" in names for k in manifest["kernels"])
    # The launch path's C module (pyproject.toml's ext-modules), one abi3 build for CPython 3.11 on.
    assert "flashkiln/_launch.abi3.so" in names and "-cp311-abi3-" in wheel.path.name
    build = manifest["build"]
    assert build["cuda_flavor"] == "cu13" and build["flashkiln_version"] == "0.1.0"
    assert {"generator_version", "specs_digest", "toolchain"} <= set(build)
    assert build["toolchain"]["nvidia-cutlass"] == "4.2.0.0" and build["toolchain"]["nvrtc"].startswith("13.")


def test_wheel_size_per_arch_is_reported_and_bounded(wheel, tiny_specs, build_cache, tmp_path):
    assert set(wheel.cubin_bytes_per_arch) == {"sm_80", "sm_90a"}
    assert all(0 < n < 4 * 2**20 for n in wheel.cubin_bytes_per_arch.values())
    assert wheel.bytes < 2 * 2**20  # cubins compress well (mostly symbol tables)
    with pytest.raises(WheelError, match="exceed"):
        build_wheel(tiny_specs, tmp_path, workers=2, cache_dir=build_cache, progress=False, max_mib_per_arch=0.5)


def test_one_wheel_per_arch_holds_that_arch_only(tiny_specs, build_cache, tmp_path):
    reports = build_wheels_per_arch(tiny_specs, tmp_path, workers=2, cache_dir=build_cache, progress=False)
    assert [r.path.name.split("-")[1] for r in reports] == ["0.1.0+cu13.sm80", "0.1.0+cu13.sm90a"]
    for report, arch in zip(reports, ("sm_80", "sm_90a")):
        assert set(report.cubin_bytes_per_arch) == {arch}
        with zipfile.ZipFile(report.path) as z:
            manifest = json.loads(z.read("flashkiln/kernels/manifest.json"))
            assert {k["arch"] for k in manifest["kernels"]} == {arch}
            assert all(f"flashkiln/kernels/{k['cubin']}" in z.namelist() for k in manifest["kernels"])
    only = build_wheels_per_arch(tiny_specs, tmp_path / "one", workers=2, selection=Selection(archs=("sm_90a",)),
                                 cache_dir=build_cache, progress=False)
    assert [set(r.cubin_bytes_per_arch) for r in only] == [{"sm_90a"}]


def test_installed_wheel_lists_and_verifies_its_kernels(venv):
    listed = run(venv, "-m", "flashkiln", "list")
    assert listed.returncode == 0, listed.stderr
    assert len(listed.stdout.splitlines()) == 4 and "fwd_portable_sm90a_bf16_d32" in listed.stdout
    assert "sm_80: 2 variant(s)" in listed.stderr and "runs on compute capability 8.0, 8.6, 8.9" in listed.stderr
    assert "sm_90a: 2 variant(s)" in listed.stderr
    verified = run(venv, "-m", "flashkiln", "verify")
    assert verified.returncode == 0 and "all cubins match" in verified.stdout


def test_installed_wheel_dispatches_without_generator_dependencies(venv):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import flashkiln
        from flashkiln.params import FwdParams
        from flashkiln.registry import KernelRegistry
        from test_registry import FakeDriver
        assert "site-packages" in flashkiln.__file__ and "/work/" not in flashkiln.__file__, flashkiln.__file__
        registry = KernelRegistry(driver=FakeDriver())
        request = dict(kernel="fwd", family="portable", dtype="bf16", d_qk=32, d_v=32, causal="bottom_right",
                       bias="none", deterministic=False)
        entry = registry.find(request, (9, 0))
        registry.driver.launch(registry.load(entry, 0, (9, 0)).handle, (1, 1, 1), (entry.threads, 1, 1), entry.smem_bytes, 0, FwdParams())
        assert entry.arch == "sm_90a" and len(registry.driver.named("load_library")) == 1
        loaded = sorted(m for m in {GENERATOR_MODULES!r} if m in sys.modules)
        print("generator modules loaded:", loaded)
        assert not loaded
    """)
    result = run(venv, "-c", script)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_swapped_cubin_is_a_typed_error(venv, tmp_path):
    package = Path(run(venv, "-c", "import flashkiln, os; print(os.path.dirname(flashkiln.__file__))").stdout.strip())
    kernels = package / "kernels"
    cubins = sorted(kernels.glob("*.cubin"))
    a, b = (p.read_bytes() for p in cubins[:2])
    try:
        cubins[0].write_bytes(b)  # one arch's cubin replaced by the other's
        verified = run(venv, "-m", "flashkiln", "verify")
        assert verified.returncode == 1 and "sha256" in verified.stderr
    finally:
        cubins[0].write_bytes(a)


CU12_PYTHON = Path(__file__).resolve().parent.parent / ".venv-cu12" / "bin" / "python"


@pytest.mark.skipif(not CU12_PYTHON.exists(), reason="no .venv-cu12 (`make test` creates it): CUDA 12 flavor")
def test_cuda12_flavor_builds_from_the_same_specs(tmp_path, tiny_specs):
    from flashkiln.generator.sass import disassemble, opcode_counts

    result = subprocess.run([str(CU12_PYTHON), "-m", "flashkiln.generator", "wheel", "--specs", str(tiny_specs),
                             "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--no-progress", "-j", "2"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel_path,) = tmp_path.glob("flashkiln-0.1.0+cu12.sm80.sm90a-*.whl")
    with zipfile.ZipFile(wheel_path) as z:
        manifest = json.loads(z.read("flashkiln/kernels/manifest.json"))
        metadata = z.read(next(n for n in z.namelist() if n.endswith("dist-info/METADATA"))).decode()
        cubin = manifest["kernels"][0]["cubin"]
        (tmp_path / cubin).write_bytes(z.read(f"flashkiln/kernels/{cubin}"))
    assert manifest["build"]["cuda_flavor"] == "cu12" and manifest["build"]["toolchain"]["nvrtc"].startswith("12.")
    assert all(k["nvrtc_version"].startswith("12.") for k in manifest["kernels"])
    assert "Requires-Dist: cuda-bindings<13,>=12.8" in metadata
    assert opcode_counts(disassemble(tmp_path / cubin))["HMMA"] > 0
