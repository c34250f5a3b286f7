"""Kernel parameter blocks, mirrored from templates/include/flashkiln/params.hpp.

The C++ struct is the kernel's single `__grid_constant__` argument. Each rendered translation
unit static_asserts the struct's size and every field's size and offset against the layout
computed here (by bit-casting a constexpr instance whose fields hold their 1-based index), so a
mismatch fails the compile; the manifest records the layout digest, and the runtime refuses a
cubin built against another layout.
"""
from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass


# Each sequence's rows in BwdParams.dq_accum are rounded up to this, so whole query tiles add
# unguarded: the mirror of kDqAccumRowAlign in templates/include/flashkiln/common/sequence.hpp.
DQ_ACCUM_ROW_ALIGN = 128

# The hopper backward main kernel's consumer warpgroups (kBwdConsumerWarpgroups,
# hopper/bwd_dq_tiles.hpp): its CTA's threads, its dQ parts, and a deterministic call's dQ
# semaphores per query tile.
BWD_CONSUMER_WARPGROUPS = 2


def bwd_column_parts(tile_n: int) -> int:
    """How many of the hopper backward's consumer warpgroups split a head dim's columns: all of them
    on key tiles of 64 (BwdTraits::kSplitColumns), else one (they split 128 keys instead)."""
    return BWD_CONSUMER_WARPGROUPS if tile_n == 64 else 1


# The hopper forward's work-tile orders, by their innermost dim (HopperFwdParams.tile_order;
# TileOrder in hopper/tile_scheduler.hpp).
QUERY_TILES_INNER, HEADS_INNER, BATCH_INNER = 0, 1, 2


def _int32(*names: str) -> list[tuple[str, type]]:
    return [(name, ctypes.c_int32) for name in names]


def _strides(*tensors: str) -> list[tuple[str, type]]:
    return [(f"{t}_{kind}_stride", ctypes.c_int64) for t in tensors for kind in ("batch", "head", "row")]


class FwdParams(ctypes.Structure):
    _fields_ = [
        # Device addresses (integers, so that the C++ side can check this layout in constexpr).
        ("q", ctypes.c_uint64),
        ("k", ctypes.c_uint64),
        ("v", ctypes.c_uint64),
        ("o", ctypes.c_uint64),
        ("lse", ctypes.c_uint64),
        ("bias", ctypes.c_uint64),
        ("sink", ctypes.c_uint64),
        ("cu_seqlens_q", ctypes.c_uint64),
        ("cu_seqlens_k", ctypes.c_uint64),
        # Strides in elements; the head dim (the key dim for the bias) is always contiguous.
        ("q_batch_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("q_row_stride", ctypes.c_int64),
        ("k_batch_stride", ctypes.c_int64),
        ("k_head_stride", ctypes.c_int64),
        ("k_row_stride", ctypes.c_int64),
        ("v_batch_stride", ctypes.c_int64),
        ("v_head_stride", ctypes.c_int64),
        ("v_row_stride", ctypes.c_int64),
        ("o_batch_stride", ctypes.c_int64),
        ("o_head_stride", ctypes.c_int64),
        ("o_row_stride", ctypes.c_int64),
        ("bias_batch_stride", ctypes.c_int64),
        ("bias_head_stride", ctypes.c_int64),
        ("bias_row_stride", ctypes.c_int64),
        *_int32("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k"),
        ("total_q", ctypes.c_int32),
        ("total_k", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("scale_log2", ctypes.c_float),
        *_int32("window_left", "window_right", "top_left"),
        ("softcap_scale", ctypes.c_float),
    ]


class BwdParams(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_uint64) for name in (
            "q", "k", "v", "o", "dout", "lse", "delta", "dq_accum", "dq", "dk", "dv", "dk_accum", "dv_accum",
            "dq_semaphore", "ds_workspace", "bias", "cu_seqlens_q", "cu_seqlens_k", "dlse", "sink", "dsink_parts")),
        *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv", "bias"),
        ("dq_accum_rows", ctypes.c_int64),
        *_int32("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k"),
        ("total_q", ctypes.c_int32),
        ("total_k", ctypes.c_int32),
        ("seqlen_q_rounded", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("scale_log2", ctypes.c_float),
        *_int32("window_left", "window_right", "top_left"),
        ("softcap_scale", ctypes.c_float),
        ("keys_complete", ctypes.c_int32),
    ]


class TmaDescriptor(ctypes.Structure):
    """A CUtensorMap's 128 bytes (runtime/tma.py fills them); 64-byte aligned on the C++ side."""

    _fields_ = [("words", ctypes.c_uint64 * 16)]


class HopperFwdParams(ctypes.Structure):
    """The Hopper forward's block (templates/include/flashkiln/hopper/fwd_params.hpp). The tensor maps
    come first, at offsets that are multiples of 64, and the size is padded to a multiple of 64."""

    _fields_ = [
        ("tma_q", TmaDescriptor),
        ("tma_k", TmaDescriptor),
        ("tma_v", TmaDescriptor),
        ("tma_o", TmaDescriptor),
        ("tma_bias", TmaDescriptor),
        ("lse", ctypes.c_uint64),
        ("sink", ctypes.c_uint64),
        ("cu_seqlens_q", ctypes.c_uint64),
        ("cu_seqlens_k", ctypes.c_uint64),
        ("o", ctypes.c_uint64),
        ("o_row_stride", ctypes.c_int64),
        ("o_head_stride", ctypes.c_int64),
        *_int32("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k"),
        ("total_q", ctypes.c_int32),
        ("total_k", ctypes.c_int32),
        ("num_m_blocks", ctypes.c_int32),
        ("row_shift", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("scale_log2", ctypes.c_float),
        ("tile_counter", ctypes.c_uint64),
        ("bias_row_step", ctypes.c_int32),
        ("bias_head_step", ctypes.c_int32),
        ("bias_batch_step", ctypes.c_int32),
        ("tile_order", ctypes.c_int32),
        *_int32("window_left", "window_right", "top_left"),
        ("softcap_scale", ctypes.c_float),
        ("_pad", ctypes.c_int32 * 12),  # to the 64-byte multiple that the maps' alignment makes the C++ size
    ]


class HopperBwdParams(ctypes.Structure):
    """The Hopper backward main kernel's block (templates/include/flashkiln/hopper/bwd_params.hpp): the
    tensor maps first, the size padded to a multiple of 64 (their alignment)."""

    _fields_ = [
        ("tma_q", TmaDescriptor),
        ("tma_k", TmaDescriptor),
        ("tma_v", TmaDescriptor),
        ("tma_do", TmaDescriptor),
        ("tma_bias", TmaDescriptor),
        ("tma_dbias", TmaDescriptor),
        *((name, ctypes.c_uint64) for name in ("lse", "delta", "dlse", "dq_accum", "dk", "dv", "dk_accum", "dv_accum",
                                               "sink", "dsink_parts", "dq_semaphore", "cu_seqlens_q", "cu_seqlens_k",
                                               "ds_workspace", "dbias_columns", "dbias_sum", "dbias_semaphore")),
        *_strides("dk", "dv"),
        ("dq_accum_rows", ctypes.c_int64),
        *_int32("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "total_q", "total_k"),
        ("scale", ctypes.c_float),
        ("scale_log2", ctypes.c_float),
        *_int32("bias_row_step", "bias_head_step", "bias_batch_step", "window_left", "window_right",
                "top_left"),
        ("softcap_scale", ctypes.c_float),
        ("keys_complete", ctypes.c_int32),
        ("staggered_sweep", ctypes.c_int32),
        ("dkv_sums", ctypes.c_int32),
        ("_pad", ctypes.c_int32 * 13),  # to the 64-byte multiple that the maps' alignment makes the C++ size
    ]


# Which parameter struct each kernel takes: C++ type name and its ctypes mirror.
PARAMS_BY_KERNEL: dict[str, tuple[str, type[ctypes.Structure]]] = {
    "fwd": ("flashkiln::FwdParams", FwdParams),
    "bwd_pre": ("flashkiln::BwdParams", BwdParams),
    "bwd": ("flashkiln::BwdParams", BwdParams),
    "bwd_post": ("flashkiln::BwdParams", BwdParams),
    "bwd_dq": ("flashkiln::BwdParams", BwdParams),
}
# Families whose kernels take another struct than PARAMS_BY_KERNEL's: (family, kernel) -> struct.
PARAMS_BY_FAMILY_KERNEL: dict[tuple[str, str], tuple[str, type[ctypes.Structure]]] = {
    ("hopper", "fwd"): ("flashkiln::HopperFwdParams", HopperFwdParams),
    ("hopper", "bwd"): ("flashkiln::HopperBwdParams", HopperBwdParams),
    ("hopper", "bwd_dbias"): ("flashkiln::HopperBwdParams", HopperBwdParams),
}


@dataclass(frozen=True)
class FieldLayout:
    name: str
    offset: int
    size: int
    is_float: bool
    is_aggregate: bool = False  # an array or struct field (the C++ probe initializes it with braces)


@dataclass(frozen=True)
class ParamsLayout:
    cpp_type: str
    size: int
    fields: tuple[FieldLayout, ...]

    @property
    def digest(self) -> str:
        text = ";".join(f"{f.name}@{f.offset}+{f.size}" for f in self.fields) + f";size={self.size}"
        return hashlib.sha256(f"{self.cpp_type}|{text}".encode()).hexdigest()[:16]


def params_layout(kernel: str, family: str = "portable") -> ParamsLayout:
    cpp_type, struct = PARAMS_BY_FAMILY_KERNEL.get((family, kernel)) or PARAMS_BY_KERNEL[kernel]
    fields = tuple(
        FieldLayout(name, getattr(struct, name).offset, getattr(struct, name).size, ctype is ctypes.c_float,
                    issubclass(ctype, (ctypes.Array, ctypes.Structure)))
        for name, ctype in struct._fields_
    )
    return ParamsLayout(cpp_type, ctypes.sizeof(struct), fields)
