"""A planned call's hit path on the CPU: the lean driver launch (a fake cuda.bindings module), the
launch loop, the plans' straight paths against their full ones (a fake driver), and the eager
autograd.Function's arguments (fake forward and backward)."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import inspect
import math
import struct
import types

import pytest
import torch

import flashkiln
from flashkiln import backward, families, forward, inputs, launch, ops
from flashkiln.calls import BackwardCall, ForwardCall
from flashkiln.driver import CudaDriver
from flashkiln.errors import CudaError
from flashkiln.launch import KernelLaunch, Scratch, load_kernels, run
from flashkiln.params import HopperFwdParams, params_layout
from flashkiln.registry import KernelRegistry
from flashkiln.varlen import PackedBatch
from test_backward_api import bwd_descriptor
from test_registry import FakeDriver, descriptor, fake_target, kernel_entry, write_manifest


# -- the lean launch, against a fake cuda.bindings.driver -----------------------------------------

class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_LAUNCH_FAILED = 719


class FakeCu(types.SimpleNamespace):
    """What CudaDriver calls of cuda.bindings.driver, recording launches and failing on demand."""

    def __init__(self):
        super().__init__(CUresult=CUresult, launches=[], built=[], error=CUresult.CUDA_SUCCESS, asked=[],
                         procs={b"cuLaunchKernel": 0x7000, b"cuTensorMapReplaceAddress": 0x7100},
                         CUdriverProcAddress_flags=types.SimpleNamespace(CU_GET_PROC_ADDRESS_LEGACY_STREAM=1))

    def cuGetProcAddress(self, symbol, version, flags):
        self.asked.append((symbol, version, flags))
        return CUresult.CUDA_SUCCESS, self.procs.get(symbol, 0), 0

    def cuInit(self, flags):
        return (CUresult.CUDA_SUCCESS,)

    def CUfunction(self, address):
        self.built.append(("function", address))
        return ("function", address)

    def CUstream(self, handle):
        self.built.append(("stream", handle))
        return ("stream", handle)

    def CUtensorMap(self, _ptr):
        return ("tensor map", _ptr)

    def cuLaunchKernel(self, *args):
        self.launches.append(args)
        return (self.error,)

    def cuTensorMapReplaceAddress(self, tensor_map, address):
        return (self.error,)

    def cuGetErrorName(self, err):
        return CUresult.CUDA_SUCCESS, err.name.encode()

    def cuGetErrorString(self, err):
        return CUresult.CUDA_SUCCESS, b"unspecified launch failure"


@pytest.fixture
def fake_cu(monkeypatch):
    import cuda.bindings

    cu = FakeCu()
    monkeypatch.setattr(cuda.bindings, "driver", cu)
    return cu


def test_a_launch_hands_cuLaunchKernel_its_arguments_and_builds_each_handle_once(fake_cu):
    driver = CudaDriver()
    params = HopperFwdParams(batch=3)
    for stream in (7, 7, 9):
        driver.launch(0x1230, (132, 2, 1), (384, 1, 1), 200_000, stream, params)
    assert fake_cu.built == [("function", 0x1230), ("stream", 7), ("stream", 9)]
    *head, kernel_params, extra = fake_cu.launches[-1]
    assert head == [("function", 0x1230), 132, 2, 1, 384, 1, 1, 200_000, ("stream", 9)] and extra == 0
    # kernelParams: one pointer, to the parameter block itself (its one by-value struct argument).
    assert struct.unpack("P", kernel_params) == (ctypes.addressof(params),)


@pytest.mark.parametrize("call, what", [
    (lambda d: d.launch(0x1230, (1, 1, 1), (128, 1, 1), 0, 7, HopperFwdParams()), "cuLaunchKernel"),
    (lambda d: d.replace_tensor_map_address(0x5000, 0x6000), "cuTensorMapReplaceAddress"),
])
def test_a_failed_per_call_driver_call_is_a_cuda_error_named_by_the_driver(fake_cu, call, what):
    driver = CudaDriver()
    fake_cu.error = CUresult.CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(CudaError, match=rf"^{what} failed: CUDA_ERROR_LAUNCH_FAILED \(unspecified launch failure\)$"):
        call(driver)


def test_the_native_entry_points_are_the_drivers_for_cuda_12_with_the_legacy_default_stream(fake_cu):
    driver = CudaDriver()
    assert driver.entry_points() == driver.entry_points() == (0x7000, 0x7100)  # asked for once
    assert fake_cu.asked == [(b"cuLaunchKernel", 12000, 1), (b"cuTensorMapReplaceAddress", 12000, 1)]
    del fake_cu.procs[b"cuTensorMapReplaceAddress"]
    with pytest.raises(CudaError, match="the driver has no cuTensorMapReplaceAddress of CUDA 12000"):
        CudaDriver().entry_points()


def test_a_failure_the_native_launch_reports_is_a_cuda_error_named_by_the_driver(fake_cu):
    with pytest.raises(CudaError, match=r"^cuLaunchKernel \(launch 1 of 3\) failed: CUDA_ERROR_LAUNCH_FAILED"):
        CudaDriver().raise_failure("cuLaunchKernel (launch 1 of 3)", 719)


# -- plans on the CPU, with a faked GPU ----------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """Device 0 current, stream 7: the torch calls launch.run makes (a CPU build has neither)."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHKILN_BACKWARD_ROUTE", raising=False)
    monkeypatch.delenv("FLASHKILN_BACKWARD_WORKSPACE_MIB", raising=False)
    variants = [descriptor(d=64, causal="none")] + [bwd_descriptor(k, d=64) for k in ("bwd", "bwd_pre", "bwd_post")]
    entries = [kernel_entry(d, params_layout=params_layout(d.kernel).digest) for d in variants]
    return KernelRegistry(write_manifest(tmp_path, entries), driver=FakeDriver())


def qkv(hq=2, hkv=2, s=16, d=64, bshd=False):
    def make(h):
        t = torch.randn(1, s, h, d, dtype=torch.bfloat16)
        return t.transpose(1, 2) if bshd else t.transpose(1, 2).contiguous()
    return make(hq), make(hkv), make(hkv)


def plan_fields(registry, launches, scratch, q, k, v) -> dict:
    target = fake_target()
    launches = tuple(launches)
    return dict(registry=registry, target=target, launches=launches, scratch=tuple(scratch.specs), causal="none",
                window=None, softcap=None, scale=0.125, scores=(*q.shape[:3], k.shape[2]), dims=(64, 64),
                kernels=load_kernels(registry, target, launches))


def forward_plan(registry, q, k, v) -> forward.ForwardPlan:
    """The portable plan plan_forward makes for q, k, v (which it would refuse on the CPU)."""
    call = ForwardCall(q, k, v, inputs.empty_in_memory_order(q, 64), torch.empty(q.shape[:3]), "none", 0.125)
    family, launches, scratch = families.plan("forward", call, "portable", fake_target(), registry, q.device)
    return forward.ForwardPlan(family=family, copies=(False,) * 3, fresh=forward.fresh_outputs(call.out, call.lse),
                               **plan_fields(registry, launches, scratch, q, k, v))


def backward_plan(registry, q, k, v) -> backward.BackwardPlan:
    """The portable plan plan_backward makes for q, k, v (which it would refuse on the CPU)."""
    out, lse = torch.randn_like(q), torch.randn(q.shape[:3])
    grads = [inputs.empty_gradient_like(t) for t in (q, k, v)]
    call = BackwardCall(torch.randn_like(q), q, k, v, out, lse, *grads, "none", 0.125, False)
    family, planned, scratch = families.plan("backward", call, "portable", fake_target(), registry, q.device)
    return backward.BackwardPlan(family=family, route=planned.route, deterministic=False, copies=False,
                                 grad_strides=tuple(g.stride() for g in grads), bias_grad=False, sink_grad=False,
                                 sink_parts=False, fresh=backward.fresh_gradients(grads),
                                 **plan_fields(registry, planned.launches, scratch, q, k, v))


def recorded_runs(monkeypatch, module) -> list[dict]:
    """The tensors by role that `module`'s plans hand launch.run from now on."""
    runs: list[dict] = []
    monkeypatch.setattr(module, "run", lambda plan, tensors: runs.append(dict(tensors)) or run(plan, tensors))
    return runs


def assert_same_roles(straight: dict, full: dict, outputs: tuple[str, ...], plan) -> None:
    """The same roles, the same input tensors, outputs (fresh in each path) of one layout, and the
    plan's scratch: tensors in the full path, addresses in the straight path's one block."""
    assert straight.keys() == full.keys()
    block = plan.scratch_block
    for spec, offset in block.offsets:
        address, tensor = straight[spec.role], full[spec.role]
        assert type(address) is int and address - offset == straight[block.offsets[0][0].role], spec.role
        assert (tensor.shape, tensor.dtype) == (spec.shape, spec.dtype), spec.role
    for role, tensor in straight.items():
        if role in (spec.role for spec in plan.scratch):
            continue
        if role in outputs or tensor is None or full[role] is None:
            assert (tensor is None) == (full[role] is None), role
            if tensor is not None:
                assert (tensor.shape, tensor.stride(), tensor.dtype) == (full[role].shape, full[role].stride(),
                                                                         full[role].dtype), role
        else:
            assert tensor is full[role], role


# -- the launch loop -----------------------------------------------------------------------------

def test_a_scratch_block_lays_out_every_role_apart_with_the_zeroed_ones_first_and_zeroed(monkeypatch):
    specs = (Scratch("delta", (2, 3, 7), torch.float32, False), Scratch("counter", (1,), torch.int32, True),
             Scratch("accum", (2, 3, 128, 64), torch.float32, False), Scratch("semaphore", (5, 3), torch.int32, True),
             Scratch("empty", (0,), torch.float32, True))
    block = launch.ScratchBlock.of(specs)
    assert [spec.role for spec, _ in block.offsets] == ["counter", "semaphore", "empty", "delta", "accum"]
    spans = [(offset, offset + math.prod(spec.shape) * spec.dtype.itemsize) for spec, offset in block.offsets]
    assert all(start % launch.SCRATCH_ALIGNMENT == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= block.nbytes and spans[2][1] <= block.zeroed_bytes <= spans[3][0]
    monkeypatch.setattr(torch, "empty", lambda size, **kw: torch.full((size,), 0xAB, **kw))  # poisoned memory
    memory = block.allocate(torch.device("cpu"))
    assert memory.numel() == block.nbytes and not memory[:block.zeroed_bytes].any()
    assert (memory[block.zeroed_bytes:] == 0xAB).all()
    counter_only = launch.ScratchBlock.of(specs[1:2])
    assert counter_only.nbytes == counter_only.zeroed_bytes == launch.SCRATCH_ALIGNMENT
    assert not counter_only.allocate(torch.device("cpu")).any()
    tensors = {"q": None}
    block.bind(memory, tensors)  # into the call's own dict, beside its tensors
    assert tensors == {"q": None, **{spec.role: memory.data_ptr() + offset for spec, offset in block.offsets}}


def test_launches_that_share_a_parameter_block_get_one_binding(registry, fake_gpu):
    q, k, v = qkv()
    plan = backward_plan(registry, q, k, v)
    assert len({id(launch.params) for launch in plan.launches}) == 1 < len(plan.launches)
    plan.run(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(q.shape[:3]), None, None, None, None,
             None, None, None)
    launched = registry.driver.named("launch")
    planned = [(kernel.handle, launch.grid, (launch.entry.threads, 1, 1), launch.entry.smem_bytes)
               for launch, kernel in zip(plan.launches, plan.kernels)]
    assert [c[1:5] for c in launched] == planned
    assert {c[5] for c in launched} == {7} and all(c[6] is launched[0][6] for c in launched)


def test_a_tensor_map_is_repointed_only_when_its_tensor_moved(registry, fake_gpu):
    q, k, v = qkv()
    moved = torch.randn_like(q)
    planned = {"tma_q": ("q", q.data_ptr()), "tma_k": ("k", k.data_ptr()), "tma_v": ("v", moved.data_ptr())}
    launch = KernelLaunch(registry.find({"kernel": "fwd", "family": "portable", "dtype": "bf16", "d_qk": 64,
                                         "d_v": 64, "causal": "none", "bias": "none", "deterministic": False},
                                        (9, 0)), (1, 1, 1), HopperFwdParams(),
                          tensor_maps=tuple((name, role, at) for name, (role, at) in planned.items()))
    params = launch.bound({"q": q, "k": k, "v": v}, registry.driver.replace_tensor_map_address)
    assert registry.driver.named("replace_tensor_map_address") == [
        ("replace_tensor_map_address", ctypes.addressof(params) + HopperFwdParams.tma_v.offset, v.data_ptr())]


# -- the forward's straight path -----------------------------------------------------------------

@pytest.mark.parametrize("case", ["bhsd", "bshd", "scratch"])
def test_the_straight_forward_launches_what_the_full_path_does(registry, fake_gpu, monkeypatch, case):
    q, k, v = qkv(bshd=case == "bshd")
    plan = forward_plan(registry, q, k, v)
    if case == "scratch":  # the hopper forward's tile counter, say
        plan = dataclasses.replace(plan, scratch=(Scratch("tile_counter", (1,), torch.int32, True),))
    runs = recorded_runs(monkeypatch, forward)
    straight = [plan.run(q, k, v, None, None, None) for _ in range(2)]
    full = plan._run(q, k, v, None, None, None, None, None)
    for out, lse in straight:
        for mine, theirs in ((out, full[0]), (lse, full[1])):
            assert (mine.shape, mine.stride(), mine.dtype, mine._base is None) == \
                (theirs.shape, theirs.stride(), theirs.dtype, theirs._base is None)
    assert runs[0]["o"] is straight[0][0] and runs[0]["lse"] is straight[0][1]
    assert_same_roles(runs[1], runs[2], outputs=("o", "lse"), plan=plan)
    assert len(registry.driver.named("launch")) == 3


def test_a_plan_without_fresh_outputs_takes_the_full_path(registry, monkeypatch):
    """plan_forward gives a plan fresh outputs only for a dense call without bias, sink, padded head
    dims, layout copies or given outputs: every other plan runs the full path."""
    q, k, v = qkv()
    plan = dataclasses.replace(forward_plan(registry, q, k, v), fresh=None)
    full = []
    monkeypatch.setattr(forward.ForwardPlan, "_run", lambda *a: full.append(a) or "full path")
    assert plan.run(q, k, v, None, None, None) == "full path" and len(full) == 1


def test_given_outputs_take_the_full_path(registry, fake_gpu, monkeypatch):
    q, k, v = qkv()
    plan = forward_plan(registry, q, k, v)
    full = []
    monkeypatch.setattr(forward.ForwardPlan, "_run", lambda *a: full.append(a) or "full path")
    assert plan.run(q, k, v, None, None, None, out=torch.empty_like(q)) == "full path"
    assert plan.run(q, k, v, None, None, None, lse=torch.empty(q.shape[:3])) == "full path"
    assert len(full) == 2


def test_a_cached_forward_plan_serves_attention_forward_straight(registry, fake_gpu, monkeypatch):
    q, k, v = qkv()
    plan = forward_plan(registry, q, k, v)
    forward.PLANS.put(forward._key(q, k, v, None, None, None, None, None, None, None, None, None), plan)
    monkeypatch.setattr(forward, "plan_forward", lambda *a: pytest.fail("a cached call planned"))
    out, lse = flashkiln.attention_forward(q, k, v)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert len(registry.driver.named("launch")) == 1


# -- the backward's straight path ----------------------------------------------------------------

def backward_arguments(q):
    return torch.randn_like(q), torch.randn_like(q), torch.randn(q.shape[:3])  # dout, out, lse


@pytest.mark.parametrize("with_dlse", [False, True])
def test_the_straight_backward_launches_what_the_full_path_does(registry, fake_gpu, monkeypatch, with_dlse):
    q, k, v = qkv()
    dout, out, lse = backward_arguments(q)
    dlse = torch.randn(q.shape[:3]) if with_dlse else None
    plan = backward_plan(registry, q, k, v)
    runs = recorded_runs(monkeypatch, backward)
    straight = plan.run(dout, q, k, v, out, lse, dlse, None, None, None, None, None, None)
    full = plan._run(dout, q, k, v, out, lse, dlse, None, None, None, None, None, None)
    assert len(straight) == len(full) == 3
    for mine, theirs in zip(straight, full):
        assert (mine.shape, mine.stride(), mine.dtype) == (theirs.shape, theirs.stride(), theirs.dtype)
    assert [runs[0][role] for role in ("dq", "dk", "dv")] == list(straight)
    assert_same_roles(runs[0], runs[1], outputs=("dq", "dk", "dv"), plan=plan)


def test_the_straight_backwards_gradients_are_allocations_of_their_own(registry, fake_gpu, monkeypatch):
    """dq, dk and dv, each a whole allocation of its own: through the custom op too, whose outputs
    torch requires to alias no input and no other output (torch.library.custom_op checks their
    storages on every call, and torch.compile's graphs rely on it), and so that a gradient kept
    (autograd's AccumulateGrad keeps the tensor itself as .grad) holds no memory but its own."""
    q, k, v = qkv()
    dout, out, lse = backward_arguments(q)
    plan = backward_plan(registry, q, k, v)
    monkeypatch.setattr(backward, "PLANS", backward.PlanCache())
    monkeypatch.setattr(backward, "plan_backward", lambda *a: plan)
    runs = recorded_runs(monkeypatch, backward)
    direct = flashkiln.attention_backward(dout, q, k, v, out, lse)
    through_op = ops.attention_backward_op(dout, q, k, v, out, lse, None, None, False, None, False, "none", 0.125,
                                           None)[:3]
    assert len(runs) == 2
    inputs_storage = {t.untyped_storage().data_ptr() for t in (q, k, v, out, dout, lse)}
    for grads, tensors in ((direct, runs[0]), (through_op, runs[1])):
        assert [tensors[role] for role in ("dq", "dk", "dv")] == list(grads)
        storages = [g.untyped_storage() for g in grads]
        assert len({s.data_ptr() for s in storages} | inputs_storage) == len(storages) + len(inputs_storage)
        for grad, storage in zip(grads, storages):
            assert (grad.data_ptr(), grad.numel() * grad.element_size()) == (storage.data_ptr(), storage.nbytes())
            for spec in plan.scratch:  # the scratch block lies outside every gradient
                assert not storage.data_ptr() <= tensors[spec.role] < storage.data_ptr() + storage.nbytes()


def test_the_eager_backward_plan_is_cached_on_the_forward_plan(registry, fake_gpu, monkeypatch):
    """backward_after plans as attention_backward does, once per forward plan and per what the
    backward adds to its key (dout's layout, deterministic, torch's flag)."""
    q, k, v = qkv()
    planned = []
    plan = backward_plan(registry, q, k, v)
    monkeypatch.setattr(backward, "PLANS", types.SimpleNamespace(get=lambda key: None, put=lambda key, plan: None))
    monkeypatch.setattr(backward, "plan_backward", lambda *args: planned.append(args) or plan)
    runs = recorded_runs(monkeypatch, backward)
    dout, out, lse = backward_arguments(q)
    first, second = forward_plan(registry, q, k, v), forward_plan(registry, q, k, v)

    def call(forward_plan, dout, deterministic=None):
        return backward.backward_after(forward_plan, dout, q, k, v, out, lse, causal=None, window_size=None,
                                       softcap=None, scale=0.125, deterministic=deterministic)

    grads = call(first, dout)
    call(first, torch.randn_like(dout))  # a hit: same layout
    assert len(planned) == 1 and len(runs) == 2 and [runs[0][r] for r in ("dq", "dk", "dv")] == list(grads)
    backward.attention_backward(dout, q, k, v, out, lse, scale=0.125)  # (its cache never hits here)
    assert planned[1] == planned[0]  # what attention_backward plans with the same arguments
    del planned[1]
    call(first, dout.transpose(1, 2).contiguous().transpose(1, 2))  # another dout layout
    call(first, dout, deterministic=False)  # False is not None
    call(second, dout)  # another forward plan
    with _deterministic_algorithms(True):  # torch's flag: read at planning
        call(first, dout)
    assert len(planned) == 5 and len(first.backward_plans) == 4 and len(second.backward_plans) == 1


def fills_of_straight_run(monkeypatch, deterministic: bool, make_plan, call) -> list[bool]:
    """torch's fill flag at each allocation of a straight run of the plan that make_plan() makes with
    deterministic algorithms on or off (call(plan) runs it); the flag is on before and after."""
    fills = []
    real_empty_strided, real_empty = torch.empty_strided, torch.empty

    def noting(allocate):
        return lambda *a, **kw: fills.append(torch.utils.deterministic.fill_uninitialized_memory) or allocate(*a, **kw)

    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    with _deterministic_algorithms(deterministic):
        plan = make_plan()
        monkeypatch.setattr(torch, "empty_strided", noting(real_empty_strided))
        monkeypatch.setattr(torch, "empty", noting(real_empty))
        call(plan)
    assert torch.utils.deterministic.fill_uninitialized_memory is True
    return fills


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_straight_backward_allocates_without_torchs_deterministic_fill(registry, fake_gpu, monkeypatch,
                                                                             deterministic):
    """Under deterministic algorithms torch fills fresh memory with NaN (a memset per buffer); the
    kernels write the gradients and scratch in full, so the straight path allocates them with the
    fill off. A plan made without deterministic algorithms (its key says so) skips the switch."""
    q, k, v = qkv()
    dout, out, lse = backward_arguments(q)
    fills = fills_of_straight_run(monkeypatch, deterministic, lambda: backward_plan(registry, q, k, v),
                                  lambda plan: plan.run(dout, q, k, v, out, lse, None, None, None, None, None, None,
                                                        None))
    assert fills == [not deterministic] * 4  # dq, dk, dv and the scratch block


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_straight_forward_allocates_without_torchs_deterministic_fill(registry, fake_gpu, monkeypatch,
                                                                            deterministic):
    """The forward's out and lse likewise (its kernels write every row, O = 0 and LSE = -inf where a
    row sees no key)."""
    q, k, v = qkv()
    allocations = 2 + bool(forward_plan(registry, q, k, v).scratch)  # out, lse (and the scratch block)
    fills = fills_of_straight_run(monkeypatch, deterministic, lambda: forward_plan(registry, q, k, v),
                                  lambda plan: plan.run(q, k, v, None, None, None))
    assert fills == [not deterministic] * allocations


def test_the_forward_plan_key_holds_torchs_deterministic_flag():
    """A plan made with deterministic algorithms off must not serve a call made with them on."""
    q, k, v = qkv()
    keys = []
    for on in (False, True):
        with _deterministic_algorithms(on):
            keys.append(forward._key(q, k, v, "none", None, None, None, None, None, None, None, None))
    assert keys[0] != keys[1]


class _deterministic_algorithms:  # noqa: N801 (a context manager)
    def __init__(self, on: bool):
        self.on = on

    def __enter__(self) -> None:
        self.before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(self.on)

    def __exit__(self, *exc: object) -> None:
        torch.use_deterministic_algorithms(self.before)


@pytest.mark.parametrize("case", ["no fresh gradients", "buffers"])
def test_backward_calls_that_need_more_than_the_launches_take_the_full_path(registry, monkeypatch, case):
    """plan_backward gives fresh gradients only to dense calls without bias, sink, padded head dims,
    layout copies, GQA sums or given buffers; a plan without them, or a call with buffers, runs
    the full path."""
    q, k, v = qkv()
    plan = backward_plan(registry, q, k, v)
    plan = dataclasses.replace(plan, fresh=None) if case == "no fresh gradients" else plan
    buffer = torch.empty_like(q) if case == "buffers" else None
    full = []
    monkeypatch.setattr(backward.BackwardPlan, "_run", lambda *a: full.append(a) or "full path")
    dout, out, lse = backward_arguments(q)
    assert plan.run(dout, q, k, v, out, lse, None, None, None, None, buffer, None, None) == "full path"
    assert len(full) == 1


# -- the eager autograd.Function and the compiled custom op -------------------------------------

def named_arguments(fn, *args, **kwargs) -> dict:
    """A call's arguments to fn by their names, however they were passed."""
    return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)


def fake_forward_plans(monkeypatch, seen: dict, lse_shape=lambda q: q.shape[:3]) -> None:
    """A fake of the plan lookup under the eager autograd.Function (ops.cached_plan): it records its
    arguments but q, k, v by name in seen["forward"] and returns a plan, seen["forward plan"], whose
    run gives zeros (out like q, lse of lse_shape(q))."""
    def cached_plan(q, k, v, *args, **kwargs):
        seen["forward"] = named_arguments(forward.cached_plan, q, k, v, *args, **kwargs)
        seen["forward plan"] = types.SimpleNamespace(
            run=lambda q, k, v, bias, sink, packed: (torch.zeros_like(q), torch.zeros(lse_shape(q))))
        return seen["forward plan"]

    monkeypatch.setattr(ops, "cached_plan", cached_plan)


def fake_gradients(seen: dict, dout, q, k, v, out, lse, **kwargs) -> tuple:
    """A backward that records its keyword arguments in seen["backward"]: gradients 1, 2 and 3 for
    q, k and v, then 4 for dbias and 5 for dsink where the call asks for them."""
    seen["backward"] = kwargs
    grads = tuple(torch.full_like(t, float(i)) for i, t in enumerate((q, k, v), start=1))
    extra = (torch.full_like(kwargs["bias"], 4.0),) if kwargs.get("bias_grad") else ()
    extra += (torch.full_like(kwargs["sink"], 5.0),) if kwargs.get("sink_grad") else ()
    return (*grads, *extra)


def recorded_eager_calls(monkeypatch) -> dict:
    """Fakes of what the eager ops call (fake_forward_plans; attention_backward and, for a dense call
    without bias or sink, backward_after with the forward's plan, through fake_gradients), which
    record their keyword arguments in the returned dict ("forward", "backward")."""
    seen = {}
    fake_forward_plans(monkeypatch, seen)

    def backward_after(plan, *args):
        assert plan is seen["forward plan"]
        seen["backward after the forward's plan"] = True
        named = named_arguments(backward.backward_after, plan, *args)
        return fake_gradients(seen, *(named.pop(t) for t in ("dout", "q", "k", "v", "out", "lse")),
                              **{name: value for name, value in named.items() if name != "forward_plan"})

    monkeypatch.setattr(ops, "attention_backward", lambda *args, **kwargs: fake_gradients(seen, *args, **kwargs))
    monkeypatch.setattr(ops, "backward_after", backward_after)
    return seen


@pytest.mark.parametrize("bias_grad", [False, True])
def test_the_eager_sdpa_passes_the_call_through_and_routes_each_gradient(monkeypatch, bias_grad):
    seen = recorded_eager_calls(monkeypatch)
    q, k, v = (t.requires_grad_() for t in qkv(s=8))
    bias = torch.zeros(8, 8, dtype=q.dtype, requires_grad=bias_grad)
    sink = torch.zeros(2, requires_grad=True)
    out = ops.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True, sink=sink, window_size=(4, 0),
                                           softcap=5.0, deterministic=True)
    out.backward(torch.ones_like(out))
    given = dict(causal="top_left", window_size=(4, 0), softcap=5.0, scale=0.125, packed=None)
    assert {name: seen["forward"][name] for name in given} == given
    assert seen["forward"]["bias"] is bias and seen["forward"]["sink"] is sink
    assert {name: seen["backward"][name] for name in given} == given
    assert "dlse" not in seen["backward"] and seen["backward"]["deterministic"] is True  # no LSE output
    assert (seen["backward"]["bias_grad"], seen["backward"]["sink_grad"]) == (bias_grad, True)
    assert [t.grad.unique().tolist() for t in (q, k, v, sink)] == [[1.0], [2.0], [3.0], [5.0]]
    assert (bias.grad is not None and bias.grad.unique().tolist() == [4.0]) if bias_grad else bias.grad is None


def test_the_eager_sdpa_without_bias_or_sink_passes_the_call_through(monkeypatch):
    """The dense call's backward (no optional tensors saved) takes the same settings and routes
    dq, dk, dv to q, k, v."""
    seen = recorded_eager_calls(monkeypatch)
    q, k, v = (t.requires_grad_() for t in qkv(s=8))
    out = ops.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(4, 0), softcap=5.0, scale=0.5,
                                           deterministic=False)
    out.backward(torch.ones_like(out))
    given = dict(causal="top_left", window_size=(4, 0), softcap=5.0, scale=0.5)
    assert {name: seen["forward"][name] for name in given} == given
    assert {name: seen["backward"][name] for name in given} == given
    assert seen["backward"]["deterministic"] is False and seen["backward after the forward's plan"]
    assert not {"bias", "sink", "bias_grad", "sink_grad", "dlse"} & {k for k, v in seen["backward"].items() if v}
    assert [t.grad.unique().tolist() for t in (q, k, v)] == [[1.0], [2.0], [3.0]]


@pytest.mark.parametrize("bias_grad, with_sink", [(False, False), (True, False), (False, True), (True, True)])
def test_the_eager_varlen_attention_routes_each_gradient_past_the_offsets(monkeypatch, bias_grad, with_sink):
    seen = {}
    fake_forward_plans(monkeypatch, seen, lse_shape=lambda q: (q.shape[1], q.shape[0]))
    monkeypatch.setattr(ops, "attention_backward", lambda *args, **kwargs: fake_gradients(seen, *args, **kwargs))
    q, k, v = (torch.randn(8, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    bias = torch.zeros(2, 2, 5, 5, dtype=q.dtype, requires_grad=bias_grad)
    sink = torch.zeros(2, requires_grad=True) if with_sink else None
    out = ops.varlen_attention(q, k, v, cu, cu, 5, 5, causal="bottom_right", bias=bias, sink=sink)
    out.backward(torch.ones_like(out))
    for direction in ("forward", "backward"):
        assert seen[direction]["packed"] == PackedBatch(cu, cu, 5, 5) and seen[direction]["bias"] is bias
        assert seen[direction]["sink"] is sink and seen[direction]["causal"] == "bottom_right"
    assert (seen["backward"]["bias_grad"], seen["backward"]["sink_grad"]) == (bias_grad, with_sink)
    assert [t.grad.unique().tolist() for t in (q, k, v)] == [[1.0], [2.0], [3.0]]
    assert bias.grad.unique().tolist() == [4.0] if bias_grad else bias.grad is None
    assert sink is None or sink.grad.unique().tolist() == [5.0]


@pytest.mark.parametrize("case", ["no input requires grad", "no_grad", "inference_mode", "only the sink", "only v"])
def test_the_eager_sdpa_skips_autograd_only_when_nothing_can_be_differentiated(monkeypatch, case):
    applied = []
    fake_forward_plans(monkeypatch, {})
    monkeypatch.setattr(ops._EagerAttention, "apply",
                        lambda *args: applied.append(args) or ops._EagerAttention.forward(types.SimpleNamespace(
                            set_materialize_grads=lambda _: None, save_for_backward=lambda *_: None), *args))
    q, k, v = qkv(s=8)
    sink = torch.zeros(2, requires_grad=case == "only the sink")
    v.requires_grad_(case == "only v")
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(case)
    with context() if context else contextlib.nullcontext():
        q.requires_grad_(case in ("no_grad", "inference_mode"))
        out = ops.scaled_dot_product_attention(q, k, v, sink=sink)
    differentiable = case in ("only the sink", "only v")
    assert len(applied) == differentiable and out.shape == q.shape


def test_the_eager_varlen_attention_passes_the_packed_batch(monkeypatch):
    seen = {}
    fake_forward_plans(monkeypatch, seen, lse_shape=lambda q: (q.shape[1], q.shape[0]))
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    ops.varlen_attention(q, q, q, cu, cu, 5, 5, causal="bottom_right", window_size=(2, 0))
    seen = seen["forward"]
    assert seen["packed"] == PackedBatch(cu, cu, 5, 5) and seen["causal"] == "bottom_right"
    assert seen["window_size"] == (2, 0) and seen["softcap"] == 0.0 and seen["scale"] == 0.125


def test_torch_compile_traces_the_custom_op_with_its_arguments():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v = qkv(s=8)
    compiled = torch.compile(flashkiln.scaled_dot_product_attention, backend=backend, fullgraph=True)
    try:
        with pytest.raises(flashkiln.InvalidInputError, match="inputs must be CUDA tensors"):
            compiled(q, k, v, is_causal=True, window_size=(4, 0), softcap=5.0)
    finally:
        torch._dynamo.reset()
    (graph,) = graphs
    (node,) = [n for n in graph.graph.nodes if n.target is torch.ops.flashkiln.attention_forward.default]
    assert node.args[3:] == (None, None, "top_left", 0.125, None, None, None, 0, 0, 4, 0, 5.0)
