"""Opt-in JIT and its cache: concurrent compiles, killed writers, unsafe directories (CPU, NVRTC)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from flashkiln.errors import VariantNotFoundError
from flashkiln.jit import JitCache, unsafe_reason
from flashkiln.registry import KernelRegistry
from test_registry import FakeDriver

TINY_REQUEST = {"kernel": "fwd", "family": "portable", "dtype": "bf16", "d_qk": 32, "d_v": 32,
                "causal": "none", "bias": "none", "deterministic": False}


def _env(tiny_specs: Path) -> dict[str, str]:
    return {**os.environ, "FLASHKILN_JIT_SPECS": str(tiny_specs)}


def _child(script: str, tiny_specs: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=_env(tiny_specs), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def fake_compile(cubin: bytes):
    """A stand-in for the NVRTC compile: (cubin, manifest fields) for any descriptor."""
    return lambda descriptor: (cubin, {"threads": 32, "smem_bytes": 3072, "registers": 40, "spill_bytes": 0,
                                       "compile_seconds": 0.1, "nvrtc_version": "13.0", "cutlass_version": "4.2.0.0"})


@pytest.fixture
def jit_specs(tiny_specs, monkeypatch) -> Path:
    monkeypatch.setenv("FLASHKILN_JIT_SPECS", str(tiny_specs))
    return tiny_specs


@pytest.mark.nvrtc
def test_eight_processes_compiling_one_key_leave_one_valid_entry(tmp_path, tiny_specs):
    script = f"""
        from flashkiln.jit import JitCache
        entry = JitCache({str(tmp_path)!r}).get_or_compile({TINY_REQUEST!r}, "sm_80")
        print(entry.sha256)
    """
    children = [_child(script, tiny_specs) for _ in range(8)]
    outputs = [c.communicate(timeout=300) for c in children]
    assert all(c.returncode == 0 for c in children), [err for _, err in outputs]
    assert len({out.strip() for out, _ in outputs}) == 1
    arch_dir = JitCache(tmp_path).root / "sm_80"
    assert len(list(arch_dir.glob("*.cubin"))) == 1 and len(list(arch_dir.glob("*.json"))) == 1
    assert not list(arch_dir.glob(".*"))  # no temporary files left behind
    (entry,) = JitCache(tmp_path).entries()
    assert entry.sha256 == outputs[0][0].strip() and entry.descriptor["d_qk"] == 32


@pytest.mark.nvrtc
def test_a_writer_killed_mid_write_leaves_nothing_loadable(tmp_path, tiny_specs, jit_specs):
    # The child compiles, renames the cubin into place, then hangs before the JSON (the entry's
    # seal) is renamed; it is killed there.
    script = f"""
        import os, sys, time
        real_replace = os.replace
        def replace(src, dst):
            if str(dst).endswith(".json"):
                print("READY", flush=True)
                time.sleep(600)
            return real_replace(src, dst)
        os.replace = replace
        from flashkiln.jit import JitCache
        JitCache({str(tmp_path)!r}).get_or_compile({TINY_REQUEST!r}, "sm_90a")
    """
    child = _child(script, tiny_specs)
    assert child.stdout.readline().strip() == "READY"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    cache = JitCache(tmp_path)
    arch_dir = cache.root / "sm_90a"
    assert list(arch_dir.glob("*.cubin")), "the kill should have come after the cubin's rename"
    assert cache.entries() == []
    assert all(cache.read(arch_dir, p.stem) is None for p in arch_dir.glob("*.cubin"))
    # The next process takes the (released) lock and completes the entry.
    entry = cache.get_or_compile(TINY_REQUEST, "sm_90a")
    assert cache.read(arch_dir, entry.hash) is not None


def test_a_corrupt_cubin_is_not_loadable(tmp_path, jit_specs, monkeypatch):
    import flashkiln.generator.jit as generator_jit

    monkeypatch.setattr(generator_jit, "compile_variant", fake_compile(b"cubin bytes"))
    cache = JitCache(tmp_path)
    entry = cache.get_or_compile(TINY_REQUEST, "sm_80")
    Path(entry.cubin).write_bytes(b"cubin bytez")
    assert cache.read(Path(entry.cubin).parent, entry.hash) is None


@pytest.mark.parametrize("make_unsafe", ["symlink", "other_owner", "group_writable", "world_writable"])
def test_unsafe_cache_directories_are_refused(tmp_path, make_unsafe):
    base = tmp_path / "cache"
    if make_unsafe == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        base.symlink_to(tmp_path / "elsewhere")
    else:
        base.mkdir(mode=0o700)
        if make_unsafe == "other_owner":
            if os.geteuid() != 0:
                pytest.skip("changing a directory's owner needs root")
            os.chown(base, 65534, 65534)
        else:
            os.chmod(base, 0o770 if make_unsafe == "group_writable" else 0o707)
    assert unsafe_reason(base) is not None
    with pytest.warns(UserWarning, match="refusing the JIT cache directory"):
        directory = JitCache(base)._directory("sm_90a")
    assert not str(directory).startswith(str(base)) and not str(directory).startswith(str(tmp_path / "elsewhere"))
    assert not (tmp_path / "elsewhere" / "0.1.0").exists()


def test_cache_directories_are_created_private(tmp_path):
    base = tmp_path / "fresh"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        directory = JitCache(base)._directory("sm_80")
    for level in (base, directory.parent, directory):
        assert level.stat().st_mode & 0o777 == 0o700


@pytest.mark.nvrtc
def test_registry_compiles_a_missing_variant_on_first_use(tmp_path, tiny_specs, jit_specs, build_cache):
    """No manifest at all, JIT on: the request compiles, caches, verifies and launches (fake driver)."""
    registry = KernelRegistry(tmp_path / "no-kernels", driver=FakeDriver(), jit_cache=JitCache(tmp_path / "jit"))
    entry = registry.find(TINY_REQUEST, (8, 6))
    assert entry.arch == "sm_80" and entry.descriptor["tile_m"] == 16 and Path(entry.cubin).is_file()
    assert registry.find(TINY_REQUEST, (8, 6)) is entry  # memoized: no disk on the launch path
    from flashkiln.params import FwdParams

    registry.launch(entry, 0, (8, 6), (1, 1, 1), FwdParams(), 0)
    (_, image), = registry.driver.named("load_library")
    assert image == Path(entry.cubin).read_bytes()


def test_without_jit_a_miss_stays_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHKILN_JIT", raising=False)
    registry = KernelRegistry(tmp_path, driver=FakeDriver())
    with pytest.raises(Exception) as info:
        registry.find(TINY_REQUEST, (9, 0))
    assert "no kernel manifest" in str(info.value)


def test_jit_without_tuning_is_a_variant_not_found_error(tmp_path, jit_specs):
    registry = KernelRegistry(tmp_path / "none", driver=FakeDriver(), jit_cache=JitCache(tmp_path / "jit"))
    with pytest.raises(VariantNotFoundError, match="no tuning for fwd sm_90a head dims 96 in"):
        registry.find({**TINY_REQUEST, "d_qk": 96, "d_v": 96}, (9, 0))


def test_cache_cli_lists_and_clears(tmp_path, jit_specs, monkeypatch):
    import flashkiln.generator.jit as generator_jit

    monkeypatch.setattr(generator_jit, "compile_variant", fake_compile(b"cubin"))
    monkeypatch.setenv("FLASHKILN_CACHE_DIR", str(tmp_path))
    entry = JitCache().get_or_compile(TINY_REQUEST, "sm_80")
    env = {**os.environ, "FLASHKILN_CACHE_DIR": str(tmp_path)}
    listed = subprocess.run([sys.executable, "-m", "flashkiln", "cache", "list"], env=env, capture_output=True,
                            text=True)
    assert listed.returncode == 0 and entry.name in listed.stdout
    cleared = subprocess.run([sys.executable, "-m", "flashkiln", "cache", "clear"], env=env, capture_output=True,
                             text=True)
    assert cleared.returncode == 0 and JitCache().entries() == []
