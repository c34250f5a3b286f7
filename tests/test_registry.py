"""Kernel lookup, verification and launch against a fake driver and a hand-written manifest."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import hashlib
import json
from pathlib import Path

import pytest

from flashkiln import portable_family, tile_choice
from flashkiln.calls import BackwardCall, ForwardCall
from flashkiln.descriptor import VariantDescriptor
from flashkiln.errors import ArchMismatchError, KernelIntegrityError, ManifestError, VariantNotFoundError
from flashkiln.manifest import MANIFEST_NAME, KernelEntry, Manifest
from flashkiln.params import FwdParams, params_layout
from flashkiln.archs import arch_preference
from flashkiln.launch import ScratchSet, Target
from flashkiln.registry import KernelRegistry

# -- fakes (also used by test_attention_api.py) ---------------------------------------------------


class FakeDriver:
    """Implements flashkiln.driver.Driver and records every call."""

    def __init__(self):
        self.calls: list[tuple] = []

    def version(self) -> int:
        return 13000

    def load_library(self, image: bytes):
        self.calls.append(("load_library", image))
        return ("library", len([c for c in self.calls if c[0] == "load_library"]))

    def get_kernel(self, library, symbol: str):
        self.calls.append(("get_kernel", library, symbol))
        return ("kernel", library, symbol)

    def set_max_dynamic_smem(self, kernel, nbytes: int, device: int) -> None:
        self.calls.append(("set_max_dynamic_smem", kernel, nbytes, device))

    def bind_context(self, device: int) -> None:
        pass  # a CPU test has no context to bind

    def replace_tensor_map_address(self, tensor_map: int, address: int) -> None:
        self.calls.append(("replace_tensor_map_address", tensor_map, address))

    def launch(self, kernel, grid, block, smem_bytes, stream, params) -> None:
        self.calls.append(("launch", kernel, grid, block, smem_bytes, stream, params))

    def entry_points(self) -> None:
        return None  # launches go through `launch`, which records them

    def raise_failure(self, what: str, code: int):
        raise AssertionError(f"no entry point of a FakeDriver fails ({what}: {code})")

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


def descriptor(arch="sm_90a", dtype="bf16", d=128, d_v=None, causal="none", tile_m=128, tile_n=64, warps=4,
               stages=1) -> VariantDescriptor:
    return VariantDescriptor(kernel="fwd", family="portable", arch=arch, dtype=dtype, d_qk=d,
                             d_v=d if d_v is None else d_v, causal=causal, bias="none", deterministic=False,
                             tile_m=tile_m, tile_n=tile_n, warps=warps, stages=stages)


def fake_cubin(d: VariantDescriptor) -> bytes:
    return b"\x7fELF fake cubin " + d.hash.encode()


def kernel_entry(d: VariantDescriptor, **overrides) -> KernelEntry:
    from flashkiln.generator.families import FAMILIES  # here: the installed-wheel test imports this module

    image = fake_cubin(d)
    smem = FAMILIES[d.family].smem_bytes(d)
    fields = dict(
        hash=d.hash, name=d.name, symbol=d.symbol, arch=d.arch, descriptor=d.as_dict(), cubin=f"{d.name}.cubin",
        sha256=hashlib.sha256(image).hexdigest(), cubin_bytes=len(image), threads=32 * d.warps, smem_bytes=smem,
        params_layout=params_layout("fwd").digest, registers=128, spill_bytes=0, compile_seconds=1.5,
        spec="specs/portable.yaml", relative_speed=1.0, nvrtc_version="13.0", cutlass_version="4.2.0.0", generator_version="0.1.0",
    )
    return KernelEntry(**{**fields, **overrides})


def write_manifest(directory: Path, entries: list[KernelEntry], build: dict | None = None) -> Path:
    """manifest.json (of `build`'s identity) plus each entry's cubin (the bytes of fake_cubin)."""
    directory.mkdir(parents=True, exist_ok=True)
    for e in entries:
        (directory / e.cubin).write_bytes(fake_cubin(e.variant))
    manifest = Manifest(directory, build or {"nvrtc": "13.0"}, tuple(entries))
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return directory


def all_variants(archs=("sm_80", "sm_90a"), dims=(64, 128), causals=("none", "bottom_right"),
                 dtypes=("fp16", "bf16")) -> list[VariantDescriptor]:
    return [descriptor(arch=a, dtype=t, d=d, causal=c) for a in archs for t in dtypes for d in dims for c in causals]


def fake_registry(directory: Path, descriptors: list[VariantDescriptor]) -> tuple[KernelRegistry, FakeDriver]:
    driver = FakeDriver()
    write_manifest(directory, [kernel_entry(d) for d in descriptors])
    return KernelRegistry(directory, driver), driver


def request(dtype="bf16", d=128, d_v=None, causal="none") -> dict:
    return {"kernel": "fwd", "family": "portable", "dtype": dtype, "d_qk": d, "d_v": d if d_v is None else d_v,
            "causal": causal, "bias": "none", "deterministic": False, "packed": False}


# -- find ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability, arch", [((9, 0), "sm_90a"), ((8, 0), "sm_80"), ((8, 6), "sm_80"), ((8, 9), "sm_80")])
def test_find_picks_the_best_arch(tmp_path, capability, arch):
    registry, _ = fake_registry(tmp_path, all_variants())
    entry = registry.find(request(causal="bottom_right"), capability)
    assert entry.arch == arch
    assert entry.variant == descriptor(arch=arch, causal="bottom_right")


def test_a_request_written_before_packed_existed_still_finds_its_kernel(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants())
    old = {k: v for k, v in request(causal="bottom_right").items() if k != "packed"}
    assert registry.find(old, (9, 0)) == registry.find(request(causal="bottom_right"), (9, 0))
    assert registry.has(old, (9, 0))
    with pytest.raises(VariantNotFoundError, match="packed: \\[true\\]"):
        registry.find({**old, "packed": True}, (9, 0))


def test_find_prefers_a_specific_minor_over_its_major(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants(archs=("sm_80", "sm_86")))
    assert registry.find(request(), (8, 6)).arch == "sm_86"
    assert registry.find(request(), (8, 9)).arch == "sm_86"
    assert registry.find(request(), (8, 0)).arch == "sm_80"


@pytest.mark.parametrize("causal, shape, tile_n", [
    ("none", None, 160),           # no shape: the default (first) tuning
    ("none", (1024, 1024), 128),   # 160-key tiles would compute 1120 keys per row
    ("none", (8192, 8192), 160),   # 8320 keys per row at 160 beat 8192 at 128 at 0.97 the speed
    ("bottom_right", (8192, 8192), 160),
])
def test_tunings_lead_with_the_default_and_tile_choice_picks_by_shape(tmp_path, causal, shape, tile_n):
    default = descriptor(causal=causal, tile_n=160)
    other = descriptor(causal=causal, tile_n=128)
    directory = tmp_path / "kernels"
    # The manifest's order is its compile units', not the tuning table's: the first tuning still leads.
    write_manifest(directory, [kernel_entry(other, relative_speed=0.97), kernel_entry(default)])
    registry = KernelRegistry(directory, driver=FakeDriver())
    tunings = registry.tunings(request(causal=causal), (9, 0))
    assert tunings[0] == registry.find(request(causal=causal), (9, 0)) and len(tunings) == 2
    chosen = tunings[0] if shape is None else tile_choice.choose(tunings, *shape)
    assert chosen.variant.tile_n == tile_n


def test_find_matches_every_functional_field(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants())
    for d in all_variants(archs=("sm_90a",)):
        req = {k: v for k, v in d.as_dict().items() if k in request()}
        assert registry.find(req, (9, 0)).hash == d.hash


@pytest.mark.parametrize("capability, archs, shown", [
    ((7, 5), ("sm_80", "sm_90a"), "7.5"),
    ((9, 0), ("sm_80",), "9.0"),  # sm_80 SASS does not run on 9.0
    ((8, 0), ("sm_90a",), "8.0"),  # sm_90a runs on exactly 9.0
    ((10, 0), ("sm_90a",), "10.0"),
])
def test_find_with_no_runnable_arch(tmp_path, capability, archs, shown):
    registry, _ = fake_registry(tmp_path, all_variants(archs=archs))
    with pytest.raises(ArchMismatchError) as info:
        registry.find(request(), capability)
    message = str(info.value)
    assert f"compute capability {shown}" in message
    assert all(a in message for a in archs)


def test_variant_not_found_explains_what_to_add(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants())
    with pytest.raises(VariantNotFoundError) as info:
        registry.find(request(dtype="fp16", d=96, causal="bottom_right"), (9, 0))
    message = str(info.value)
    assert ("no generated kernel for: kernel=fwd, family=portable, arch=sm_90a, dtype=fp16, d_qk=96, d_v=96, "
            "causal=bottom_right, bias=none, deterministic=False") in message
    closest = message.split("closest generated variants:\n")[1].split("\nTo add it")[0].splitlines()
    assert len(closest) == 3
    # Everything but the head dims matches: the two sm_90a fp16 bottom-right kernels come first.
    assert closest[0].strip().startswith(descriptor(dtype="fp16", d=128, causal="bottom_right").name + ":")
    assert closest[1].strip().startswith(descriptor(dtype="fp16", d=64, causal="bottom_right").name + ":")
    assert "append this group to `variants:` in specs/portable.yaml" in message
    assert "    head_dims: [96]\n" in message
    assert "    arch: [sm_90a]\n" in message and "    causal: [bottom_right]\n" in message
    assert "fwd: sm_90a: 96: {tile_m: ..., tile_n: ..., warps: ..., stages: ...}" in message


@pytest.mark.parametrize("kernel_set", ["default", "full"])
def test_variant_not_found_in_a_default_build_names_the_full_set(tmp_path, kernel_set):
    write_manifest(tmp_path, [kernel_entry(d) for d in all_variants()],
                   {"nvrtc": "13.0", "selection": {"set": kernel_set}})
    with pytest.raises(VariantNotFoundError) as info:
        KernelRegistry(tmp_path, driver=FakeDriver()).find(request(d=96), (9, 0))
    assert ("`make generate SET=full` also builds" in str(info.value)) == (kernel_set == "default")


def test_variant_not_found_snippet_for_different_dims(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants())
    with pytest.raises(VariantNotFoundError) as info:
        registry.find(request(d=192, d_v=128), (8, 0))
    message = str(info.value)
    assert "    head_dims: [[192, 128]]\n" in message
    assert "fwd: sm_80: 192x128: {" in message


def test_variant_not_found_is_a_lookup_error(tmp_path):
    registry, _ = fake_registry(tmp_path, all_variants())
    with pytest.raises(LookupError):
        registry.find(request(d=256), (9, 0))


# -- loading and launching ----------------------------------------------------------------------


def launch(registry: KernelRegistry, entry: KernelEntry, device: int = 0, capability=(9, 0), stream: int = 7):
    params = FwdParams(batch=1)
    registry.driver.launch(registry.load(entry, device, capability).handle, (3, 2, 1), (entry.threads, 1, 1),
                           entry.smem_bytes, stream, params)
    return params


def test_launch_loads_once_and_configures_each_device(tmp_path):
    """A cuLibrary is device independent: one load; the shared-memory opt-in is per device."""
    registry, driver = fake_registry(tmp_path, all_variants())
    entry = registry.find(request(), (9, 0))
    assert entry.smem_bytes > 48 * 1024
    launch(registry, entry)
    launch(registry, entry)
    assert [c[1] for c in driver.named("load_library")] == [fake_cubin(entry.variant)]
    assert [c[2] for c in driver.named("get_kernel")] == [entry.symbol]
    launch(registry, entry, device=1)
    assert len(driver.named("load_library")) == 1 and len(driver.named("get_kernel")) == 1
    assert [c[3] for c in driver.named("set_max_dynamic_smem")] == [0, 1]
    assert len(driver.named("launch")) == 3
    # A tool's handle on the module (its globals) is the library the kernel came from.
    assert registry.library_of(entry) == driver.named("get_kernel")[0][1]
    assert len(driver.named("load_library")) == 1


def test_launch_passes_grid_block_smem_stream_and_params(tmp_path):
    registry, driver = fake_registry(tmp_path, all_variants())
    entry = registry.find(request(), (9, 0))
    params = launch(registry, entry, stream=42)
    (_, kernel, grid, block, smem, stream, passed), = driver.named("launch")
    assert kernel == ("kernel", ("library", 1), entry.symbol)
    assert grid == (3, 2, 1)
    assert block == (entry.threads, 1, 1) == (128, 1, 1)
    assert smem == entry.smem_bytes == 65536
    assert stream == 42
    assert passed is params


@pytest.mark.parametrize("smem, opt_in", [(48 * 1024, False), (48 * 1024 + 1, True), (32768, False), (65536, True)])
def test_dynamic_smem_opt_in_only_above_48k(tmp_path, smem, opt_in):
    d = descriptor()
    registry = KernelRegistry(write_manifest(tmp_path, [kernel_entry(d, smem_bytes=smem)]), FakeDriver())
    launch(registry, registry.find(request(), (9, 0)), device=3)
    calls = registry.driver.named("set_max_dynamic_smem")
    assert calls == ([("set_max_dynamic_smem", ("kernel", ("library", 1), d.symbol), smem, 3)] if opt_in else [])


def test_load_refuses_an_arch_that_does_not_run(tmp_path):
    registry, driver = fake_registry(tmp_path, all_variants())
    entry = registry.find(request(), (9, 0))
    with pytest.raises(ArchMismatchError, match="sm_90a.*8.0"):
        launch(registry, entry, capability=(8, 0))
    assert driver.calls == []


def test_corrupted_cubin_is_refused_before_loading(tmp_path):
    registry, driver = fake_registry(tmp_path, all_variants())
    entry = registry.find(request(), (9, 0))
    path = tmp_path / entry.cubin
    path.write_bytes(path.read_bytes()[:-1] + b"!")
    with pytest.raises(KernelIntegrityError, match="sha256"):
        launch(registry, entry)
    assert driver.calls == []


def test_missing_cubin_is_refused(tmp_path):
    registry, driver = fake_registry(tmp_path, all_variants())
    entry = registry.find(request(), (9, 0))
    (tmp_path / entry.cubin).unlink()
    with pytest.raises(KernelIntegrityError, match="missing"):
        launch(registry, entry)
    assert driver.calls == []


def test_other_params_layout_is_refused(tmp_path):
    d = descriptor()
    registry = KernelRegistry(write_manifest(tmp_path, [kernel_entry(d, params_layout="0123456789abcdef")]),
                              FakeDriver())
    with pytest.raises(ManifestError, match="0123456789abcdef"):
        launch(registry, registry.find(request(), (9, 0)))
    assert registry.driver.calls == []


def test_a_failed_load_is_retried(tmp_path):
    registry, driver = fake_registry(tmp_path, all_variants())
    entry = registry.find(request(), (9, 0))
    path = tmp_path / entry.cubin
    good = path.read_bytes()
    path.write_bytes(b"garbage")
    with pytest.raises(KernelIntegrityError):
        launch(registry, entry)
    path.write_bytes(good)
    launch(registry, entry)
    assert len(driver.named("launch")) == 1


# -- manifest loading ---------------------------------------------------------------------------


def manifest_json(tmp_path: Path) -> dict:
    write_manifest(tmp_path, [kernel_entry(d) for d in all_variants(archs=("sm_90a",), dims=(128,))])
    return json.loads((tmp_path / MANIFEST_NAME).read_text())


def rewrite(tmp_path: Path, raw: dict) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))


def test_manifest_round_trip(tmp_path):
    entries = [kernel_entry(d) for d in all_variants()]
    write_manifest(tmp_path, entries)
    loaded = Manifest.load(tmp_path)
    assert loaded.kernels == tuple(entries)
    assert loaded.build == {"nvrtc": "13.0"}
    assert loaded.directory == tmp_path


def test_manifest_missing(tmp_path):
    with pytest.raises(ManifestError, match="no kernel manifest"):
        Manifest.load(tmp_path)


def test_manifest_missing_through_the_registry(tmp_path):
    with pytest.raises(ManifestError):
        KernelRegistry(tmp_path, FakeDriver()).find(request(), (9, 0))


def test_manifest_bad_json(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text('{"format": 2, "kernels": [')
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(tmp_path)


@pytest.mark.parametrize("fmt", [1, 3, 0, None, "2"])
def test_manifest_wrong_format(tmp_path, fmt):
    raw = manifest_json(tmp_path)
    raw["format"] = fmt
    rewrite(tmp_path, raw)
    with pytest.raises(ManifestError, match="format"):
        Manifest.load(tmp_path)


def test_manifest_hash_not_matching_descriptor(tmp_path):
    raw = manifest_json(tmp_path)
    raw["kernels"][1]["descriptor"]["tile_n"] = 32
    rewrite(tmp_path, raw)
    with pytest.raises(ManifestError, match="descriptor hashes to"):
        Manifest.load(tmp_path)


def test_manifest_entry_with_missing_or_extra_field(tmp_path):
    raw = manifest_json(tmp_path)
    del raw["kernels"][0]["sha256"]
    rewrite(tmp_path, raw)
    with pytest.raises(ManifestError, match="kernel #0"):
        Manifest.load(tmp_path)


def test_manifest_invalid_descriptor_is_a_manifest_error(tmp_path):
    raw = manifest_json(tmp_path)
    raw["kernels"][0]["descriptor"]["dtype"] = "fp8"
    rewrite(tmp_path, raw)
    with pytest.raises(ManifestError):
        Manifest.load(tmp_path)


def test_manifest_not_an_object_is_a_manifest_error(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("[]")
    with pytest.raises(ManifestError):
        Manifest.load(tmp_path)


def test_kernel_entry_fields_match_the_writer():
    # write_manifest above must produce every KernelEntry field, or Manifest.load rejects it.
    assert set(dataclasses.asdict(kernel_entry(descriptor()))) == {f.name for f in dataclasses.fields(KernelEntry)}


def test_a_driver_older_than_the_kernels_toolkit_is_a_typed_error(tmp_path):
    from flashkiln.errors import DriverTooOldError

    registry, driver = fake_registry(tmp_path, all_variants())
    driver.version = lambda: 12080  # CUDA 12.8 driver, kernels built by NVRTC 13.0
    entry = registry.find(request(), (9, 0))
    with pytest.raises(DriverTooOldError, match="NVRTC 13.0.*supports CUDA 12.8"):
        launch(registry, entry)
    assert driver.named("load_library") == []


# -- the portable family's planners, called as the runtime calls them (CPU tensors, a faked GPU) ---

def fake_target(capability=(9, 0), memory=141 << 30) -> Target:
    return Target(0, capability, memory, 132, 60 << 20, arch_preference(capability)[0].max_smem_per_block)


def planned_forward(q, k, v, out, lse, causal, scale, bias, capability, registry, sink=None, packed=None,
                    window=None, softcap=None):
    """The portable forward launch for checked (kernel-side) tensors."""
    call = ForwardCall(q, k, v, out, lse, causal, scale, bias, sink, packed, window, softcap)
    (launch,) = portable_family.plan_forward(call, fake_target(capability), registry, ScratchSet(q.device))
    return launch


@dataclass(frozen=True)
class PlannedBackward:
    launches: list
    route: str
    scratch: dict  # role -> tensor (None where the route takes none)


def planned_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, deterministic, capability, memory, registry,
                     bias=None, bias_grad=False, packed=None, dlse=None, sink=None, sink_parts=False, window=None,
                     softcap=None, keys_complete=True):
    """The portable backward's launches, route and scratch for checked (kernel-side) tensors."""
    call = BackwardCall(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, deterministic, bias, bias_grad, packed, dlse,
                        sink, sink_parts, window, softcap, keys_complete)
    scratch = ScratchSet(q.device)
    planned = portable_family.plan_backward(call, fake_target(capability, memory), registry, scratch)
    return PlannedBackward(planned.launches, planned.route, scratch.tensors)
