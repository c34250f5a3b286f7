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
    """A stand-in for the NVRTC compile of any unit."""
    from flashkiln.generator.nvrtc import CompileResult

    return lambda unit: CompileResult(cubin, "", 0.1)


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
    assert cache.read(arch_dir, Path(entry.cubin).stem) is not None


def test_a_corrupt_cubin_is_not_loadable(tmp_path, jit_specs, monkeypatch):
    import flashkiln.generator.jit as generator_jit

    monkeypatch.setattr(generator_jit, "compile_variant", fake_compile(b"cubin bytes"))
    cache = JitCache(tmp_path)
    entry = cache.get_or_compile(TINY_REQUEST, "sm_80")
    Path(entry.cubin).write_bytes(b"cubin bytez")
    assert cache.read(Path(entry.cubin).parent, Path(entry.cubin).stem) is None


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

    registry.driver.launch(registry.load(entry, 0, (8, 6)).handle, (1, 1, 1), (entry.threads, 1, 1), entry.smem_bytes, 0, FwdParams())
    (_, image), = registry.driver.named("load_library")
    assert image == Path(entry.cubin).read_bytes()


def test_without_jit_a_miss_stays_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHKILN_JIT", raising=False)
    registry = KernelRegistry(tmp_path, driver=FakeDriver())
    with pytest.raises(Exception) as info:
        registry.find(TINY_REQUEST, (9, 0))
    assert "no kernel manifest" in str(info.value)


def test_jit_of_a_variant_no_spec_enumerates_is_a_variant_not_found_error(tmp_path, jit_specs):
    registry = KernelRegistry(tmp_path / "none", driver=FakeDriver(), jit_cache=JitCache(tmp_path / "jit"))
    with pytest.raises(VariantNotFoundError, match="no spec in .* enumerates kernel=fwd, .*d_qk=96"):
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


def test_a_header_edit_changes_the_jit_key_and_recompiles(tmp_path, jit_specs, monkeypatch):
    """The JIT cache is keyed as the build cache is: an edit of a flashkiln header the variant
    includes names another entry, which is compiled anew instead of served stale."""
    import flashkiln.generator.jit as generator_jit
    from flashkiln.generator import cache as cache_module
    from flashkiln.generator import toolchain as tc_module
    from flashkiln.generator.cache import cache_key

    compiles = []
    monkeypatch.setattr(generator_jit, "compile_variant", lambda unit: compiles.append(unit) or
                        fake_compile(b"cubin")(unit))
    cache = JitCache(tmp_path)
    first = cache.get_or_compile(TINY_REQUEST, "sm_80")
    unit = compiles[0]
    assert unit.key == cache_key(unit.source, tc_module.toolchain().identity, "sm_80")
    assert cache.get_or_compile(TINY_REQUEST, "sm_80") == first and len(compiles) == 1
    real_digest = cache_module.own_headers_digest
    monkeypatch.setattr(cache_module, "own_headers_digest", lambda source: "edited " + real_digest(source))
    second = cache.get_or_compile(TINY_REQUEST, "sm_80")
    assert len(compiles) == 2 and Path(second.cubin).stem != Path(first.cubin).stem
    assert second.hash == first.hash  # the same variant


def _one_variant_per_group():
    """One variant of each (family, kernel, bias) group of the default specs, as a JIT request."""
    from flashkiln.descriptor import FUNCTIONAL_FIELDS
    from flashkiln.generator.specs import load_variants
    from flashkiln.generator.toolchain import SPECS_DIR

    picked = {}
    for v in sorted(load_variants(SPECS_DIR), key=lambda v: v.descriptor.name):
        d = v.descriptor
        picked.setdefault((d.family, d.kernel, d.bias, d.packed), d)
    return [({k: getattr(d, k) for k in FUNCTIONAL_FIELDS if k != "arch"}, d.arch) for d in picked.values()]


@pytest.mark.nvrtc
@pytest.mark.parametrize("request_arch", _one_variant_per_group(),
                         ids=lambda r: "-".join(str(r[0][k]) for k in ("family", "kernel", "bias", "packed")))
def test_the_jit_builds_every_group_of_the_default_specs(tmp_path, request_arch, monkeypatch):
    """Through the public JIT path (a registry without kernels, FLASHKILN_JIT's cache, a fake
    loader): the entry is the one `make generate` would build, tuning included."""
    from flashkiln.archs import ARCHS
    from flashkiln.generator.specs import load_variants
    from flashkiln.generator.toolchain import SPECS_DIR

    monkeypatch.delenv("FLASHKILN_JIT_SPECS", raising=False)
    request, arch = request_arch
    registry = KernelRegistry(tmp_path / "no-kernels", driver=FakeDriver(), jit_cache=JitCache(tmp_path / "jit"))
    entry = registry.find(request, ARCHS[arch].capability)
    built = [v for v in load_variants(SPECS_DIR) if v.descriptor.hash == entry.hash]
    assert built and built[0].relative_speed == 1, "the JIT took the spec's reference tuning"
    assert entry.registers > 0  # compiled by NVRTC, its ptxas report read
    registry.load(entry, 0, ARCHS[arch].capability)
    (_, image), = registry.driver.named("load_library")
    assert image == Path(entry.cubin).read_bytes()


def test_with_jit_the_head_dims_are_those_its_specs_enumerate(tmp_path, jit_specs):
    """A registry with no manifest but JIT runs (and pads to) the head dims the specs can build."""
    registry = KernelRegistry(tmp_path / "none", driver=FakeDriver(), jit_cache=JitCache(tmp_path / "jit"))
    assert registry.head_dims("fwd", "bf16", (9, 0)) == frozenset({(32, 32)})
    assert registry.head_dims("bwd", "bf16", (9, 0)) == frozenset()
