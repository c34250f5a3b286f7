"""bench.py's timing against a simulated device: a call's device time is read only where the host
stayed behind the sleep it is queued after; a host that outran it grows the sleep, and one that
outruns every sleep is reported."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench  # noqa: E402 (bench/ is a folder of scripts)

CYCLES_PER_MS = 2_000_000


class SimulatedCuda:
    """One stream: a sleep queued at host time 0 runs to `sleep / CYCLES_PER_MS`; the timed call's
    kernel is queued when its host work (`host_ms`) ends and runs for `device_ms` once both the
    sleep and the enqueue are done."""

    def __init__(self, host_ms: float, device_ms: float):
        self.host_ms, self.device_ms = host_ms, device_ms
        self.sleeps: list[int] = []
        sim = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                self.name = None

            def record(self):
                self.name = "end" if getattr(sim, "_started", False) else "start"
                sim._started = self.name == "start"

            def query(self) -> bool:  # asked once fn() has returned: at host time host_ms
                return sim.sleep_ms <= sim.host_ms

            def synchronize(self):
                pass

            def elapsed_time(self, end) -> float:
                return max(sim.sleep_ms, sim.host_ms) + sim.device_ms - sim.sleep_ms

        self.Event = Event

    def _sleep(self, cycles: int) -> None:
        self.sleeps.append(cycles)
        self.sleep_ms = cycles / CYCLES_PER_MS

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("host_ms, sleeps", [
    (0.5, [5_000_000]),  # behind the first sleep
    (30.0, [5_000_000, 20_000_000, 80_000_000]),  # outran 2.5 ms and 10 ms, not 40 ms
])
def test_the_device_time_alone_is_read_once_the_host_stays_behind(monkeypatch, capsys, host_ms, sleeps):
    cuda = SimulatedCuda(host_ms, device_ms=1.25)
    monkeypatch.setattr(bench.torch, "cuda", cuda)
    timing = bench.time_ms(lambda: None, warmup=2, reps=3)
    assert timing == 1.25 and not timing.host_bound
    assert sorted(set(cuda.sleeps)) == sleeps and cuda.sleeps.count(sleeps[-1]) == 3
    assert capsys.readouterr().err == ""


def test_a_host_that_outruns_every_sleep_is_reported(monkeypatch, capsys):
    cuda = SimulatedCuda(host_ms=1000.0, device_ms=1.25)
    monkeypatch.setattr(bench.torch, "cuda", cuda)
    timing = bench.time_ms(lambda: None, warmup=0, reps=2)
    assert timing > 800 and timing.host_bound  # host time, as the warning says
    assert max(cuda.sleeps) == bench.MAX_SLEEP_CYCLES
    assert "2 of 2 timed calls" in capsys.readouterr().err


def test_the_tables_mark_a_timing_that_holds_host_time():
    shape = {"d": 64, "causal": False, "seqlen": 2048}
    rows = [{"backend": "flashkiln", "pass": "bwd", **shape, "tflops": 350.4, "vs_cudnn": None},
            {"backend": "nested", "pass": "bwd", **shape, "tflops": 79.2, "vs_cudnn": None, "host_bound": True}]
    text = bench.table({"rows": rows}, "bwd")
    assert "| 64 | False | 2048 | 350 | 79† |" in text and text.endswith(bench.HOST_BOUND_NOTE)
    assert "†" not in bench.table({"rows": rows[:1]}, "bwd")
