"""The table of an A/B run of tools/time_backward.py (tools/device_run.sh's `ab` step): per shape
and variant, each arm's times in ms (one per round, in run order), the second arm's mean over the
first's (above 1: the first arm is faster), and each arm's peak memory in MiB.

Usage: python3 tools/ab_table.py AB_JSONL   (rows of time_backward.py; an arm is a row's label)
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def table(rows: list[dict]) -> list[str]:
    arms = list(dict.fromkeys(r["label"] for r in rows))
    cells: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[(r["variant"], r["d"], r["causal"], r["S"])][r["label"]].append(r)
    lines = ["| variant | d | causal | S | " + " | ".join(f"{a} ms" for a in arms)
             + (f" | {arms[1]} / {arms[0]} | " if len(arms) == 2 else " | ") + "peak MiB |",
             "|---" * (5 + len(arms) + (len(arms) == 2)) + "|"]
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2], k[3])):
        runs = [cells[key][a] for a in arms]
        times = [", ".join(f"{r['ms']:.3f}" for r in arm) or "-" for arm in runs]
        ratio = ""
        if len(arms) == 2:
            means = [sum(r["ms"] for r in arm) / len(arm) if arm else 0.0 for arm in runs]
            ratio = f" | {means[1] / means[0]:.3f}" if all(means) else " | -"
        peaks = " / ".join(str(arm[0]["peak_mib"]) if arm else "-" for arm in runs)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(times) + ratio + f" | {peaks} |")
    return lines


def main() -> None:
    with open(sys.argv[1]) as f:
        rows = [json.loads(line) for line in f if line.startswith("{")]
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
