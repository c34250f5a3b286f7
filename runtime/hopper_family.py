"""The hopper family's planners: the warp-specialized TMA + wgmma kernels of sm_90a.

Forward (hopper/fwd_*.hpp): of a variant's several tunings it takes the one flashkiln.tile_choice
estimates fastest for the call's shape. Backward (hopper/bwd_*.hpp): the portable family's
preprocess (delta, the dQ accumulator zeroed), the main kernel (a CTA per key tile and query
head), then its own postprocess; dense and packed batches, with or without an additive bias and
dBias (which the main kernel reduces, or for a bias shared by several (batch, head) pairs a kernel
of its own sums: flashkiln.bias). One main kernel serves deterministic calls
too: given semaphores it adds dQ in a fixed key-tile order.
"""
from __future__ import annotations

import math

import torch

from . import bias as bias_mod
from . import dq_routes, inputs, portable_family, tile_choice, tma
from .bias import KernelBias
from .calls import BackwardCall, ForwardCall
from .errors import UnsupportedError
from .launch import BackwardLaunches, KernelLaunch, ScratchSet, Target, ceil_div
from .params import (BATCH_INNER, BWD_CONSUMER_WARPGROUPS, HEADS_INNER, QUERY_TILES_INNER, BwdParams,
                     HopperBwdParams, HopperFwdParams, TmaDescriptor, bwd_column_parts)
from .registry import KernelEntry, KernelRegistry

NAME = "hopper"
CAPABILITY = (9, 0)


def runs_on(capability: tuple[int, int]) -> str | None:
    """Why the family cannot run on `capability` (None: it can, given its variants)."""
    if capability != CAPABILITY:
        return (f"the hopper backend needs compute capability {CAPABILITY[0]}.{CAPABILITY[1]} "
                f"(sm_90a), this GPU has {capability[0]}.{capability[1]}")
    return None


# Rows of one TMA store of O: each consumer warpgroup writes its own 64 rows.
_O_BOX_ROWS = 64


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


def plan_forward(call: ForwardCall, target: Target, registry: KernelRegistry,
                 scratch: ScratchSet) -> list[KernelLaunch]:
    """The persistent Hopper forward for the call; UnsupportedError where TMA cannot address its
    tensors. A packed batch's tile is chosen for its longest sequences."""
    q, k, v, out = call.q, call.k, call.v, call.out
    hq = q.shape[1]
    shape = call.shape
    sq, sk = shape.seqlen_q, shape.seqlen_k
    entry = tile_choice.choose(registry.tunings(call.request(NAME), *target.limits), sq, sk, call.window)
    tile_m, tile_n = entry.descriptor["tile_m"], entry.descriptor["tile_n"]
    if sk == 0:
        raise UnsupportedError("the hopper forward needs at least one key")
    bias = call.bias
    bias_map = tma.encode_bias(bias.tensor, tile_m) if bias is not None else tma.BiasMap.none()
    num_m_blocks = ceil_div(sq, tile_m)
    # A packed batch's sequences end at different rows: its grid starts at row 0.
    shift_rows = 0 if call.causal == "none" or call.packed is not None else tile_choice.HOPPER_CAUSAL_SHIFT_ROWS
    row_shift = tile_choice.causal_row_shift(sq, tile_m, shift_rows)
    # Causal tiles differ in length, and so do a packed batch's (its sequences do): CTAs claim them
    # from a counter (zeroed for each call, on its stream) instead of a fixed round robin, which
    # left some CTAs mostly long ones.
    if call.causal != "none" or call.packed is not None:
        scratch.take("tile_counter", (1,), torch.int32, zeroed=True)
    else:
        scratch.absent("tile_counter")
    maps = {"tma_q": (q, tile_m), "tma_k": (k, tile_n), "tma_v": (v, tile_n), "tma_o": (out, _O_BOX_ROWS)}
    params = HopperFwdParams(
        **{name: tma.encode(t, rows) for name, (t, rows) in maps.items()},
        o_row_stride=out.stride(2), o_head_stride=out.stride(1),
        heads_q=hq, heads_kv=k.shape[1], **shape.params(), num_m_blocks=num_m_blocks, row_shift=row_shift,
        **inputs.score_fields(call.scale, call.softcap), **inputs.reach_fields(call.window, call.causal),
        tma_bias=bias_map.descriptor, bias_row_step=bias_map.row_step, bias_head_step=bias_map.head_step,
        bias_batch_step=bias_map.batch_step, tile_order=tile_order(bias, bias_map, shape.batch, target.l2_bytes),
    )
    roles = {"tma_q": "q", "tma_k": "k", "tma_v": "v", "tma_o": "o", **({"tma_bias": "bias"} if bias else {})}
    tensors = {**call.tensors(), **scratch.tensors}
    tensor_maps = tuple((name, role, tensors[role].data_ptr()) for name, role in roles.items())
    # Persistent: one CTA per SM (each takes all of an SM's registers).
    grid = (min(num_m_blocks * hq * shape.batch, target.multiprocessors), 1, 1)
    return [KernelLaunch.planned(entry, grid, params, tensors, tensor_maps)]


def backward_request(call: BackwardCall, dbias_in_main: bool = True) -> dict:
    """The functional fields of the call's main backward kernel: one kernel per causal mode and
    bias serves deterministic calls (the runtime passes it semaphores) and packed batches (it reads
    their sequence bounds) too; dBias of a key-varying bias has kernels of its own (bias_grad),
    unless bwd_dbias gives it (`dbias_in_main` False: dbias_kernel)."""
    return call.kernel_request("bwd", NAME, causal=call.causal, bias="none" if call.bias is None else "additive",
                               bias_grad=dbias_in_main and call.bias_grad and not call.bias.key_constant)


def dbias_reduction(call: BackwardCall) -> str | None:
    """How the main kernel would give the call's dBias from dS (flashkiln.bias.reduction), or None
    where it gives none (no dBias wanted, or a key-constant bias's closed form)."""
    if not call.bias_grad or call.bias.key_constant:
        return None
    return bias_mod.reduction(call.bias, call.packed is not None)


# Above this d_qk a bias whose slices the heads share keeps the main kernel's in-place sum (its
# pairs side by side): there bwd_dbias, which recomputes two GEMMs per pair and tile, measured
# slower than the sum's fp32 adds. bwd_dbias over that sum: 0.80-0.90x at d 128,
# S 8k (0.89-1.04x at 2k); 0.91-1.21x at d 64; 1.03-1.84x for a bias shared by batch entries alone,
# whose plane the sum must zero and convert (docs/perf.md, v47; d 96 follows d 128, unmeasured).
DBIAS_KERNEL_HEADS_SHARED_MAX_D = 64


def dbias_kernel(call: BackwardCall, target: Target, registry: KernelRegistry) -> KernelEntry | None:
    """The bwd_dbias kernel that gives dBias of the call's bias shared by several (batch entry,
    head) pairs, each dBias tile the sum of every pair's recomputed dS (hopper/bwd_dbias.hpp):
    for a dense batch whose bias reduction is SUM, unless heads share its slices above
    DBIAS_KERNEL_HEADS_SHARED_MAX_D, where the variant exists; else None, and the main kernel adds
    the pairs' dS into an fp32 sum."""
    if call.packed is not None or dbias_reduction(call) != bias_mod.SUM:
        return None
    if 1 in call.bias.broadcast_dims and call.q.shape[3] > DBIAS_KERNEL_HEADS_SHARED_MAX_D:
        return None
    request = call.kernel_request("bwd_dbias", NAME, causal=call.causal, bias="additive")
    return registry.find(request, *target.limits) if registry.has(request, target.capability) else None


# Above this d_qk a call that stores a full bias's dS as its dBias without a causal mask keeps the
# ordered dQ route, measured 8-20% faster there at d 256; every other call that is not
# deterministic adds dQ with atomics, measured 1-29% faster with a bias at d 64-256 (docs/perf.md,
# v45, v46; d 192/128 shares d 256's tiles and follows it unmeasured).
ORDERED_STORED_DBIAS_ABOVE_D = 128


def ordered(call: BackwardCall) -> bool:
    """Whether the call takes the ordered dQ route: when deterministic, or when above
    ORDERED_STORED_DBIAS_ABOVE_D it stores a full bias's dS as dBias without a causal mask."""
    if call.deterministic:
        return True
    return (call.q.shape[3] > ORDERED_STORED_DBIAS_ABOVE_D and call.causal == "none"
            and dbias_reduction(call) == bias_mod.STORE)


def staggered_sweep(call: BackwardCall, key_tiles: int, target: Target) -> bool:
    """Whether a deterministic call's key tiles may each start their sweep of the query tiles at
    their own index (hopper/bwd_schedule.hpp, QuerySweep; the kernel takes it where every key tile
    visits every query tile). A key tile then waits on dQ turns of key tiles launched after it, so
    every key tile of the longest sequence must be able to run at once: the kernel runs one CTA per
    multiprocessor, and half of them are the bound, which leaves room for other streams' kernels
    (the gain is at short sequences, docs/perf.md v30). A bias keeps the plain order: its dBias
    turns pass in it."""
    return (ordered(call) and call.bias is None and call.causal == "none" and call.window is None
            and 2 * key_tiles <= target.multiprocessors)


def plan_backward(call: BackwardCall, target: Target, registry: KernelRegistry,
                  scratch: ScratchSet) -> BackwardLaunches:
    """Preprocess, main kernel and postprocess of the Hopper backward; UnsupportedError for what it
    lacks (a forced dQ route other than the call's atomic or ordered one) and where TMA cannot
    address the tensors. A deterministic call (and `ordered`'s exception) takes the ordered route:
    the same kernel, given dq_semaphore; any other, the atomic one. dBias of a key-constant bias has
    a closed form (flashkiln.bias) from delta and dsink_parts; of any other bias it comes from dS,
    which the kernel stores or reduces (a shared bias's members take turns only when deterministic).

    Scratch roles: delta (fp32 rowsum(dO * O) - dLSE, as lse), dq_accum (fp32 dQ in the main
    kernel's tile order, hopper/bwd_dq_tiles.hpp; zeroed by the preprocess), dk_accum and dv_accum
    (GQA: fp32 sums per KV head, or per query head when deterministic), dsink_parts (fp32 (B, H_q, key tiles) sums
    of p_sink * P * dP, written by every CTA), dq_semaphore (deterministic: int32 (B,
    H_q, query tiles, consumer warpgroups), zeroed, counting the key tiles that added to each part of
    a query tile's dQ), and for dBias of a key-varying bias one of ds_workspace (dS, as the
    portable workspace route keeps it), dbias_columns and dbias_sum (the kernel's reductions,
    flashkiln.bias and hopper/bwd_params.hpp; a deterministic call's members take turns on the sum,
    counted in dbias_semaphore), or dbias_tiles (the bias's planes in its type, which bwd_dbias
    writes in place of dbias_sum: dbias_kernel)."""
    bias = call.bias
    deterministic = ordered(call)
    route = dq_routes.fallback_route(deterministic)
    forced = dq_routes.forced_route(deterministic)
    if forced not in (None, route):
        raise UnsupportedError(f"{dq_routes.ROUTE_ENV}={forced}: the hopper backward takes the {route} route for "
                               "this call")
    q, k, v = call.q, call.k, call.v
    layout_batches, hq, _, d_qk = q.shape  # one layout batch entry for a packed batch (common/sequence.hpp)
    hkv, d_v = k.shape[1], v.shape[3]
    shape = call.shape
    b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    tiles = dbias_kernel(call, target, registry)
    main = registry.find(backward_request(call, dbias_in_main=tiles is None), *target.limits)
    pre = registry.find(call.kernel_request("bwd_pre", portable_family.NAME), *target.limits)
    post = registry.find(call.kernel_request("bwd_post", NAME), *target.limits)
    tile_m, tile_n = main.descriptor["tile_m"], main.descriptor["tile_n"]
    key_tiles = ceil_div(sk, tile_n)  # the grid's, of the longest sequence
    maps = {"tma_q": (q, tile_m), "tma_k": (k, tile_n), "tma_v": (v, tile_n), "tma_do": (call.dout, tile_m)}
    parts = bwd_column_parts(tile_n)  # the boxes of a head dim whose columns the warpgroups split
    encoded = {name: tma.encode(t, rows, parts=parts) for name, (t, rows) in maps.items()}  # UnsupportedError first
    bias_map = tma.encode_bias(bias.tensor, tile_m) if bias is not None else tma.BiasMap.none()
    sq_rounded, dq_accum_rows = shape.seqlen_q_rounded, shape.dq_accum_rows
    f32 = torch.float32
    packed = call.packed is not None
    for role in (bias_mod.STORE, bias_mod.COLUMNS, bias_mod.SUM, bias_mod.TILES, "dbias_semaphore"):
        scratch.absent(role)
    reduction = bias_mod.TILES if tiles is not None else dbias_reduction(call)
    dbias_map = TmaDescriptor()
    if reduction == bias_mod.STORE:
        # The kernel zeroes the tiles that no key tile visits, not those past a packed sequence's ends.
        workspace = scratch.take(reduction, (portable_family.workspace_elements(shape, hq),), q.dtype, zeroed=packed)
        dbias_map = tma.encode(bias_mod.workspace_planes(workspace, b, hq, sq, sk), tile_m, whole_boxes=False)
    elif reduction == bias_mod.COLUMNS:
        scratch.take(reduction, (b, hq, sk), f32, zeroed=True)
    elif reduction == bias_mod.TILES:  # every element written by bwd_dbias
        scratch.take(reduction, bias_mod.sum_shape(bias), q.dtype)
    elif reduction == bias_mod.SUM:
        sum_shape = bias_mod.sum_shape(bias)
        scratch.take(reduction, sum_shape, f32, zeroed=True)
        if call.deterministic:  # the members' adds in turn; else in any order
            scratch.take("dbias_semaphore", (sum_shape[0] * sum_shape[1], ceil_div(sq, tile_m), key_tiles),
                         torch.int32, zeroed=True)
    scratch.take("delta", (layout_batches, hq, shape.total_q), f32)
    scratch.take("dq_accum", (layout_batches, hq, dq_accum_rows, d_qk), f32)  # zeroed by the preprocess
    if deterministic:
        scratch.take("dq_semaphore", (b, hq, ceil_div(sq, tile_m), BWD_CONSUMER_WARPGROUPS), torch.int32,
                     zeroed=True)
    else:
        scratch.absent("dq_semaphore")
    if call.sink_parts:  # zeros: the CTAs past a shorter packed sequence's key tiles write nothing
        scratch.take("dsink_parts", (b, hq, key_tiles), f32, zeroed=packed)
    else:
        scratch.absent("dsink_parts")
    # GQA: the query heads of a group add into one fp32 sum per KV head with unordered reductions,
    # less traffic and memory than fp32 per query head summed afterwards (docs/perf.md, v38), which
    # a deterministic call keeps for the fixed order of its sum.
    dkv_sums = hq != hkv and not deterministic
    if hq != hkv:
        heads = hkv if dkv_sums else hq
        # Sums are added into; per-head rows are zeroed for the keys of a packed batch in no sequence.
        scratch.take("dk_accum", (layout_batches, heads, shape.total_k, d_qk), f32, zeroed=packed or dkv_sums)
        scratch.take("dv_accum", (layout_batches, heads, shape.total_k, d_v), f32, zeroed=packed or dkv_sums)
    else:
        scratch.absent("dk_accum")
        scratch.absent("dv_accum")
    scores = {**inputs.score_fields(call.scale, call.softcap), **inputs.reach_fields(call.window, call.causal)}
    rows = BwdParams(
        **inputs.stride_fields("o", call.out), **inputs.stride_fields("do", call.dout),
        **inputs.stride_fields("dq", call.dq), heads_q=hq, heads_kv=hkv, **shape.params(),
        seqlen_q_rounded=sq_rounded, dq_accum_rows=dq_accum_rows, **scores, keys_complete=int(call.keys_complete))
    params = HopperBwdParams(
        **encoded, **inputs.stride_fields("dk", call.dk), **inputs.stride_fields("dv", call.dv),
        dq_accum_rows=dq_accum_rows, heads_q=hq, heads_kv=hkv, **shape.params(), **scores,
        tma_bias=bias_map.descriptor, bias_row_step=bias_map.row_step,
        bias_head_step=bias_map.head_step, bias_batch_step=bias_map.batch_step, tma_dbias=dbias_map,
        keys_complete=int(call.keys_complete), staggered_sweep=int(staggered_sweep(call, key_tiles, target)),
        dkv_sums=int(dkv_sums))
    tensors = {**call.tensors(), **scratch.tensors}
    roles = {"tma_q": "q", "tma_k": "k", "tma_v": "v", "tma_do": "dout", **({"tma_bias": "bias"} if bias else {}),
             **({"tma_dbias": bias_mod.STORE} if reduction == bias_mod.STORE else {})}
    tensor_maps = tuple((name, role, tensors[role].data_ptr()) for name, role in roles.items())
    launches = [
        KernelLaunch.planned(pre, (ceil_div(sq_rounded, pre.descriptor["tile_m"]), hq, b), rows, tensors),
        KernelLaunch.planned(main, (key_tiles, hq, b), params, tensors, tensor_maps),
        KernelLaunch.planned(post, (ceil_div(sq, post.descriptor["tile_m"]), hq, b), rows, tensors),
    ]
    if tiles is not None:  # after the main kernel, whose exact deltas (one key tile per row) it reads
        launches.insert(2, _dbias_launch(tiles, call, params, tensors, target))
    return BackwardLaunches(launches, route)


def _dbias_launch(entry: KernelEntry, call: BackwardCall, params: HopperBwdParams,
                  tensors: dict[str, torch.Tensor | None], target: Target) -> KernelLaunch:
    """bwd_dbias's launch: the main kernel's parameters with maps for its own tiles, and dBias's
    (the TILES planes, clipped at S_k) to store into; a CTA per (key tile, query tile, bias slice)
    tile, or persistent CTAs that walk them (dbias_ctas)."""
    tile_m, tile_n = entry.descriptor["tile_m"], entry.descriptor["tile_n"]
    shape = call.shape
    planes = tensors[bias_mod.TILES]
    maps = {"tma_q": ("q", tile_m), "tma_k": ("k", tile_n), "tma_v": ("v", tile_n), "tma_do": ("dout", tile_m)}
    dbias = HopperBwdParams.from_buffer_copy(params)
    for name, (role, rows) in maps.items():
        setattr(dbias, name, tma.encode(tensors[role], rows))
    dbias.tma_bias = tma.encode_bias(call.bias.tensor, tile_m).descriptor
    dbias.tma_dbias = tma.encode(planes[..., :shape.seqlen_k], tile_m, whole_boxes=False)
    roles = {**{name: role for name, (role, _) in maps.items()}, "tma_bias": "bias", "tma_dbias": bias_mod.TILES}
    tensor_maps = tuple((name, role, tensors[role].data_ptr()) for name, role in roles.items())
    key_tiles = ceil_div(shape.seqlen_k, tile_n)
    slices = planes.shape[0] * planes.shape[1]
    tiles = key_tiles * ceil_div(shape.seqlen_q, tile_m) * slices
    members = shape.batch * call.q.shape[1] // slices
    return KernelLaunch.planned(entry, (dbias_ctas(tiles, key_tiles, members, target), 1, 1), dbias, tensors,
                                tensor_maps)


# Up to this many members per dBias tile bwd_dbias runs persistent CTAs: measured 1.1-1.24x at 2
# members (S 8k) and 1.0-1.03x at 8 (S 2k), against a CTA per tile; at 32 (a bias shared by 32
# heads, S 8k, causal) 0.89x, likely the fixed walk's balance of the tiles that no row sees, which
# the hardware's order of one tile per CTA spreads as CTAs finish (docs/perf.md, v49).
DBIAS_PERSISTENT_MAX_MEMBERS = 8


def dbias_ctas(tiles: int, key_tiles: int, members: int, target: Target) -> int:
    """bwd_dbias's CTAs, each taking every count-th tile (key tiles fastest): one per tile, or for
    tiles of few members at most one per SM, a count prime to the key tiles. Under a causal mask
    or a window a tile's work depends on its key tile: with a common factor (132 SMs, 16 key
    tiles: 4) each CTA would see a quarter of the key tiles, up to 1.2x the mean work at S 2k."""
    if members > DBIAS_PERSISTENT_MAX_MEMBERS:
        return tiles
    ctas = min(tiles, target.multiprocessors)
    while math.gcd(ctas, key_tiles) != 1:
        ctas -= 1
    return ctas
