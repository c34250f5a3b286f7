"""The Hopper family on the CPU: specs and tunings, the parameter block, rendering, NVRTC + SASS,
tensor-map shapes and backend selection (the GPU side is tests/test_hopper_forward_gpu.py)."""
from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashkiln.descriptor import VariantDescriptor
from flashkiln.errors import CudaError, InvalidInputError, UnsupportedError
from flashkiln.launch import ScratchSet
from flashkiln.generator.families import FAMILIES
from flashkiln.generator.render import render
from flashkiln.generator.specs import load_variants
from flashkiln.params import HopperFwdParams, bwd_column_parts, params_layout
from flashkiln import families, hopper_family, tma
from flashkiln.bias import prepare_bias
from test_registry import FakeDriver, fake_target

REPO = Path(__file__).resolve().parent.parent
HOPPER = FAMILIES["hopper"]


def hopper(**overrides) -> VariantDescriptor:
    fields = dict(kernel="fwd", family="hopper", arch="sm_90a", dtype="bf16", d_qk=128, d_v=128, causal="none",
                  bias="none", deterministic=False, tile_m=128, tile_n=128, warps=12, stages=2)
    return VariantDescriptor(**{**fields, **overrides})


# -- specs and tunings ---------------------------------------------------------------------------

def test_default_hopper_specs_cover_the_forward_contract():
    # First tunings only (a variant's others are chosen per call by shape).
    variants = [v.descriptor for v in load_variants(REPO / "specs")
                if v.descriptor.family == "hopper" and v.relative_speed == 1 and v.descriptor.kernel == "fwd"]
    assert {d.arch for d in variants} == {"sm_90a"}
    assert {(d.d_qk, d.d_v) for d in variants} == {(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)}
    assert {d.causal for d in variants} == {"none", "bottom_right"}  # bottom_right runs top-left calls too
    assert {d.dtype for d in variants} == {"fp16", "bf16"}
    assert all(not HOPPER.functional_errors(d) and not HOPPER.tuning_errors(d) for d in variants)


def test_default_hopper_specs_cover_the_backward_contract():
    variants = [v.descriptor for v in load_variants(REPO / "specs")
                if v.descriptor.family == "hopper" and v.descriptor.kernel != "fwd"]
    main = [d for d in variants if d.kernel == "bwd"]
    assert {(d.d_qk, d.d_v) for d in main} == {(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)}
    assert {d.bias for d in main if d.d_qk == 96} == {"none", "additive"}  # d 96 in 64-byte swizzled boxes
    # d 256 (the consumers split columns): a bias with dBias, windows and caps (Gemma 2 and 3).
    assert {(d.bias, d.bias_grad) for d in main if d.d_qk == 256} == {("none", False), ("additive", False),
                                                                      ("additive", True)}
    assert {(d.window, d.softcap) for d in main if d.d_qk == 256} == {(False, False), (True, False), (False, True),
                                                                      (True, True)}
    assert {d.causal for d in main} == {"none", "bottom_right"}
    assert {d.bias for d in main} == {"none", "additive"}
    assert not any(d.deterministic or d.packed for d in main)  # set at run time
    assert {d.dtype for d in main} == {"fp16", "bf16"}
    post = {(d.dtype, d.d_qk) for d in variants if d.kernel == "bwd_post"}
    assert post == {(d.dtype, d.d_qk) for d in main}
    assert all(not HOPPER.functional_errors(d) and not HOPPER.tuning_errors(d) for d in variants)


@pytest.mark.parametrize("overrides, message", [
    ({"kernel": "bwd", "deterministic": True, "tile_m": 64}, "serves deterministic calls too"),
    ({"kernel": "bwd", "packed": True, "tile_m": 64}, "sequence bounds at run time"),
    ({"kernel": "bwd", "d_qk": 192, "d_v": 192, "tile_m": 64}, "head dims 64, 96, 128"),
    ({"kernel": "bwd", "d_qk": 128, "d_v": 64, "tile_m": 64}, "192/128 and 256"),
    ({"kernel": "bwd_post", "causal": "bottom_right", "tile_m": 64}, "does not mask"),
    ({"kernel": "bwd_pre"}, "the hopper family has only"),
    ({"arch": "sm_80"}, "sm_90a only"),
    ({"d_qk": 128, "d_v": 256}, "staged in Q"),
])
def test_functional_errors(overrides, message):
    errors = HOPPER.functional_errors(hopper(**overrides))
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("overrides, message", [
    ({"warps": 8}, "needs 12"),
    ({"tile_m": 96}, "64, 128 or 192"),
    ({"tile_n": 72}, "multiple of 16"),
    ({"stages": 1}, "at least 2"),
    ({"d_qk": 256, "d_v": 256, "tile_n": 128, "stages": 3}, "bytes of shared memory"),
    ({"bias": "additive", "tile_n": 80}, "multiple of 64"),
])
def test_tuning_errors(overrides, message):
    errors = HOPPER.tuning_errors(hopper(**overrides))
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("overrides, message", [
    ({"d_qk": 128, "d_v": 128, "tile_m": 128}, "one 64-column dQ part"),
    ({"d_qk": 64, "d_v": 64, "tile_m": 192, "warps": 12}, "one or two 64-row"),
    ({"d_qk": 64, "d_v": 64, "tile_m": 64, "tile_n": 64}, "128 keys per CTA"),
    ({"d_qk": 64, "d_v": 64, "tile_m": 128, "bias": "additive", "stages": 3}, "bytes of shared memory"),
    ({"d_qk": 128, "d_v": 128, "tile_m": 64, "bias": "additive", "stages": 3}, "bytes of shared memory"),
    ({"d_qk": 256, "d_v": 256, "tile_m": 64, "tile_n": 128}, "64 keys per CTA at d_qk=256"),
    ({"d_qk": 256, "d_v": 256, "tile_m": 64, "tile_n": 64, "stages": 2}, "one Q/dO stage"),
    ({"d_qk": 256, "d_v": 256, "tile_m": 128, "tile_n": 64, "stages": 1}, "one 64-column dQ part"),
    ({"kernel": "bwd_post", "d_qk": 64, "d_v": 64, "tile_m": 128, "warps": 4, "stages": 1}, "64-row dQ tiles"),
    ({"kernel": "bwd_post", "tile_m": 64, "tile_n": 64, "warps": 4, "stages": 1}, "no key tiles"),
])
def test_backward_tuning_errors(overrides, message):
    errors = HOPPER.tuning_errors(hopper(**{"kernel": "bwd", **overrides}))
    assert any(message in e for e in errors), errors


def test_backward_query_tiles_per_head_dim():
    """128-row query tiles where a head dim is one dQ part (d 64, without a cap); 64 rows elsewhere."""
    tiles: dict[tuple, set[int]] = {}
    for d in (v.descriptor for v in load_variants(REPO / "specs")):
        if d.family == "hopper" and d.kernel == "bwd":
            tiles.setdefault((d.d_qk, d.bias, d.bias_grad, d.softcap), set()).add(d.tile_m)
    assert tiles == {(64, "none", False, False): {128}, (64, "additive", False, False): {128},
                     (64, "additive", True, False): {128}, (64, "none", False, True): {64},
                     **{(dim, "none", False, False): {64} for dim in (96, 128, 192, 256)},
                     **{(dim, "additive", grad, False): {64} for dim in (96, 128, 192, 256) for grad in (False, True)},
                     (128, "none", False, True): {64}, (256, "none", False, True): {64}}
    d64 = hopper(kernel="bwd", d_qk=64, d_v=64)
    assert not HOPPER.tuning_errors(d64)
    # K, V; two stages of Q and dO; two dS buffers; each warpgroup's 64-row dQ staging; stats and
    # barriers rounded to 1024 bytes; the alignment slack.
    assert HOPPER.smem_bytes(d64) == 2 * (2 * 128 * 64 + 4 * 128 * 64 + 2 * 128 * 128) + 4 * 2 * 64 * 64 + 4096 + 1008
    # d 256, split columns: 64 keys, one stage, a third 64 x 64 buffer (P^T), dQ staged in two
    # 128-column parts.
    d256 = hopper(kernel="bwd", d_qk=256, d_v=256, tile_m=64, tile_n=64, stages=1)
    assert not HOPPER.tuning_errors(d256)
    assert HOPPER.smem_bytes(d256) == 2 * (2 * 64 * 256 + 2 * 64 * 256 + 3 * 64 * 64) + 4 * 2 * 64 * 128 + 2048 + 1008
    # d 192 / 128, split columns too: K and Q of 192 columns, V and dO of 128, dQ in two 96-column parts.
    d192 = hopper(kernel="bwd", d_qk=192, d_v=128, tile_m=64, tile_n=64, stages=1)
    assert not HOPPER.tuning_errors(d192) and HOPPER.splits_columns(d192)
    assert HOPPER.smem_bytes(d192) == 2 * (64 * 320 + 64 * 320 + 3 * 64 * 64) + 4 * 2 * 64 * 96 + 2048 + 1008
    # With a bias, split by keys: dS goes in the two stages' bias tiles, and a row sum per consumer
    # warp and row stays of its buffers; 128-row tiles then fit at d 64.
    biased = hopper(kernel="bwd", d_qk=64, d_v=64, bias="additive")
    assert not HOPPER.tuning_errors(biased)
    assert HOPPER.smem_bytes(biased) == (2 * (2 * 128 * 64 + 4 * 128 * 64) + 4 * 8 * 128 + 4 * 2 * 64 * 64 + 4096
                                         + 2 * 2 * 128 * 128 + 1008)


def test_smem_formula():
    d = hopper()  # 128 x 128: O gets its own buffer beside Q and the K/V ring
    assert HOPPER.own_o_buffer(d)
    assert HOPPER.smem_bytes(d) == 2 * (2 * 128 * 128 + 2 * 128 * 256) + 1024 + 1008
    assert HOPPER.threads(d) == 384
    wide = hopper(tile_n=176)  # no room for it: O leaves through Q's buffer
    assert not HOPPER.own_o_buffer(wide)
    assert HOPPER.smem_bytes(wide) == 2 * (128 * 128 + 2 * 176 * 256) + 1024 + 1008
    biased = hopper(bias="additive")  # a bias tile per stage, and a barrier block of its own
    assert not HOPPER.own_o_buffer(biased)
    assert HOPPER.smem_bytes(biased) == 2 * (128 * 128 + 2 * 128 * 256 + 2 * 128 * 128) + 2 * 1024 + 1008


def test_q_slots_only_with_three_consumer_warpgroups():
    """Two Q slots (the next tile's Q a tile ahead) where three consumers leave room beside O's
    own buffer; two consumers keep one, though d 128 at 128 x 128 would fit a second (measured
    slower, docs/perf.md v11)."""
    d64 = hopper(d_qk=64, d_v=64, tile_m=192, warps=16, stages=3)
    assert HOPPER.q_slots(d64) == 2
    assert HOPPER.smem_bytes(d64) == 2 * (2 * 192 * 64 + 3 * 128 * 128 + 192 * 64) + 1024 + 1008
    assert HOPPER.q_slots(hopper()) == 1
    assert HOPPER.q_slots(hopper(d_qk=64, d_v=64, stages=3)) == 1
    assert HOPPER.q_slots(hopper(d_qk=64, d_v=64, tile_m=192, warps=16, stages=2, bias="additive")) == 1


def test_default_specs_give_biased_variants_their_own_tiles():
    # First tunings only (a variant's others are chosen per call by shape).
    variants = [v.descriptor for v in load_variants(REPO / "specs")
                if v.descriptor.family == "hopper" and v.relative_speed == 1 and v.descriptor.kernel == "fwd"]
    biased = {d.d_qk: d.tile_n for d in variants if d.bias == "additive"}
    plain = {d.d_qk: d.tile_n for d in variants if d.bias == "none"}
    assert biased == {64: 128, 96: 128, 128: 128, 192: 64, 256: 64}
    assert plain == {64: 128, 96: 128, 128: 160, 192: 128, 256: 80}


# -- parameter block -----------------------------------------------------------------------------

def test_params_block_keeps_tensor_maps_64_byte_aligned():
    layout = params_layout("fwd", "hopper")
    assert layout.cpp_type == "flashkiln::HopperFwdParams"
    assert layout.size % 64 == 0 and layout.size == ctypes.sizeof(HopperFwdParams)
    maps = [f for f in layout.fields if f.name.startswith("tma_")]
    assert [f.offset for f in maps] == [0, 128, 256, 384, 512] and all(f.size == 128 and f.is_aggregate for f in maps)
    assert params_layout("fwd", "hopper").digest != params_layout("fwd").digest


def test_rendered_unit_checks_the_hopper_params_abi():
    source = render(hopper())
    assert "using Params = flashkiln::HopperFwdParams;" in source
    assert "{1},  // tma_q" in source  # aggregates are probed with braces (no brace elision)
    assert "flashkiln::hopper::FwdTraits<" in source and "__launch_bounds__(384, 1)" in source


@pytest.mark.nvrtc
def test_compiled_kernel_uses_tma_and_wgmma(tmp_path, build_cache):
    """The real toolchain: the d=128 causal variants, plain, windowed, biased or both, have HGMMA, TMA loads
    and stores, setmaxnreg, and no local memory in the consumers' code (the producer, at 24
    registers, may spill a little)."""
    from flashkiln.generator import build
    from flashkiln.generator.sass import disassemble, opcode_counts

    specs = tmp_path / "specs"
    (specs / "tuning").mkdir(parents=True)
    (specs / "hopper.yaml").write_text((REPO / "specs" / "hopper.yaml").read_text())
    for tuning in (REPO / "specs" / "tuning").glob("hopper*.yaml"):
        (specs / "tuning" / tuning.name).write_text(tuning.read_text())
    # Dense kernels only: the packed ones' consumers hold their sequence's bounds too, and spill a
    # little (docs/perf.md, v14); so do the softcapped ones at d 128 (2-3 loads, v22).
    selection = build.Selection(r"fwd_hopper_sm90a_bf16_d128_causal-br_", "packed|softcap")
    manifest = build.generate(specs, tmp_path / "out", workers=1, selection=selection, cache_dir=build_cache,
                              progress=False, report=False)
    # the default tuning and the second (128 keys), each with and without a window, and the biased
    # one with and without a window
    assert sorted(("window" in e.name, "bias-additive" in e.name) for e in manifest.kernels) == [
        (False, False), (False, False), (False, True), (True, False), (True, False), (True, True)]
    for entry in manifest.kernels:
        assert entry.threads == 384
        sass = disassemble(manifest.directory / entry.cubin)
        sass = sass[sass.index(f"Function : {entry.symbol}"):]  # a unit's cubin holds several
        ops = opcode_counts(sass)
        assert ops["HGMMA"] > 0 and ops["UTMALDG"] > 0 and ops["UTMASTG"] > 0 and ops["USETMAXREG"] > 0, ops
        assert ops["HMMA"] == 0, ops
        # ptxas lays the consumer branch (after the register increase) out before the producer's.
        consumers = sass[sass.index("USETMAXREG.TRY_ALLOC"):sass.index("USETMAXREG.DEALLOC")]
        assert "HGMMA" in consumers and "LDL" not in consumers and "STL" not in consumers, entry.name


# -- tensor maps ----------------------------------------------------------------------------------

def test_tensor_map_shape_of_bhsd_and_bshd_tensors():
    t = torch.empty(2, 3, 100, 128, dtype=torch.bfloat16)
    shape = tma.tensor_map_shape(t, 128)
    assert shape.dims == (128, 100, 3, 2) and shape.strides == (256, 256 * 100, 256 * 300)
    assert shape.box == (64, 128, 1, 1)
    bshd = torch.empty(2, 100, 3, 64, dtype=torch.float16).transpose(1, 2)
    assert tma.tensor_map_shape(bshd, 64).strides == (3 * 128, 128, 100 * 3 * 128)


def test_tensor_map_boxes_are_one_swizzle_atom_of_the_head_dim():
    # 128-byte boxes where the head dim is a multiple of 64, 64-byte ones at d 96; a bias's keys
    # (not a head dim) in 128-byte boxes, however many.
    box = lambda d, **kw: tma.tensor_map_shape(torch.empty(1, 2, 100, d, dtype=torch.float16), 64, **kw).box  # noqa: E731
    assert [box(d)[0] for d in (64, 96, 128, 192, 256)] == [64, 32, 64, 64, 64]
    assert box(96, whole_boxes=False)[0] == 64 and box(72, whole_boxes=False) == (64, 64, 1, 1)
    # Split between the backward's two warpgroups (tile_n 64): whole boxes per warpgroup, so
    # d 192's 96 columns each take 64-byte boxes.
    assert [box(d, parts=2)[0] for d in (128, 192, 256)] == [64, 32, 64]
    assert [bwd_column_parts(tile_n) for tile_n in (64, 128)] == [2, 1]


def test_tensor_map_ignores_strides_of_unit_dims():
    t = torch.empty(1, 1, 100, 64, dtype=torch.bfloat16).as_strided((1, 1, 100, 64), (0, 3, 64, 1))
    assert tma.tensor_map_shape(t, 64).strides == (128, 128 * 100, 128 * 100)


@pytest.mark.parametrize("error, raised, message", [
    ("CUDA_ERROR_INVALID_VALUE", UnsupportedError, "cuTensorMapEncodeTiled refused TensorMapShape"),
    ("CUDA_ERROR_INVALID_CONTEXT", CudaError, "cuTensorMapEncodeTiled of .* failed: CUDA_ERROR_INVALID_CONTEXT"),
])
def test_only_a_map_the_driver_finds_invalid_sends_auto_to_another_family(monkeypatch, error, raised, message):
    """The driver's refusal of a shape is UnsupportedError (auto tries the next family); any other
    failure, such as no current context, is the driver's CudaError, never a quiet fallback."""
    from cuda.bindings import driver as cu

    code = getattr(cu.CUresult, error)
    monkeypatch.setattr(cu, "cuTensorMapEncodeTiled", lambda *args: (code, None))
    monkeypatch.setattr(cu, "cuGetErrorName", lambda err: (cu.CUresult.CUDA_SUCCESS, error.encode()))
    monkeypatch.setattr(cu, "cuGetErrorString", lambda err: (cu.CUresult.CUDA_SUCCESS, b"the driver's text"))
    tma._encoded.cache_clear()
    with pytest.raises(raised, match=message):
        tma.encode(torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16), 64)


@pytest.mark.parametrize("make", [
    lambda: torch.empty(2, 3, 100, 80, dtype=torch.bfloat16),                           # d not in 32-wide boxes
    lambda: torch.empty(2, 1, 100, 64, dtype=torch.bfloat16).expand(2, 4, 100, 64),     # broadcast heads
    lambda: torch.empty(2, 3, 100, 128, dtype=torch.bfloat16)[..., ::2],                 # strided head dim
])
def test_tensor_maps_refuse_what_tma_cannot_address(make):
    with pytest.raises(UnsupportedError):
        tma.tensor_map_shape(make(), 64)


@pytest.mark.parametrize("shape, steps, rows", [
    ((2, 3, 100, 70), (1, 1, 1), 128),   # full; 70 keys: not whole 64-key boxes, which a bias need not be
    ((1, 3, 100, 70), (1, 1, 0), 128),   # broadcast over the batch
    ((2, 1, 100, 70), (1, 0, 1), 128),   # ... over heads
    ((1, 1, 100, 70), (1, 0, 0), 128),
    ((2, 1, 1, 70), (0, 0, 1), 1),       # a key-padding mask: one row, read for every query
])
def test_bias_maps_read_broadcast_dims_at_coordinate_0(shape, steps, rows):
    q = torch.empty(2, 3, 100, 64, dtype=torch.bfloat16)
    kernel_bias = prepare_bias(torch.randn(shape, dtype=torch.bfloat16), (2, 3, 100, 70), q)
    view, got_steps = tma.bias_view(kernel_bias.tensor)
    assert got_steps == steps
    map_shape = tma.tensor_map_shape(view, 128 if steps[0] else 1, whole_boxes=False)
    assert map_shape.dims == (70, shape[2], shape[1], shape[0]) and map_shape.box == (64, rows, 1, 1)
    if steps[0]:
        assert map_shape.strides[0] == 72 * 2  # rows padded to whole 16-byte pieces (runtime/bias.py)


PLANE = 100 * 70 * 2  # bytes of one (S_q, S_k) = (100, 70) bf16 plane


@pytest.mark.parametrize("shape, batch, l2_bytes, expected", [
    ((1, 1, 100, 70), 2, PLANE - 1, "heads"),      # shared across heads, its plane past L2
    ((2, 1, 100, 70), 2, PLANE - 1, "heads"),
    ((1, 1, 100, 70), 2, PLANE, "query"),          # the plane fits in L2
    ((2, 1, 1, 70), 2, 70 * 2 - 1, "heads"),       # a key-padding row is its plane
    ((2, 1, 1, 70), 2, PLANE - 1, "query"),
    ((1, 3, 100, 70), 2, 3 * PLANE - 1, "batch"),  # shared across the batch: all its heads past L2
    ((1, 3, 100, 70), 2, 3 * PLANE, "query"),
    ((1, 3, 100, 70), 1, 1, "query"),              # one batch entry: nothing to share
    ((2, 3, 100, 70), 2, 1, "query"),              # a full bias shares nothing
])
def test_tile_order_puts_a_broadcast_dim_innermost_where_l2_cannot_hold_the_bias(shape, batch, l2_bytes, expected):
    q = torch.empty(batch, 3, 100, 64, dtype=torch.bfloat16)
    kernel_bias = prepare_bias(torch.randn(shape, dtype=torch.bfloat16), (batch, 3, 100, 70), q)
    bias_map = tma.BiasMap(tma.TmaDescriptor(), *tma.bias_view(kernel_bias.tensor)[1])
    orders = {"query": hopper_family.QUERY_TILES_INNER, "heads": hopper_family.HEADS_INNER,
              "batch": hopper_family.BATCH_INNER}
    assert hopper_family.tile_order(kernel_bias, bias_map, batch, l2_bytes) == orders[expected]
    assert hopper_family.tile_order(None, tma.BiasMap.none(), batch, 0) == hopper_family.QUERY_TILES_INNER


# -- family selection (flashkiln.families) ----------------------------------------------------------

class FakeRegistry:
    driver = FakeDriver()

    def __init__(self, has: bool):
        self._has = has

    def has(self, request, capability) -> bool:
        return self._has


class FakeCall:
    causal = "none"
    bias = None
    bias_grad = False

    def request(self, family: str) -> dict:
        return {"family": family}

    def kernel_request(self, kernel: str, family: str, **fields) -> dict:
        return {"family": family}


@pytest.fixture
def planned(monkeypatch):
    """Fake planners in the family table: each records its family's name; hopper's raises
    UnsupportedError while `planned.refuse` is set (TMA cannot address the call)."""
    calls: list = []

    def planner(name):
        def plan(call, target, registry, scratch):
            if name == "hopper" and getattr(calls, "refuse", False):
                raise UnsupportedError("TMA needs a 16-byte aligned base address")
            calls.append(name)
            return name
        return plan

    class Calls(list):
        refuse = False

    calls = Calls()
    for name, family in list(families.FAMILIES.items()):
        monkeypatch.setitem(families.FAMILIES, name, dataclasses.replace(
            family, planners={direction: planner(name) for direction in family.planners}))
    return calls


def choose(direction, backend, capability, has=True):
    family, result, _ = families.plan(direction, FakeCall(), backend, fake_target(capability), FakeRegistry(has),
                                      torch.device("cpu"))
    assert family == result
    return family


@pytest.mark.parametrize("capability, has, expected", [
    ((9, 0), True, "hopper"),
    ((9, 0), False, "portable"),   # variant not generated (the request names bias, causal, ...)
    ((8, 0), True, "portable"),
])
def test_auto_prefers_hopper_where_it_can_run(planned, capability, has, expected):
    assert choose("forward", None, capability, has) == expected


def test_auto_falls_back_where_hopper_cannot_address_the_call(planned):
    planned.refuse = True
    assert choose("forward", None, (9, 0)) == "portable"


def test_explicit_backends(planned):
    assert choose("forward", "portable", (9, 0)) == "portable"
    assert choose("forward", "hopper", (9, 0), has=False) == "hopper"  # its lookup names what is missing
    with pytest.raises(UnsupportedError, match="compute capability 9.0"):
        choose("forward", "hopper", (8, 0))
    with pytest.raises(InvalidInputError):
        choose("forward", "cudnn", (9, 0))
    planned.refuse = True
    with pytest.raises(UnsupportedError, match="16-byte"):
        choose("forward", "hopper", (9, 0))


def test_the_backward_dispatches_through_the_same_table(planned):
    assert choose("backward", None, (9, 0)) == "hopper"
    assert choose("backward", None, (9, 0), has=False) == "portable"
    assert choose("backward", None, (8, 0)) == "portable"
    assert choose("backward", "hopper", (9, 0)) == "hopper"
    planned.refuse = True
    assert choose("backward", None, (9, 0)) == "portable"
    with pytest.raises(UnsupportedError, match="16-byte"):
        choose("backward", "hopper", (9, 0))


def _backward_call(causal: str = "none", deterministic: bool = False, bias_shape: tuple | None = None,
                   hkv: int = 2, d: int = 128, batch: int = 1, **extra):
    """A (batch, 2, 64, d) bf16 CPU call (k and v with `hkv` heads) for the planners (they refuse or
    look up before any launch)."""
    from flashkiln.calls import BackwardCall

    q, out, dout = (torch.zeros(batch, 2, 64, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.zeros(batch, hkv, 64, d, dtype=torch.bfloat16) for _ in range(2))
    if bias_shape is not None:
        extra["bias"] = prepare_bias(torch.zeros(bias_shape, dtype=torch.bfloat16), (batch, 2, 64, 64), q)
    return BackwardCall(dout, q, k, v, out, torch.zeros(batch, 2, 64), q, k, v, causal, 0.1, deterministic, **extra)


class _KernelsAt64x128:
    """A registry for the backward planners: every kernel they ask for, at 64 x 128 tiles, and
    bwd_dbias only `with_dbias_kernel`."""

    def __init__(self, with_dbias_kernel: bool):
        self.with_dbias_kernel = with_dbias_kernel

    def has(self, request, capability):
        return self.with_dbias_kernel or request["kernel"] != "bwd_dbias"

    def find(self, request, capability, smem_limit=None):
        assert self.has(request, capability)
        return SimpleNamespace(descriptor={"tile_m": 64, "tile_n": 128, **request})


def _plan_hopper_backward(call, registry=None):
    return hopper_family.plan_backward(call, fake_target((9, 0)), registry, ScratchSet(call.q.device))


@pytest.mark.parametrize("deterministic, d, route", [(False, 128, "atomic"), (True, 128, "ordered"),
                                                     (False, 256, "atomic"), (True, 256, "ordered")])
def test_a_biased_hopper_backward_orders_dq_when_deterministic(monkeypatch, deterministic, d, route):
    from flashkiln.dq_routes import ROUTE_ENV

    # Key-constant: dBias in closed form.
    call = _backward_call(deterministic=deterministic, bias_shape=(1, 1, 64, 1), bias_grad=True, d=d)
    assert families.FAMILIES["hopper"].request("backward", call)["bias"] == "additive"
    # The portable family's only biased kernels are its deterministic ones.
    assert families.FAMILIES["portable"].request("backward", call)["deterministic"] is True
    monkeypatch.setenv(ROUTE_ENV, "workspace")
    with pytest.raises(UnsupportedError, match=f"takes the {route} route"):
        _plan_hopper_backward(call)


@pytest.mark.parametrize("d, causal, bias_shape, route", [
    (256, "none", (1, 2, 64, 64), "ordered"),  # a full bias's dS stored as dBias, above d_qk 128
    (128, "none", (1, 2, 64, 64), "atomic"),
    (256, "bottom_right", (1, 2, 64, 64), "atomic"),
    (256, "none", (1, 1, 64, 64), "atomic"),  # shared by heads: reduced in the kernel, not stored
])
def test_stored_dbias_above_d_128_orders_dq_without_a_causal_mask(monkeypatch, d, causal, bias_shape, route):
    from flashkiln.dq_routes import ROUTE_ENV

    call = _backward_call(causal, bias_shape=bias_shape, bias_grad=True, d=d)
    assert hopper_family.ordered(call) is (route == "ordered")
    monkeypatch.setenv(ROUTE_ENV, "workspace")
    with pytest.raises(UnsupportedError, match=f"takes the {route} route"):
        _plan_hopper_backward(call)


def test_one_hopper_backward_kernel_serves_deterministic_calls():
    # The family table asks for the same main kernel either way; the portable family has a
    # deterministic variant of its own.
    call = _backward_call("top_left", deterministic=True)
    hopper_request = families.FAMILIES["hopper"].request("backward", call)
    assert hopper_request == _backward_call("top_left").request("hopper")
    assert hopper_request["deterministic"] is False and hopper_request["causal"] == "bottom_right"
    assert families.FAMILIES["portable"].request("backward", call)["deterministic"] is True


@pytest.mark.parametrize("deterministic, forced, allowed", [
    (False, "atomic", True), (False, "ordered", False), (False, "workspace", False),
    (True, "ordered", True), (True, "workspace", False),
])
def test_the_hopper_backward_takes_only_its_route(monkeypatch, deterministic, forced, allowed):
    from flashkiln.dq_routes import ROUTE_ENV

    monkeypatch.setenv(ROUTE_ENV, forced)
    call = _backward_call("top_left", deterministic)

    class LookedUp(Exception):
        pass

    class Registry:  # past the route check, the planner looks its kernels up
        def find(self, request, capability, smem_limit=None):
            raise LookedUp

    plan = lambda: _plan_hopper_backward(call, Registry())
    if allowed:
        with pytest.raises(LookedUp):
            plan()
    else:
        with pytest.raises(UnsupportedError, match=f"{ROUTE_ENV}={forced}: the hopper backward takes the "
                                                   f"{'ordered' if deterministic else 'atomic'} route"):
            plan()


@pytest.mark.parametrize("kw, key_tiles, staggered", [
    ({"deterministic": True}, 66, True),
    ({"deterministic": True}, 67, False),  # over half of the fake H200's 132 multiprocessors
    ({}, 8, False),  # no dQ turns
    ({"deterministic": True, "causal": "bottom_right"}, 8, False),  # key tiles see different query tiles
    ({"deterministic": True, "window": (16, 16)}, 8, False),
    ({"deterministic": True, "bias_shape": (1, 1, 64, 64)}, 8, False),  # its dBias turns keep the plain order
])
def test_a_deterministic_backward_staggers_its_sweeps_only_where_every_key_tile_runs_at_once(kw, key_tiles,
                                                                                            staggered):
    call = _backward_call(**kw)
    assert hopper_family.staggered_sweep(call, key_tiles, fake_target((9, 0))) is staggered


@pytest.mark.parametrize("hkv, deterministic, accum_heads", [(1, False, 1), (1, True, 2), (2, False, None)])
def test_a_gqa_backward_adds_into_sums_per_kv_head_unless_deterministic(monkeypatch, hkv, deterministic,
                                                                        accum_heads):
    from types import SimpleNamespace

    class Registry:
        def find(self, request, capability, smem_limit=None):
            return SimpleNamespace(descriptor={"tile_m": 64, "tile_n": 128})

    monkeypatch.setattr(tma, "_encoded", lambda shape, dtype: (0,) * 16)  # no driver here
    call = _backward_call(deterministic=deterministic, hkv=hkv)
    scratch = ScratchSet(call.q.device)
    main = hopper_family.plan_backward(call, fake_target((9, 0)), Registry(), scratch).launches[1].params
    dk_accum, dv_accum = scratch.tensors["dk_accum"], scratch.tensors["dv_accum"]
    if accum_heads is None:  # not GQA
        assert dk_accum is None and dv_accum is None and main.dk_accum == 0 and main.dkv_sums == 0
        return
    assert dk_accum.shape == dv_accum.shape == (1, accum_heads, 64, 128) and dk_accum.dtype == torch.float32
    assert main.dk_accum == dk_accum.data_ptr() and main.dv_accum == dv_accum.data_ptr()
    # Sums are added into, so they start at zero; per-query-head rows are written whole.
    assert main.dkv_sums == (accum_heads == hkv)
    assert [s.zeroed for s in scratch.specs if s.role in ("dk_accum", "dv_accum")] == [accum_heads == hkv] * 2


@pytest.mark.parametrize("bias_shape, d, summed_per_tile", [
    ((1, 2, 64, 64), 128, True),  # shared by batch entries alone: bwd_dbias at every head dim it has
    ((1, 1, 64, 64), 64, True),  # shared by heads: bwd_dbias at d 64
    ((1, 1, 64, 64), 128, False),  # ... above it, the main kernel's in-place sum
    ((2, 1, 64, 64), 96, False),
])
def test_bwd_dbias_takes_the_shared_biases_it_measured_faster_for(bias_shape, d, summed_per_tile):
    from types import SimpleNamespace

    class Registry:
        def has(self, request, capability):
            return True

        def find(self, request, capability, smem_limit=None):
            return SimpleNamespace(descriptor=request)

    call = _backward_call(bias_shape=bias_shape, bias_grad=True, d=d, batch=2)
    assert (hopper_family.dbias_kernel(call, fake_target((9, 0)), Registry()) is not None) is summed_per_tile
    # Not for a full bias, a row-broadcast or key-constant one, or without dBias.
    for shape, grad in ((bias_shape, False), ((2, 2, 64, 64), True), ((1, 2, 1, 64), True), ((1, 2, 64, 1), True)):
        other = _backward_call(bias_shape=shape, bias_grad=grad, d=d, batch=2)
        assert hopper_family.dbias_kernel(other, fake_target((9, 0)), Registry()) is None


@pytest.mark.parametrize("tiles, key_tiles, members, sms, ctas", [
    (8192, 16, 2, 132, 131),  # a common factor (4) would give each CTA a quarter of the key tiles
    (8192, 63, 8, 132, 131),
    (8192, 7, 2, 132, 132),
    (100, 50, 2, 132, 99),  # fewer tiles than SMs
    (2, 1, 2, 132, 2),
    (5, 1, 2, 1, 1),
    (8192, 64, 32, 132, 8192),  # many members: a CTA per tile
])
def test_bwd_dbias_walks_tiles_of_few_members_with_a_cta_count_prime_to_the_key_tiles(tiles, key_tiles, members, sms,
                                                                                        ctas):
    target = dataclasses.replace(fake_target((9, 0)), multiprocessors=sms)
    assert hopper_family.dbias_ctas(tiles, key_tiles, members, target) == ctas


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("bias_shape, route_set", [
    ((2, 2, 64, 64), "ds_workspace"),  # full
    ((2, 2, 1, 64), "dbias_columns"), ((1, 1, 1, 64), "dbias_columns"),  # broadcast over rows
    ((1, 2, 64, 64), "dbias_sum"), ((2, 1, 64, 64), "dbias_sum"), ((1, 1, 64, 64), "dbias_sum"),  # shared
])
def test_a_dbias_kernel_gets_exactly_one_dbias_route(monkeypatch, bias_shape, route_set, deterministic):
    """A bias_grad kernel picks its consumers' dBias route from which of ds_workspace, dbias_columns
    and dbias_sum is set (hopper/bwd_mainloop.hpp, DbiasRoute), taking the shared sum when neither of
    the first two is: exactly one is set, the one for the bias's broadcast shape."""
    monkeypatch.setattr(tma, "_encoded", lambda shape, dtype: (0,) * 16)  # no driver here
    call = _backward_call(deterministic=deterministic, bias_shape=bias_shape, bias_grad=True, batch=2)
    registry = _KernelsAt64x128(with_dbias_kernel=False)  # a shared bias's dBias: the main kernel's sum
    launches = hopper_family.plan_backward(call, fake_target((9, 0)), registry, ScratchSet(call.q.device)).launches
    main = next(launch for launch in launches if launch.entry.descriptor["kernel"] == "bwd")
    assert main.entry.descriptor["bias_grad"] is True
    routes = ("ds_workspace", "dbias_columns", "dbias_sum")
    assert [route for route in routes if getattr(main.params, route) != 0] == [route_set]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("with_dbias_kernel", [False, True])
def test_a_shared_bias_dbias_is_summed_per_tile_or_in_the_main_kernel(monkeypatch, with_dbias_kernel, deterministic):
    """Where the registry has bwd_dbias, it gives a shared bias's dBias (after the main kernel,
    which then has no dBias of its own) into the bias's own planes; else the main kernel adds the
    members' dS into an fp32 sum, taking turns only when deterministic."""
    registry = _KernelsAt64x128(with_dbias_kernel)
    monkeypatch.setattr(tma, "_encoded", lambda shape, dtype: (0,) * 16)  # no driver here
    call = _backward_call(deterministic=deterministic, bias_shape=(1, 2, 64, 64), bias_grad=True, batch=2)
    scratch = ScratchSet(call.q.device)
    launches = hopper_family.plan_backward(call, fake_target((9, 0)), registry, scratch).launches
    main = launches[1]
    assert main.entry.descriptor["bias_grad"] is not with_dbias_kernel
    total, turns, planes = (scratch.tensors[r] for r in ("dbias_sum", "dbias_semaphore", "dbias_tiles"))
    if with_dbias_kernel:
        assert [launch.entry.descriptor["kernel"] for launch in launches] == ["bwd_pre", "bwd", "bwd_dbias",
                                                                               "bwd_post"]
        assert total is None and turns is None and main.params.dbias_sum == 0
        assert planes.shape == (1, 2, 64, 64) and planes.dtype == call.q.dtype
        # Persistent: a CTA per dBias tile (key tiles x query tiles x bias slices: its heads), at
        # most one per SM.
        assert launches[2].grid == (2, 1, 1)
        one_sm = dataclasses.replace(fake_target((9, 0)), multiprocessors=1)
        launches = hopper_family.plan_backward(call, one_sm, registry, ScratchSet(call.q.device)).launches
        assert launches[2].grid == (1, 1, 1)
        return
    assert planes is None and len(launches) == 3 and main.params.dbias_sum == total.data_ptr()
    if deterministic:
        assert turns.shape == (2, 1, 1) and turns.dtype == torch.int32 and main.params.dbias_semaphore == turns.data_ptr()
    else:
        assert turns is None and main.params.dbias_semaphore == 0
