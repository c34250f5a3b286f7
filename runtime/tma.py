"""TMA tensor maps for the Hopper kernels, encoded on the host (cuTensorMapEncodeTiled).

CuTe's host-side TMA helpers are not available under NVRTC, so the runtime builds the maps: a
(B, H, S, d) tensor with a contiguous head dim becomes a 4-d map (d, S, H, B) with byte strides,
read and written in boxes of `head_box_cols(d, parts)` columns (one swizzle atom: 128 bytes, or 64
where the columns each consumer warpgroup takes are not a multiple of 64) by `rows` rows. Rows
past S are zero-filled on loads and dropped on stores, so tiles never reach into the next head. A
bias (B, H_q, S_q, S_k) maps the same way, its keys as the columns, in boxes of 64.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .driver import raise_cuda_error
from .errors import UnsupportedError
from .params import TmaDescriptor

BOX_COLS = 64  # elements: 128 bytes of fp16/bf16, the 128-byte swizzle's row
_MAX_BOX_ROWS = 256
_MAX_STRIDE = 1 << 40  # bytes, exclusive


@dataclass(frozen=True)
class TensorMapShape:
    """What a tensor map of a (B, H, S, d) tensor is encoded from (innermost dim first)."""

    address: int
    dims: tuple[int, int, int, int]     # (d, S, H, B)
    strides: tuple[int, int, int]       # bytes of S, H, B steps
    box: tuple[int, int, int, int]      # (columns, rows, 1, 1), one swizzle atom wide


def tensor_map_shape(t: torch.Tensor, rows: int, whole_boxes: bool = True, parts: int = 1) -> TensorMapShape:
    """The map's shape for `t` and a box of `rows` rows; UnsupportedError where TMA cannot read `t`
    (the caller then falls back to a kernel that reads through plain pointers). `whole_boxes`: the
    last dim is a head dim, read in whole boxes of head_box_cols(d, parts) columns; else (a bias's
    keys) boxes of BOX_COLS, TMA zero-filling past the last column."""
    if t.dim() != 4 or t.stride(3) != 1:
        raise UnsupportedError(f"TMA needs a 4-d tensor with a contiguous last dim, got strides {t.stride()}")
    b, h, s, d = t.shape
    elem = t.element_size()
    cols = head_box_cols(d, parts) if whole_boxes else BOX_COLS
    if (whole_boxes and d % cols) or not 0 < rows <= _MAX_BOX_ROWS:
        raise UnsupportedError(f"TMA boxes of {cols} columns x {rows} rows do not fit head dim {d}")
    if t.data_ptr() % 16:
        raise UnsupportedError("TMA needs a 16-byte aligned base address")
    strides = []
    # Bytes of one step of the previous dim, for dims of extent 1 (any multiple of 16 will do).
    span = -(-d * elem // 16) * 16
    for extent, stride in ((s, t.stride(2)), (h, t.stride(1)), (b, t.stride(0))):
        step = stride * elem if extent > 1 else span
        if step <= 0 or step % 16 or step >= _MAX_STRIDE:
            raise UnsupportedError(f"TMA needs strides that are positive multiples of 16 bytes, got {t.stride()}")
        strides.append(step)
        span = step * extent
    return TensorMapShape(t.data_ptr(), (d, s, h, b), tuple(strides), (cols, rows, 1, 1))


def head_box_cols(d: int, parts: int = 1) -> int:
    """Columns per box of a head dim of d (2-byte elements) whose columns `parts` consumer warpgroups
    split, each taking whole boxes: 64 (a 128-byte swizzle atom) where d / parts is a multiple of 64,
    else 32 (a 64-byte one). Mirrors hopper/head_boxes.hpp."""
    return BOX_COLS if d // parts % BOX_COLS == 0 else BOX_COLS // 2


def encode(t: torch.Tensor, rows: int, whole_boxes: bool = True, parts: int = 1) -> TmaDescriptor:
    """The CUtensorMap of `t` (fp16/bf16) for boxes of `rows` rows, swizzled across a box's width
    (`parts`: the consumer warpgroups that split a head dim's columns, head_box_cols)."""
    descriptor = TmaDescriptor()
    descriptor.words[:] = _encoded(tensor_map_shape(t, rows, whole_boxes, parts), t.dtype)
    return descriptor


@dataclass(frozen=True)
class BiasMap:
    """A bias's map and the steps the kernel multiplies its row, head and batch coordinates by: a
    dim the bias broadcasts along (stride 0) becomes extent 1, read at coordinate 0; broadcast over
    query rows, the map's box is one row high (the kernel reads that row for every query)."""

    descriptor: TmaDescriptor
    row_step: int
    head_step: int
    batch_step: int

    @staticmethod
    def none() -> "BiasMap":
        return BiasMap(TmaDescriptor(), 0, 0, 0)


def bias_view(bias: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """What the map of a (B, H_q, S_q, S_k) bias view (zero strides where it broadcasts,
    runtime/bias.py) covers, and its (row, head, batch) steps."""
    b, h, sq, _ = bias.shape
    steps = tuple(int(bias.stride(dim) != 0) for dim in (2, 1, 0))
    row_step, head_step, batch_step = steps
    return bias[:b if batch_step else 1, :h if head_step else 1, :sq if row_step else 1], steps


def encode_bias(bias: torch.Tensor, rows: int) -> BiasMap:
    """The map of a bias view (bias_view) for boxes of `rows` query rows (or 1) by 64 keys."""
    view, (row_step, head_step, batch_step) = bias_view(bias)
    return BiasMap(encode(view, rows if row_step else 1, whole_boxes=False), row_step, head_step, batch_step)


# A map is a pure function of its shape (address included), and the caching allocator hands the
# same addresses out again: repeated calls skip the driver call.
@functools.lru_cache(maxsize=1024)
def _encoded(shape: TensorMapShape, dtype: torch.dtype) -> tuple[int, ...]:
    from cuda.bindings import driver as cu

    swizzles = {128: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,  # by a box row's bytes
                64: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B}
    data_type = {torch.float16: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                 torch.bfloat16: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16}[dtype]
    err, tensor_map = cu.cuTensorMapEncodeTiled(
        data_type, 4, shape.address, [cu.cuuint64_t(x) for x in shape.dims],
        [cu.cuuint64_t(x) for x in shape.strides], [cu.cuuint32_t(x) for x in shape.box],
        [cu.cuuint32_t(1)] * 4,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzles[shape.box[0] * dtype.itemsize],
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err == cu.CUresult.CUDA_ERROR_INVALID_VALUE:
        # A shape, stride or box TMA cannot map: a family that reads through pointers may run the call.
        raise UnsupportedError(f"cuTensorMapEncodeTiled refused {shape}: {err}")
    if err != cu.CUresult.CUDA_SUCCESS:
        # Any other failure is the driver's (no context, say), not the call's: raised, never a fallback.
        raise_cuda_error(cu, err, f"cuTensorMapEncodeTiled of {shape}")
    return tuple(int(w) for w in tensor_map.opaque)
