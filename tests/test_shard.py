"""Generation at scale: selection, deterministic shards, merging shard outputs (CPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flashkiln.generator.build import MergeError, Selection, generate, merge, parse_shard, plan_units
from flashkiln.manifest import Manifest

REPO = Path(__file__).resolve().parent.parent


def unit_names(units) -> list[str]:
    return [u.name for u in units]


@pytest.mark.parametrize("count", [2, 3, 7])
def test_shards_partition_the_default_specs_deterministically(count):
    everything = plan_units(REPO / "specs")
    shards = [plan_units(REPO / "specs", Selection(shard=(i, count))) for i in range(count)]
    names = [n for shard in shards for n in unit_names(shard)]
    assert sorted(names) == sorted(unit_names(everything))  # each unit in exactly one shard
    assert all(shards)  # none empty for these counts (23 units)
    again = [unit_names(plan_units(REPO / "specs", Selection(shard=(i, count)))) for i in range(count)]
    assert again == [unit_names(s) for s in shards]
    # Units stay whole: a variant's unit mates are in its shard.
    for shard in shards:
        for unit in shard:
            assert len({v.descriptor.arch for v in unit.variants}) == 1


def test_filter_and_exclude():
    selected = Selection(pattern="^fwd_", exclude="sm80").variants(
        [v for u in plan_units(REPO / "specs") for v in u.variants])
    assert selected and all(v.descriptor.kernel == "fwd" and v.descriptor.arch == "sm_90a" for v in selected)


@pytest.mark.parametrize("text", ["2/2", "a/3", "1", "-1/2", "3/2"])
def test_bad_shard_specs_are_refused(text):
    with pytest.raises(ValueError, match="i/n"):
        parse_shard(text)


def test_list_prints_units_without_compiling():
    result = subprocess.run([sys.executable, "-m", "flashkiln.generator", "generate", "--list", "--shard", "0/4",
                             "--filter", "^fwd_"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    units = plan_units(REPO / "specs", Selection(pattern="^fwd_", shard=(0, 4)))
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == unit_names(units)
    assert f"in {len(units)} unit(s)" in result.stderr


@pytest.mark.nvrtc
def test_merged_shards_equal_one_build(tmp_path, tiny_specs, build_cache):
    whole = generate(tiny_specs, tmp_path / "whole", 2, cache_dir=build_cache, progress=False)
    parts = [generate(tiny_specs, tmp_path / f"part{i}", 1, Selection(shard=(i, 2)), build_cache, progress=False)
             for i in range(2)]
    assert all(p.kernels for p in parts)
    merged = merge(tmp_path / "merged", [tmp_path / "part0", tmp_path / "part1"])
    assert [(k.hash, k.sha256, k.cubin) for k in merged.kernels] == [(k.hash, k.sha256, k.cubin) for k in whole.kernels]
    reloaded = Manifest.load(tmp_path / "merged")
    assert all((tmp_path / "merged" / k.cubin).read_bytes() == (tmp_path / "whole" / k.cubin).read_bytes()
               for k in reloaded.kernels)


def test_merge_refuses_shards_of_different_builds(tmp_path):
    for i, digest in enumerate(("aaaa", "bbbb")):
        (tmp_path / f"s{i}").mkdir()
        (tmp_path / f"s{i}" / "manifest.json").write_text(
            Manifest(tmp_path / f"s{i}", {"flashkiln_version": "0.1.0", "generator_version": "0.1.0",
                                          "toolchain_identity": "x", "specs_digest": digest}, ()).to_json())
    with pytest.raises(MergeError, match="different builds"):
        merge(tmp_path / "out", [tmp_path / "s0", tmp_path / "s1"])
