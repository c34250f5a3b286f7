"""The CUDA driver calls the runtime makes, each result checked (cuda-bindings).

Cubins are loaded with cuLibraryLoadData / cuLibraryGetKernel: a library is independent of
contexts and devices, and loads into whichever context is current at launch. Tests replace this
class with a fake that records the calls.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Protocol

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

    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        decode = lambda s: s.decode() if isinstance(s, bytes) else str(s)  # noqa: E731
        raise CudaError(f"{what} failed: {decode(name)} ({decode(text)})")
    return result[1] if len(result) == 2 else result[1:]


class CudaDriver:
    """The real driver, through cuda.bindings.driver."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        self._threads = threading.local()
        self._functions: dict[int, Any] = {}  # CUkernel address -> the CUfunction cuLaunchKernel takes
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
        bound = self._threads.__dict__.setdefault("bound", set())
        if device in bound:
            return
        if int(_check(self._cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
            primary = _check(self._cu.cuDevicePrimaryCtxRetain(self._cu.CUdevice(device)), "cuDevicePrimaryCtxRetain")
            _check(self._cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        bound.add(device)

    def replace_tensor_map_address(self, tensor_map: int, address: int) -> None:
        """Point the 128-byte CUtensorMap at host address `tensor_map` (inside a parameter block) at
        `address`, keeping its shape, strides and box: cheaper than encoding it anew."""
        _check(self._cu.cuTensorMapReplaceAddress(self._cu.CUtensorMap(_ptr=tensor_map), address),
               "cuTensorMapReplaceAddress")

    def launch(self, kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], smem_bytes: int,
               stream: int, params: ctypes.Structure) -> None:
        # One by-value struct argument: kernelParams[0] points at its bytes.
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        address = int(kernel)
        function = self._functions.get(address)
        if function is None:
            function = self._functions[address] = self._cu.CUfunction(address)
        _check(self._cu.cuLaunchKernel(function, *grid, *block, smem_bytes, self._cu.CUstream(stream),
                                       ctypes.addressof(args), 0), "cuLaunchKernel")
