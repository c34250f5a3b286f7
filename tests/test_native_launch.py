"""flashkiln._launch, the plans' launches run from C, against launch.run's Python loop on the same
plans: the driver's entry points are ctypes callbacks here, which record what a launch hands the
driver (the parameter block's bytes included) and re-point a tensor map by writing its address
into the map, so that both paths' launches can be compared byte for byte."""
from __future__ import annotations

import ctypes
import struct

import pytest
import torch

from flashkiln import launch
from flashkiln._launch import Steps
from flashkiln.launch import KernelLaunch, ScratchSet, run
from flashkiln.params import HopperFwdParams
from test_planned_calls import backward_plan, fake_gpu, plan_fields, qkv, registry  # noqa: F401 (fixtures)
from test_registry import FakeDriver

LAUNCH_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))
REPLACE_ADDRESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
LAUNCH_FAILED = 719  # CUDA_ERROR_LAUNCH_FAILED


class RecordingDriver(FakeDriver):
    """A FakeDriver whose kernels are integer handles, whose launches are recorded as (kernel, grid,
    block, shared bytes, stream, block bytes) and whose tensor maps are re-pointed by writing the
    address into the map's first 8 bytes; with `native`, through C entry points."""

    def __init__(self, native: bool):
        super().__init__()
        self.native = native
        self.launched: list[tuple] = []
        self.replaced = 0
        self.sizes: dict[int, int] = {}  # kernel handle -> its parameter block's size
        self.fail_at: int | None = None  # the launch that returns LAUNCH_FAILED
        self._entry_points = (LAUNCH_KERNEL(self._launch_from_c), REPLACE_ADDRESS(self._replace_from_c))

    def get_kernel(self, library, symbol: str) -> int:
        super().get_kernel(library, symbol)
        return 0x1000 + len(self.named("get_kernel"))

    def entry_points(self):
        if not self.native:
            return None
        return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._entry_points)

    def raise_failure(self, what: str, code: int):
        raise RuntimeError(f"{what}: {code}")

    def replace_tensor_map_address(self, tensor_map: int, address: int) -> None:
        self._replace_from_c(tensor_map, address)

    def launch(self, kernel, grid, block, smem_bytes, stream, params) -> None:
        self.launched.append((kernel, tuple(grid), tuple(block), smem_bytes, stream, bytes(params)))

    def _replace_from_c(self, tensor_map: int, address: int) -> int:
        ctypes.memmove(tensor_map, struct.pack("Q", address or 0), 8)
        self.replaced += 1
        return 0

    def _launch_from_c(self, function, gx, gy, gz, bx, by, bz, smem_bytes, stream, kernel_params, extra) -> int:
        assert not extra
        block = ctypes.string_at(kernel_params[0], self.sizes[function])
        self.launched.append((function, (gx, gy, gz), (bx, by, bz), smem_bytes, stream or 0, block))
        return LAUNCH_FAILED if len(self.launched) - 1 == self.fail_at else 0


def on(registry, native: bool) -> RecordingDriver:
    driver = RecordingDriver(native)
    registry._driver = driver
    return driver


def record_sizes(plan) -> None:
    plan.registry.driver.sizes.update({kernel.handle: ctypes.sizeof(launch.params)
                                       for launch, kernel in zip(plan.launches, plan.kernels)})


def tensor_map_plan(registry, q, k, v) -> launch.CallPlan:
    """Two launches of hopper-style blocks: the first with tensor maps of q, k and v and pointers,
    the second sharing the first's block (a plan's launches can), the third its own."""
    entry = registry.find({"kernel": "fwd", "family": "portable", "dtype": "bf16", "d_qk": 64, "d_v": 64,
                           "causal": "none", "bias": "none", "deterministic": False}, (9, 0))
    maps = tuple((f"tma_{r}", r, t.data_ptr()) for r, t in (("q", q), ("k", k), ("v", v)))
    first = KernelLaunch.planned(entry, (5, 2, 1), HopperFwdParams(batch=3, scale=0.5),
                                 {"o": q, "lse": k, "sink": None}, maps)
    other = KernelLaunch.planned(entry, (7, 1, 1), HopperFwdParams(batch=4), {"o": v}, maps[:1])
    launches = (first, first, other)
    return launch.CallPlan(family="hopper", **plan_fields(registry, launches, ScratchSet(q.device), q, k, v))


def run_both(registry, make_plan, tensors) -> tuple[RecordingDriver, RecordingDriver, launch.CallPlan]:
    """The Python loop's launches, then the native ones, each of a plan made for its own driver."""
    drivers = []
    for native in (False, True):
        driver = on(registry, native)
        plan = make_plan()
        record_sizes(plan)
        assert (plan.native is not None) == native
        run(plan, tensors)
        drivers.append(driver)
    return drivers[0], drivers[1], plan


@pytest.mark.parametrize("moved", [False, True])
def test_native_launches_hand_the_driver_what_the_python_loop_does(registry, fake_gpu, moved):
    q, k, v = qkv()
    others = {r: torch.randn_like(t) for r, t in (("q", q), ("k", k), ("v", v))}
    tensors = {"q": q, "k": k, "v": v, "o": torch.randn_like(q), "lse": torch.randn(4), "sink": None,
               **(others if moved else {})}
    python, native, plan = run_both(registry, lambda: tensor_map_plan(registry, q, k, v), tensors)
    assert len(native.launched) == 3 and native.launched == python.launched
    assert native.replaced == python.replaced == (4 if moved else 0)  # the shared block is bound once
    block = HopperFwdParams.from_buffer_copy(native.launched[0][5])
    assert (block.o, block.lse, block.sink, block.batch, block.scale) == (tensors["o"].data_ptr(),
                                                                          tensors["lse"].data_ptr(), 0, 3, 0.5)
    assert struct.unpack_from("Q", native.launched[0][5], HopperFwdParams.tma_k.offset)[0] == (
        tensors["k"].data_ptr() if moved else 0)  # re-pointed only when its tensor moved
    assert [r[:5] for r in native.launched] == [
        (kernel.handle, launch_.grid, (launch_.entry.threads, 1, 1), launch_.entry.smem_bytes, 7)
        for launch_, kernel in zip(plan.launches, plan.kernels)]


def test_a_planned_backward_launches_the_same_natively(registry, fake_gpu):
    q, k, v = qkv()
    dout, out, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(q.shape[:3])
    grads = [torch.empty_like(t) for t in (q, k, v)]
    arguments = (dout, q, k, v, out, lse, None, None, None, None, *grads)
    recorded = []
    for native in (False, True):
        driver = on(registry, native)
        plan = backward_plan(registry, q, k, v)
        record_sizes(plan)
        plan.run(*arguments)
        recorded.append(driver.launched)
    python, native = recorded
    assert len(native) == len(plan.launches) and [r[:5] for r in native] == [r[:5] for r in python]
    # Scratch is fresh per call, so its addresses differ; every other byte of each block matches.
    for (*_, mine), (*_, theirs), launch_ in zip(native, python, plan.launches):
        fields = type(launch_.params)
        masked = [bytearray(mine), bytearray(theirs)]
        for spec in plan.scratch:
            if hasattr(fields, spec.role):
                for b in masked:
                    b[getattr(fields, spec.role).offset:getattr(fields, spec.role).offset + 8] = bytes(8)
        assert masked[0] == masked[1]


def test_a_failed_native_launch_is_raised_by_the_driver_with_the_launch_named(registry, fake_gpu):
    q, k, v = qkv()
    driver = on(registry, True)
    plan = tensor_map_plan(registry, q, k, v)
    record_sizes(plan)
    driver.fail_at = 1
    with pytest.raises(RuntimeError, match=r"^cuLaunchKernel \(launch 1 of 3\): 719$"):
        run(plan, {"q": q, "k": k, "v": v, "o": q, "lse": k, "sink": None})
    assert len(driver.launched) == 2  # none after the failure


@pytest.mark.parametrize("step, error", [
    ((1, (1, 1, 1), (1, 1, 1), 0, bytes(64), ((60, 0),), (), -1), "outside"),  # a pointer past the block
    ((1, (1, 1, 1), (1, 1, 1), 0, bytes(256), (), ((192, 0, 0),), -1), "outside"),  # a map past the block
    ((1, (1, 1, 1), (1, 1, 1), 0, bytes(64), ((0, 1),), (), -1), "outside"),  # a role past the roles
    ((1, (1, 1, 1), (1, 1, 1), 0, bytes(64), (), (), 0), "earlier step"),  # sharing its own block
    ((1, (1, 1), (1, 1, 1), 0, bytes(64), (), (), -1), "3-tuples"),
])
def test_steps_refuse_a_malformed_plan(step, error):
    with pytest.raises((ValueError, TypeError), match=error):
        Steps(1, 1, ("q",), [step])


def test_steps_read_each_roles_address_from_the_tensors():
    """Each slot takes its own role's value: an int as it is, a tensor's data_ptr(); a role the call
    lacks is the mapping's own error, before any launch."""
    driver = RecordingDriver(native=True)
    driver.sizes[7] = 24
    steps = Steps(*driver.entry_points(), ("a", "b", "c"),
                  [(7, (1, 1, 1), (1, 1, 1), 0, bytes(24), ((16, 0), (0, 2), (8, 1)), (), -1)])
    t = torch.randn(3)
    assert steps.run(0, {"c": t, "a": 0x1234, "b": 0x5678, "other": 1}) is None
    assert struct.unpack("3Q", driver.launched[0][5]) == (t.data_ptr(), 0x5678, 0x1234)
    with pytest.raises(KeyError, match="b"):
        steps.run(0, {"a": 1, "c": t})
    with pytest.raises(AttributeError, match="data_ptr"):
        steps.run(0, {"a": 1, "b": None, "c": t})
    assert len(driver.launched) == 1


def test_steps_refuse_bad_roles_and_entry_points():
    with pytest.raises(TypeError, match="tuple of str"):
        Steps(1, 1, ["q"], [])
    with pytest.raises(TypeError, match="tuple of str"):
        Steps(1, 1, (0,), [])
    with pytest.raises(ValueError, match="null driver entry point"):
        Steps(0, 1, (), [])
