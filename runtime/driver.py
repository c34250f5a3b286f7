"""The CUDA driver calls the runtime makes, each result checked (cuda-bindings).

Cubins are loaded with cuLibraryLoadData / cuLibraryGetKernel: a library is independent of
contexts and devices, and loads into whichever context is current at launch. Tests replace this
class with a fake that records the calls.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, NoReturn, Protocol

from .errors import CudaError


class Driver(Protocol):
    def version(self) -> int: ...

    def load_library(self, image: bytes) -> Any: ...

    def get_kernel(self, library: Any, symbol: str) -> Any: ...

    def set_max_dynamic_smem(self, kernel: Any, nbytes: int, device: int) -> None: ...

    def bind_context(self, device: int) -> None: ...

    def replace_tensor_map_address(self, tensor_map: int, address: int) -> None: ...

    def launch(self, kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], smem_bytes: int,
               stream: int, params: ctypes.Structure) -> None: ...

    def entry_points(self) -> tuple[int, int] | None:
        """The addresses of cuLaunchKernel and cuTensorMapReplaceAddress for flashkiln._launch, or
        None: launch through `launch` and `replace_tensor_map_address`."""
        ...

    def raise_failure(self, what: str, code: int) -> NoReturn:
        """Raise for a failed entry point's CUresult `code` (flashkiln._launch reports them)."""
        ...


def _check(result: tuple, what: str) -> Any:
    from cuda.bindings import driver as cu

    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise_cuda_error(cu, result[0], what)
    return result[1] if len(result) == 2 else result[1:]


def raise_cuda_error(cu: Any, err: Any, what: str) -> NoReturn:
    """CudaError for the CUresult `err` of driver call `what`, with the driver's name and text for it."""
    _, name = cu.cuGetErrorName(err)
    _, text = cu.cuGetErrorString(err)
    decode = lambda s: s.decode() if isinstance(s, bytes) else str(s)  # noqa: E731
    raise CudaError(f"{what} failed: {decode(name)} ({decode(text)})")


# A launch's kernelParams: an array of one pointer, to the bytes of its one by-value struct argument.
_KERNEL_PARAMS = struct.Struct("P")
# The ABI of the entry points flashkiln._launch calls: CUDA 12.0's (cuTensorMapReplaceAddress's first).
_ENTRY_POINT_VERSION = 12000
# CUstream objects kept per raw handle; past this many distinct handles the cache starts over.
_STREAMS_KEPT = 64


class CudaDriver:
    """The real driver, through cuda.bindings.driver."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        # Bound once for the per-call paths (launch, replace_tensor_map_address): no lookups there.
        self._success = cu.CUresult.CUDA_SUCCESS
        self._launch_kernel = cu.cuLaunchKernel
        self._threads = threading.local()
        self._functions: dict[int, Any] = {}  # CUkernel address -> the CUfunction cuLaunchKernel takes
        self._streams: dict[int, Any] = {}  # raw handle -> CUstream: a lookup is cheaper than building one
        self._entry_points: tuple[int, int] | None = None  # asked for once
        _check(cu.cuInit(0), "cuInit")

    def version(self) -> int:
        """The CUDA version the driver supports, as 1000 * major + 10 * minor."""
        return _check(self._cu.cuDriverGetVersion(), "cuDriverGetVersion")

    def load_library(self, image: bytes) -> Any:
        return _check(self._cu.cuLibraryLoadData(image, None, None, 0, None, None, 0), "cuLibraryLoadData")

    def get_kernel(self, library: Any, symbol: str) -> Any:
        return _check(self._cu.cuLibraryGetKernel(library, symbol.encode()), f"cuLibraryGetKernel({symbol})")

    def set_max_dynamic_smem(self, kernel: Any, nbytes: int, device: int) -> None:
        attr = self._cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(self._cu.cuKernelSetAttribute(attr, nbytes, kernel, self._cu.CUdevice(device)),
               f"cuKernelSetAttribute(max dynamic shared memory = {nbytes})")

    def bind_context(self, device: int) -> None:
        """Make `device`'s primary context (torch's) current on this thread if none is. A thread on
        which torch made no runtime call that binds one (autograd's device threads, say: torch skips
        cudaSetDevice when the device is already the current one) has none, and a driver launch there
        fails with CUDA_ERROR_INVALID_CONTEXT. Checked once per thread and device."""
        bound = getattr(self._threads, "bound", None)
        if bound is None:
            bound = self._threads.bound = set()
        elif device in bound:
            return
        if int(_check(self._cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
            primary = _check(self._cu.cuDevicePrimaryCtxRetain(self._cu.CUdevice(device)), "cuDevicePrimaryCtxRetain")
            _check(self._cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        bound.add(device)

    def replace_tensor_map_address(self, tensor_map: int, address: int) -> None:
        """Point the 128-byte CUtensorMap at host address `tensor_map` (inside a parameter block) at
        `address`, keeping its shape, strides and box: cheaper than encoding it anew."""
        err = self._cu.cuTensorMapReplaceAddress(self._cu.CUtensorMap(_ptr=tensor_map), address)[0]
        if err != self._success:
            raise_cuda_error(self._cu, err, "cuTensorMapReplaceAddress")

    def entry_points(self) -> tuple[int, int]:
        if self._entry_points is None:
            # Legacy default-stream semantics for stream 0, as cuda-bindings' own calls and torch's.
            flags = self._cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
            found = []
            for symbol in (b"cuLaunchKernel", b"cuTensorMapReplaceAddress"):
                address, _ = _check(self._cu.cuGetProcAddress(symbol, _ENTRY_POINT_VERSION, flags),
                                    f"cuGetProcAddress({symbol.decode()})")
                if not int(address):
                    raise CudaError(f"the driver has no {symbol.decode()} of CUDA {_ENTRY_POINT_VERSION}")
                found.append(int(address))
            self._entry_points = (found[0], found[1])
        return self._entry_points

    def raise_failure(self, what: str, code: int) -> NoReturn:
        raise_cuda_error(self._cu, self._cu.CUresult(code), what)

    def launch(self, kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], smem_bytes: int,
               stream: int, params: ctypes.Structure) -> None:
        address = int(kernel)
        function = self._functions.get(address)
        if function is None:
            function = self._functions[address] = self._cu.CUfunction(address)
        handle = self._streams.get(stream)
        if handle is None:
            handle = self._stream(stream)
        err = self._launch_kernel(function, *grid, *block, smem_bytes, handle,
                                  _KERNEL_PARAMS.pack(ctypes.addressof(params)), 0)[0]
        if err != self._success:
            raise_cuda_error(self._cu, err, "cuLaunchKernel")

    def _stream(self, stream: int) -> Any:
        if len(self._streams) >= _STREAMS_KEPT:
            self._streams.clear()
        handle = self._streams[stream] = self._cu.CUstream(stream)
        return handle
