"""tools/ab_table.py: an A/B run's rows as one table row per shape, each arm's rounds in run order,
the second arm's mean time over the first's."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ab_table  # noqa: E402  (tools/ is a folder of scripts)


def _row(label: str, ms: float, s: int = 2048, variant: str = "bias") -> dict:
    return {"label": label, "variant": variant, "d": 64, "causal": False, "S": s, "ms": ms, "peak_mib": 12.5}


def test_each_shape_gets_its_arms_rounds_and_their_ratio():
    rows = [_row("new", 1.0), _row("main", 1.5), _row("new", 1.2, s=8192), _row("main", 1.2, s=8192),
            _row("new", 2.0), _row("main", 2.5)]
    lines = ab_table.table(rows)
    assert lines[0] == "| variant | d | causal | S | new ms | main ms | main / new | peak MiB |"
    assert lines[2] == "| bias | 64 | False | 2048 | 1.000, 2.000 | 1.500, 2.500 | 1.333 | 12.5 / 12.5 |"
    assert lines[3] == "| bias | 64 | False | 8192 | 1.200 | 1.200 | 1.000 | 12.5 / 12.5 |"
    assert len(lines) == 4


def test_a_shape_one_arm_lacks_has_no_ratio():
    lines = ab_table.table([_row("new", 1.0), _row("main", 1.5), _row("new", 3.0, variant="dbias")])
    assert lines[2].startswith("| bias |") and lines[3] == "| dbias | 64 | False | 2048 | 3.000 | - | - | 12.5 / - |"
