"""The timeline probe without a GPU: `generate --probe timeline` defines its macro in every unit (and
so joins the compile-cache key), a build without it defines nothing, and tools/bwd_timeline.py's
summary of made-up per-CTA rows."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flashkiln.descriptor import VariantDescriptor
from flashkiln.generator.build import Selection, plan_units
from flashkiln.generator.render import PROBES, render_unit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import bwd_timeline  # noqa: E402  (tools/ is a folder of scripts)

HOPPER_BWD = VariantDescriptor(kernel="bwd", family="hopper", arch="sm_90a", dtype="bf16", d_qk=128, d_v=128,
                               causal="none", bias="none", deterministic=False, tile_m=64, tile_n=128, warps=12,
                               stages=2)


def test_probe_defines_its_macro_only_when_asked() -> None:
    macro = PROBES["timeline"]
    assert f"#define {macro} 1" in render_unit([HOPPER_BWD], ("timeline",))
    assert macro not in render_unit([HOPPER_BWD])
    with pytest.raises(ValueError, match="unknown probe"):
        render_unit([HOPPER_BWD], ("nonesuch",))


def test_probe_builds_have_their_own_cache_keys() -> None:
    selection = Selection(pattern="^bwd_hopper_sm90a_bf16_d128_[0-9a-f]{8}$", full=True)
    plain, probed = plan_units(REPO / "specs", selection), plan_units(REPO / "specs", selection, ("timeline",))
    assert [u.variants for u in plain] == [u.variants for u in probed] and plain
    assert not {u.key for u in plain} & {u.key for u in probed}


def _rows(ghz: float = 2.0) -> list[list[int]]:
    """Two SMs with three CTAs each: K and V 1 µs, the fill 0.5, 10 tiles of 2 µs (0.2 µs of stage
    waits and 0.1 of dQ waits each), the epilogue 1, 0.5 µs between a CTA's end and the next one's
    entry; a CTA that swept nothing and one that never ran."""
    rows = []
    for sm in range(2):
        now = 1000
        for _ in range(3):
            start = int(now * ghz)
            kv, first = start + int(1000 * ghz), start + int(1500 * ghz)
            sweep_end = first + int(20000 * ghz)
            end = sweep_end + int(1000 * ghz)
            ns = int((end - start) / ghz)
            rows.append([sm, now, start, kv, first, sweep_end, end, now + ns, 10, int(2000 * ghz), 0, int(1000 * ghz)])
            now += ns + 500
    rows.append([0, now, 0, 0, 0, 0, 0, now + 10, 0, 0, 0, 0])
    rows.append([0] * bwd_timeline.SLOTS)
    return rows


def test_summary_of_made_up_rows() -> None:
    summary = bwd_timeline.summarize(_rows())
    assert summary["ctas"] == 6 and summary["sms"] == 2 and summary["sm_ghz"] == 2.0
    assert (summary["kv_us"], summary["fill_us"], summary["tile_us"], summary["epilogue_us"]) == (1.0, 0.5, 2.0, 1.0)
    assert summary["stage_wait_us"] == 0.2 and summary["dq_wait_us"] == 0.1 and summary["ds_store_us"] == 0.0
    assert summary["gap_us"] == summary["gap_mean_us"] == 0.5
    assert summary["fixed_tiles"] == 1.5  # (1 + 0.5 + 1 + 0.5) / 2
    assert summary["span_us"] == 3 * 22.5 + 2 * 0.5
    assert summary["sweep_share"] == round(3 * 20 / summary["span_us"], 3)
