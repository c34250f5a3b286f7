"""The CUDA driver calls the runtime makes, each result checked (cuda-bindings).

Cubins are loaded with cuLibraryLoadData / cuLibraryGetKernel: a library is independent of
contexts and devices, and loads into whichever context is current at launch. The two calls made per
launch (cuLaunchKernel, cuTensorMapReplaceAddress) go through the driver's own entry points, looked
up once with cuGetProcAddress and called through ctypes with plain integers: cuda-bindings' wrappers
build and check Python objects per argument, which cost several times the driver's own work
(docs/perf.md, v29). Tests replace this class with a fake that records the calls.
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


def _check(result: tuple, what: str) -> Any:
    from cuda.bindings import driver as cu

    if result[0] != cu.CUresult.CUDA_SUCCESS:
        _fail(cu, result[0], what)
    return result[1] if len(result) == 2 else result[1:]


def _fail(cu: Any, err: Any, what: str) -> NoReturn:
    _, name = cu.cuGetErrorName(err)
    _, text = cu.cuGetErrorString(err)
    decode = lambda s: s.decode() if isinstance(s, bytes) else str(s)  # noqa: E731
    raise CudaError(f"{what} failed: {decode(name)} ({decode(text)})")


# A launch's kernelParams: an array of one pointer, to the bytes of its one by-value struct argument.
_KERNEL_PARAMS = struct.Struct("P")
# The driver's prototypes (cuda.h): CUresult cuLaunchKernel(CUfunction, gridDim x y z, blockDim x y
# z, sharedMemBytes, CUstream, void** kernelParams, void** extra) and CUresult
# cuTensorMapReplaceAddress(CUtensorMap*, void* globalAddress).
_LAUNCH_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p)
_REPLACE_ADDRESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
# The ABI the entry points are asked for: CUDA 12.0's, the oldest driver the cubins run on.
_ENTRY_POINT_VERSION = 12000


def _entry_point(cu: Any, symbol: str, prototype: Any) -> Any:
    """The driver's `symbol` as a ctypes function of `prototype`; stream 0 is the legacy default
    stream, as in torch."""
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
    address, status = _check(cu.cuGetProcAddress(symbol.encode(), _ENTRY_POINT_VERSION, flags),
                             f"cuGetProcAddress({symbol})")
    if not int(address) or status != cu.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS:
        raise CudaError(f"cuGetProcAddress({symbol}) found no entry point for CUDA {_ENTRY_POINT_VERSION}: {status}")
    return prototype(int(address))


class CudaDriver:
    """The real driver, through cuda.bindings.driver."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        self._threads = threading.local()
        _check(cu.cuInit(0), "cuInit")
        self._launch_kernel = _entry_point(cu, "cuLaunchKernel", _LAUNCH_KERNEL)
        self._replace_address = _entry_point(cu, "cuTensorMapReplaceAddress", _REPLACE_ADDRESS)

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
        err = self._replace_address(tensor_map, address)
        if err:
            _fail(self._cu, self._cu.CUresult(err), "cuTensorMapReplaceAddress")

    def launch(self, kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], smem_bytes: int,
               stream: int, params: ctypes.Structure) -> None:
        """`kernel`: a CUkernel (or CUfunction) handle or its address; `stream`: a raw CUstream handle."""
        err = self._launch_kernel(int(kernel), *grid, *block, smem_bytes, stream,
                                  _KERNEL_PARAMS.pack(ctypes.addressof(params)), None)
        if err:
            _fail(self._cu, self._cu.CUresult(err), "cuLaunchKernel")
