"""flashkiln: ahead-of-time generated fused attention kernels for NVIDIA GPUs."""
from .version import __version__  # noqa: F401 (the package's version)
from .forward import attention_forward
from .backward import attention_backward
from .context_parallel import context_parallel_attention
from .descriptor import VariantDescriptor
from .errors import (
    ArchMismatchError,
    CudaError,
    DriverTooOldError,
    FlashkilnError,
    InvalidInputError,
    KernelIntegrityError,
    ManifestError,
    UnsupportedError,
    VariantNotFoundError,
)
from .ops import scaled_dot_product_attention, varlen_attention
from .varlen import PackedBatch
from .registry import KernelRegistry

__all__ = [
    "ArchMismatchError",
    "CudaError",
    "DriverTooOldError",
    "FlashkilnError",
    "InvalidInputError",
    "KernelIntegrityError",
    "KernelRegistry",
    "ManifestError",
    "PackedBatch",
    "VariantDescriptor",
    "UnsupportedError",
    "VariantNotFoundError",
    "attention_backward",
    "attention_forward",
    "context_parallel_attention",
    "scaled_dot_product_attention",
    "varlen_attention",
]
