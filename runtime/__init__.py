"""flashkiln: ahead-of-time generated fused attention kernels for NVIDIA GPUs."""
__version__ = "0.1.0"

from .attention import attention_forward
from .descriptor import VariantDescriptor
from .errors import (
    ArchMismatchError,
    CudaError,
    FlashkilnError,
    InvalidInputError,
    KernelIntegrityError,
    ManifestError,
    VariantNotFoundError,
)
from .registry import KernelRegistry

__all__ = [
    "ArchMismatchError",
    "CudaError",
    "FlashkilnError",
    "InvalidInputError",
    "KernelIntegrityError",
    "KernelRegistry",
    "ManifestError",
    "VariantDescriptor",
    "VariantNotFoundError",
    "attention_forward",
]
