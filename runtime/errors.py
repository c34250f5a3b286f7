"""Typed errors: every failure a caller can cause or hit is one of these, raised before launch."""
from __future__ import annotations


class FlashkilnError(Exception):
    """Base class of every flashkiln error."""


class InvalidInputError(FlashkilnError, ValueError):
    """An argument has the wrong dtype, device, shape, stride, head dim or value."""


class UnsupportedError(FlashkilnError, NotImplementedError):
    """A valid request that flashkiln does not implement (yet)."""


class ManifestError(FlashkilnError):
    """The kernel manifest is missing, unreadable or inconsistent."""


class KernelIntegrityError(FlashkilnError):
    """A cubin is missing, or its content does not match the manifest's sha256."""


class ArchMismatchError(FlashkilnError):
    """No generated cubin can run on this GPU's compute capability."""


class VariantNotFoundError(FlashkilnError, LookupError):
    """The call needs a kernel variant that was not generated."""


class DriverTooOldError(FlashkilnError):
    """The NVIDIA driver is older than the CUDA version that built the kernels."""


class CudaError(FlashkilnError, RuntimeError):
    """A CUDA driver call failed."""
