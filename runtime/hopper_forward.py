"""Planning a Hopper-family forward launch: variant lookup, tensor maps, parameter block, grid."""
from __future__ import annotations

import math

import torch

from . import inputs, tile_choice, tma
from .backends import forward_family
from .bias import KernelBias
from .errors import UnsupportedError
from .launch import KernelLaunch, Target, ceil_div, request
from .params import HopperFwdParams
from .registry import KernelRegistry
from .varlen import BatchShape, PackedBatch

# Rows of one TMA store of O: each consumer warpgroup writes its own 64 rows.
_O_BOX_ROWS = 64


# The work tiles' innermost dim (HopperFwdParams.tile_order; TileOrder in hopper/tile_scheduler.hpp).
QUERY_TILES_INNER, HEADS_INNER, BATCH_INNER = 0, 1, 2


def tile_order(bias: KernelBias | None, bias_map: tma.BiasMap, batch: int, l2_bytes: int) -> int:
    """The hopper forward's tile order for a call: query tiles innermost, so that the CTAs in flight
    share one head's K and V, unless a bias broadcast over heads or batches would then stream from
    HBM again for each of them. Heads run innermost where a bias shared across heads has an
    (S_q, S_k) plane that does not fit in L2; batch entries where a bias shared across them does
    not fit in L2 (all its heads). Then the CTAs in flight read the same bias tiles. Measured on an
    H200 (docs/perf.md, v15)."""
    if bias is None:
        return QUERY_TILES_INNER
    _, heads, rows, cols = bias.tensor.shape
    plane = (rows if bias_map.row_step else 1) * cols * bias.tensor.element_size()
    if bias_map.head_step == 0 and plane > l2_bytes:
        return HEADS_INNER
    if bias_map.batch_step == 0 and batch > 1 and plane * (heads if bias_map.head_step else 1) > l2_bytes:
        return BATCH_INNER
    return QUERY_TILES_INNER


def plan_hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        causal: str, scale: float, bias: KernelBias | None, sink: torch.Tensor | None,
                        target: Target, registry: KernelRegistry, packed: PackedBatch | None = None) -> KernelLaunch:
    """The persistent Hopper forward for checked inputs (for a packed batch: their (1, H, total, d)
    views); UnsupportedError where TMA cannot address them. A packed batch's tile is chosen for its
    longest sequences."""
    _, hq, _, dqk = q.shape
    _, hkv, _, dv = v.shape
    shape = BatchShape.of(q, k, packed)
    sq, sk = shape.seqlen_q, shape.seqlen_k
    entry = registry.find(request("fwd", inputs.DTYPES[q.dtype], dqk, dv, causal, bias=bias is not None,
                                  family="hopper", packed=packed is not None), target.capability, shape=(sq, sk))
    tile_m, tile_n = entry.descriptor["tile_m"], entry.descriptor["tile_n"]
    if sk == 0:
        raise UnsupportedError("the hopper forward needs at least one key")
    bias_map = tma.encode_bias(bias.tensor, tile_m) if bias is not None else tma.BiasMap.none()
    num_m_blocks = ceil_div(sq, tile_m)
    # A packed batch's sequences end at different rows: its grid starts at row 0.
    shift_rows = 0 if causal == "none" or packed is not None else tile_choice.HOPPER_CAUSAL_SHIFT_ROWS
    row_shift = tile_choice.causal_row_shift(sq, tile_m, shift_rows)
    # Causal tiles differ in length, and so do a packed batch's (its sequences do): CTAs claim them
    # from a counter (zeroed here, on the launch's stream) instead of a fixed round robin, which
    # left some CTAs mostly long ones.
    dynamic = causal != "none" or packed is not None
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else None
    params = HopperFwdParams(
        tma_q=tma.encode(q, tile_m), tma_k=tma.encode(k, tile_n), tma_v=tma.encode(v, tile_n),
        tma_o=tma.encode(out, _O_BOX_ROWS), o=out.data_ptr(), o_row_stride=out.stride(2), o_head_stride=out.stride(1),
        lse=lse.data_ptr(), sink=0 if sink is None else sink.data_ptr(),
        heads_q=hq, heads_kv=hkv, **shape.params(), num_m_blocks=num_m_blocks, row_shift=row_shift,
        scale=scale, scale_log2=scale * math.log2(math.e),
        tile_counter=0 if counter is None else counter.data_ptr(),
        tma_bias=bias_map.descriptor, bias_row_step=bias_map.row_step, bias_head_step=bias_map.head_step,
        bias_batch_step=bias_map.batch_step,
    )
    device = torch.cuda.get_device_properties(target.device)
    params.tile_order = tile_order(bias, bias_map, shape.batch, device.L2_cache_size)
    # Persistent: one CTA per SM (each takes all of an SM's registers).
    sms = device.multi_processor_count
    return KernelLaunch(entry, (min(num_m_blocks * hq * shape.batch, sms), 1, 1), params,
                        keep_alive=() if counter is None else (counter,))


def plan_if_hopper(backend: str | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: str, scale: float, bias: KernelBias | None, sink: torch.Tensor | None,
                   packed: PackedBatch | None, target: Target, registry: KernelRegistry) -> KernelLaunch | None:
    """The Hopper launch when `backend` selects that family for this call, else None (portable).

    Under auto, inputs whose layout TMA cannot address go to the portable family too."""
    hopper_request = request("fwd", inputs.DTYPES[q.dtype], q.shape[3], v.shape[3], causal, bias=bias is not None,
                             family="hopper", packed=packed is not None)
    if forward_family(backend, target.capability, registry, hopper_request) != "hopper":
        return None
    try:
        return plan_hopper_forward(q, k, v, out, lse, causal, scale, bias, sink, target, registry, packed)
    except UnsupportedError:
        if backend == "hopper":
            raise
        return None
