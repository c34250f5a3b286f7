"""Kernel lookup and loading: functional request -> manifest entry -> verified, loaded cubin."""
from __future__ import annotations

import functools
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .archs import ARCHS, arch_preference
from .descriptor import AXES, FUNCTIONAL_FIELDS, PERFORMANCE_FIELDS, with_later_defaults
from . import jit
from .driver import CudaDriver, Driver
from .errors import ArchMismatchError, DriverTooOldError, KernelIntegrityError, ManifestError, VariantNotFoundError
from .manifest import MANIFEST_NAME, KernelEntry, Manifest
from .params import params_layout

PACKAGE_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"  # where a wheel puts its cubins
SOURCE_KERNEL_DIR = Path(__file__).resolve().parent.parent / "generated"  # `make generate` in a checkout


def default_kernel_dir() -> Path:
    """$FLASHKILN_KERNEL_DIR, else cubins packaged with flashkiln, else the checkout's generated/."""
    if env := os.environ.get("FLASHKILN_KERNEL_DIR"):
        return Path(env)
    return PACKAGE_KERNEL_DIR if PACKAGE_KERNEL_DIR.is_dir() else SOURCE_KERNEL_DIR


@dataclass(frozen=True)
class LoadedKernel:
    entry: KernelEntry
    handle: Any


def _describe(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k}={fields[k]}" for k in FUNCTIONAL_FIELDS if k in fields)


def _spec_value(fields: dict[str, Any], spec_key: str) -> str:
    if spec_key == "head_dims":
        return str(fields["d_qk"]) if fields["d_qk"] == fields["d_v"] else f"[{fields['d_qk']}, {fields['d_v']}]"
    value = next(fields[a.name] for a in AXES if a.spec_key == spec_key)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _yaml_hint(fields: dict[str, Any], spec: str) -> str:
    """The spec group (descriptor.AXES' spec keys) and tuning row that would generate `fields`."""
    keys = list(dict.fromkeys(a.spec_key for a in AXES if a.spec_key))
    group = [f"{'  - ' if i == 0 else '    '}{key}: [{_spec_value(fields, key)}]" for i, key in enumerate(keys)]
    dims_key = fields["d_qk"] if fields["d_qk"] == fields["d_v"] else f"{fields['d_qk']}x{fields['d_v']}"
    return "\n".join([
        f"To add it, append this group to `variants:` in {spec} and run `make generate`:", *group,
        f"(its tuning table needs a row {fields['kernel']}: {fields['arch']}: {dims_key}: "
        f"{{{', '.join(f'{k}: ...' for k in PERFORMANCE_FIELDS)}}})"])


def _required_driver(nvrtc_version: str) -> int:
    """The cuDriverGetVersion value a cubin built by NVRTC `major.minor` needs (13.0 -> 13000)."""
    major, minor = (int(x) for x in nvrtc_version.split(".")[:2])
    return 1000 * major + 10 * minor


class KernelRegistry:
    """The kernels of one generated directory, loaded lazily and at most once per device.

    With a JIT cache (FLASHKILN_JIT=1 by default, or `jit=`), a variant the directory lacks is
    compiled on first use instead of raising VariantNotFoundError.
    """

    def __init__(self, directory: Path | None = None, driver: Driver | None = None,
                 jit_cache: jit.JitCache | None = None):
        self.directory = Path(directory) if directory is not None else default_kernel_dir()
        self._driver = driver
        self._jit_cache = jit_cache
        self._jit_entries: dict[tuple, KernelEntry] = {}
        self._libraries: dict[str, Any] = {}  # cubin file -> library handle
        self._kernels: dict[str, LoadedKernel] = {}  # variant hash -> kernel handle
        self._configured: set[tuple[str, int]] = set()  # (variant hash, device) with attributes set
        self._head_dims: dict[tuple, frozenset[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    @property
    def jit_cache(self) -> jit.JitCache | None:
        if self._jit_cache is None and jit.enabled():
            self._jit_cache = jit.JitCache()
        return self._jit_cache

    @functools.cached_property
    def manifest(self) -> Manifest:
        if self.jit_cache is not None and not (self.directory / MANIFEST_NAME).exists():
            return Manifest(self.directory, {}, ())  # JIT alone, nothing precompiled
        return Manifest.load(self.directory)

    @functools.cached_property
    def _index(self) -> dict[tuple, list[KernelEntry]]:
        index: dict[tuple, list[KernelEntry]] = {}
        for entry in self.manifest.kernels:
            index.setdefault(entry.variant.functional_key, []).append(entry)
        # A variant's first tuning (the reference of the others' relative speeds) leads its list:
        # the only one with speed 1, as the spec loader checks.
        return {key: sorted(entries, key=lambda e: e.relative_speed != 1) for key, entries in index.items()}

    @functools.cached_property
    def _built_archs(self) -> list[str]:
        return sorted({e.arch for e in self.manifest.kernels})

    @property
    def driver(self) -> Driver:
        if self._driver is None:
            self._driver = CudaDriver()
        return self._driver

    # -- lookup ------------------------------------------------------------------------------
    def find(self, request: dict[str, Any], capability: tuple[int, int],
             smem_limit: int | None = None) -> KernelEntry:
        """The default (first) tuning of `request` (every functional field but arch) for the best
        arch that runs on `capability` (see tunings)."""
        return self.tunings(request, capability, smem_limit)[0]

    def tunings(self, request: dict[str, Any], capability: tuple[int, int],
                smem_limit: int | None = None) -> list[KernelEntry]:
        """Every tuning of `request` for the best arch that runs on `capability` that has it, the
        default first (a family's planner chooses among them per call); with JIT, compiled on a miss.
        `smem_limit`: the device's shared memory per block (opt-in); tunings that need more are
        left out (an sm_80 cubin's tiles may not fit an sm_86 part), and an arch none of whose
        tunings fit gives way to the next; ArchMismatchError where none fits at all."""
        request = with_later_defaults(request)
        runnable = [a.name for a in arch_preference(capability)]
        built_archs = self._built_archs
        if not any(a in built_archs for a in runnable):
            if runnable and self.jit_cache is not None:
                return [self._jit_entry(request, runnable)]
            raise ArchMismatchError(
                f"this GPU has compute capability {capability[0]}.{capability[1]}, but the kernels in "
                f"{self.directory} are built for {', '.join(built_archs) or 'no arch'}, none of which runs on it "
                f"(needs one of: {', '.join(runnable) or 'an arch flashkiln does not know'}); "
                "add the arch to the specs and run `make generate`"
            )
        too_large: list[KernelEntry] = []
        for arch in runnable:
            fields = {**request, "arch": arch}
            entries = self._index.get(tuple(fields[k] for k in FUNCTIONAL_FIELDS), [])
            fitting = [e for e in entries if smem_limit is None or e.smem_bytes <= smem_limit]
            if fitting:
                return fitting
            too_large += entries
        if too_large:
            raise ArchMismatchError(self._too_large_message(too_large, capability, smem_limit))
        if self.jit_cache is not None:
            return [self._jit_entry(request, runnable)]
        wanted = {**request, "arch": next(a for a in runnable if a in built_archs)}
        raise VariantNotFoundError(self._not_found_message(wanted))

    def head_dims(self, kernel: str, dtype: str, capability: tuple[int, int]) -> frozenset[tuple[int, int]]:
        """The (d_qk, d_v) pairs there are `kernel`s for in `dtype`, on archs that run on `capability`:
        in the manifest, and with JIT those the JIT's specs enumerate too."""
        key = (kernel, dtype, capability)
        if key not in self._head_dims:
            archs = {a.name for a in arch_preference(capability)}
            descriptors = [e.descriptor for e in self.manifest.kernels]
            if self.jit_cache is not None:
                from .generator.jit import spec_descriptors

                descriptors += [d.as_dict() for d in spec_descriptors()]
            self._head_dims[key] = frozenset(
                (d["d_qk"], d["d_v"]) for d in descriptors
                if d["kernel"] == kernel and d["dtype"] == dtype and d["arch"] in archs)
        return self._head_dims[key]

    def has(self, request: dict[str, Any], capability: tuple[int, int]) -> bool:
        """Whether the manifest holds `request` for an arch that runs on `capability` (no JIT)."""
        request = with_later_defaults(request)
        return any(tuple({**request, "arch": a.name}[k] for k in FUNCTIONAL_FIELDS) in self._index
                   for a in arch_preference(capability))

    def _jit_entry(self, request: dict[str, Any], archs: list[str]) -> KernelEntry:
        """Compile (or take from the JIT cache) the request for the best of `archs` it has a tuning for."""
        key = (*(request[k] for k in FUNCTIONAL_FIELDS if k != "arch"), tuple(archs))
        if key not in self._jit_entries:
            from .generator.jit import JitError

            problems = []
            for arch in archs:
                try:
                    self._jit_entries[key] = self.jit_cache.get_or_compile(request, arch)
                    break
                except JitError as exc:
                    problems.append(str(exc))
            else:
                raise VariantNotFoundError("no generated kernel, and JIT cannot build one: " + "; ".join(problems))
        return self._jit_entries[key]

    def _too_large_message(self, entries: list[KernelEntry], capability: tuple[int, int], smem_limit: int) -> str:
        smallest = min(entries, key=lambda e: e.smem_bytes)
        native = arch_preference(capability)[0].name
        d = smallest.descriptor
        dims = d["d_qk"] if d["d_qk"] == d["d_v"] else f"{d['d_qk']}x{d['d_v']}"
        return (f"{smallest.name} ({smallest.arch} cubin) needs {smallest.smem_bytes} bytes of shared memory per "
                f"block; this GPU (compute capability {capability[0]}.{capability[1]}) allows {smem_limit}, and no "
                f"other generated tuning fits. Build its own arch: add {native} to `arch:` of the group in "
                f"{smallest.spec} and a row {d['kernel']}: {native}: {dims}: {{...}} that fits to its tuning "
                "table, then run `make generate`")

    def _not_found_message(self, wanted: dict[str, Any]) -> str:
        def distance(e: KernelEntry) -> int:
            return sum(e.descriptor[k] != wanted[k] for k in FUNCTIONAL_FIELDS)

        closest = sorted(self.manifest.kernels, key=lambda e: (distance(e), e.name))[:3]
        same_family = [e.spec for e in self.manifest.kernels if e.descriptor["family"] == wanted["family"]]
        spec = same_family[0] if same_family else f"specs/{wanted['family']}.yaml"
        lines = [f"no generated kernel for: {_describe(wanted)}", f"  (kernel directory: {self.directory})"]
        if closest:
            lines.append("closest generated variants:")
            lines += [f"  {e.name}: {_describe(e.descriptor)}" for e in closest]
        if self.manifest.build.get("selection", {}).get("set") == "default":
            lines.append("This is a build of the default set: `make generate SET=full` also builds the spec groups "
                         "marked `set: full` (on sm_90a, the portable family's kernels for what the hopper family "
                         "covers).")
        lines.append(_yaml_hint(wanted, spec))
        return "\n".join(lines)

    # -- loading and launching -----------------------------------------------------------------
    def load(self, entry: KernelEntry, device: int, capability: tuple[int, int]) -> LoadedKernel:
        """The entry's kernel, ready to launch on `device`; cubins load once (a library is device independent)."""
        if not ARCHS[entry.arch].runs_on(capability):
            raise ArchMismatchError(
                f"{entry.name} is built for {entry.arch}, which does not run on compute capability "
                f"{capability[0]}.{capability[1]} (device {device})"
            )
        kernel = self._kernels.get(entry.hash)
        if kernel is not None and (entry.hash, device) in self._configured:
            return kernel  # every launch: no lock once loaded and configured
        with self._lock:
            kernel = self._kernels.get(entry.hash)
            if kernel is None:
                kernel = self._kernels[entry.hash] = LoadedKernel(entry, self._get_kernel(entry))
            if (entry.hash, device) not in self._configured:
                if entry.smem_bytes > 48 * 1024:  # beyond the default limit a kernel must opt in, per device
                    self.driver.set_max_dynamic_smem(kernel.handle, entry.smem_bytes, device)
                self._configured.add((entry.hash, device))
            return kernel

    @functools.cached_property
    def _driver_version(self) -> int:
        return self.driver.version()

    def _check_driver(self, entry: KernelEntry) -> None:
        needed = _required_driver(entry.nvrtc_version)
        if self._driver_version < needed:
            have = f"{self._driver_version // 1000}.{self._driver_version % 1000 // 10}"
            raise DriverTooOldError(
                f"{entry.name} was built by NVRTC {entry.nvrtc_version} (CUDA {entry.nvrtc_version.split('.')[0]} "
                f"flavor); this driver supports CUDA {have}: update the NVIDIA driver, or install the flashkiln "
                f"build of the CUDA flavor your driver supports (e.g. flashkiln-...+cu{have.split('.')[0]})"
            )

    def _get_kernel(self, entry: KernelEntry) -> Any:
        self._check_driver(entry)
        expected_layout = params_layout(entry.descriptor["kernel"], entry.descriptor["family"]).digest
        if entry.params_layout != expected_layout:
            raise ManifestError(
                f"{entry.name} was built for parameter layout {entry.params_layout}, this runtime packs "
                f"{expected_layout}: regenerate the kernels with this flashkiln version"
            )
        return self.driver.get_kernel(self.library_of(entry), entry.symbol)

    def library_of(self, entry: KernelEntry) -> Any:
        """The driver's library of entry's cubin, loaded (and checked against the manifest) on first
        use: for tools that read a module's globals beside its kernels (tools/bwd_timeline.py)."""
        library = self._libraries.get(entry.cubin)
        if library is None:
            library = self._libraries[entry.cubin] = self.driver.load_library(self._verified_image(entry))
        return library

    def _verified_image(self, entry: KernelEntry) -> bytes:
        path = self.directory / entry.cubin
        try:
            image = path.read_bytes()
        except FileNotFoundError:
            raise KernelIntegrityError(f"cubin of {entry.name} is missing: {path}") from None
        digest = hashlib.sha256(image).hexdigest()
        if digest != entry.sha256:
            raise KernelIntegrityError(
                f"cubin {path} has sha256 {digest}, the manifest records {entry.sha256}: "
                "the file is corrupt or was replaced; regenerate or reinstall the kernels"
            )
        return image

    def verify(self) -> list[str]:
        """Every cubin of the manifest checked against its sha256 now: one message per problem."""
        problems = []
        for entry in {e.cubin: e for e in self.manifest.kernels}.values():
            try:
                self._verified_image(entry)
            except KernelIntegrityError as exc:
                problems.append(str(exc))
        return problems


@functools.lru_cache(maxsize=1)
def default_registry() -> KernelRegistry:
    return KernelRegistry()
