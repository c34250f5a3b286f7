"""Generation at scale: selection, deterministic shards, merging shard outputs (CPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flashkiln.generator.build import MergeError, Selection, generate, merge, parse_archs, parse_shard, plan_units
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
    selected = Selection(pattern="^fwd_", exclude="sm80|sm86|sm120").variants(
        [v for u in plan_units(REPO / "specs") for v in u.variants])
    assert selected and all(v.descriptor.kernel == "fwd" and v.descriptor.arch == "sm_90a" for v in selected)


def test_arch_selection_takes_the_named_archs_only():
    every = [v for u in plan_units(REPO / "specs") for v in u.variants]
    sm80 = Selection(archs=("sm_80",)).variants(every)
    assert sm80 and {v.descriptor.arch for v in sm80} == {"sm_80"}
    both = Selection(archs=parse_archs("sm_80, sm_90a,sm_80")).variants(every)
    assert {v.descriptor.arch for v in both} == {"sm_80", "sm_90a"}
    assert len(both) == sum(v.descriptor.arch in ("sm_80", "sm_90a") for v in every)
    units = plan_units(REPO / "specs", Selection(archs=("sm_90a",)))
    assert units and all(v.descriptor.arch == "sm_90a" for u in units for v in u.variants)
    assert Selection(archs=("sm_90a",)).describe()["archs"] == ["sm_90a"]


def test_an_arch_the_specs_do_not_list_is_named():
    with pytest.raises(ValueError, match=r"archs sm_75: the specs list kernels for sm_80, sm_86, sm_90a, sm_120 only"):
        plan_units(REPO / "specs", Selection(archs=("sm_75", "sm_90a")))
    with pytest.raises(ValueError, match="comma-separated"):
        parse_archs(" , ")


def test_make_passes_archs_to_the_generator():
    result = subprocess.run(["make", "-n", "generate", "ARCHS=sm_80,sm_90a"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert "generate --specs specs --out generated" in result.stdout and "--archs sm_80,sm_90a" in result.stdout
    plain = subprocess.run(["make", "-n", "generate"], cwd=REPO, capture_output=True, text=True)
    assert "--archs sm_90a" in plain.stdout  # the default set
    every = subprocess.run(["make", "-n", "generate", "ARCHS=all"], cwd=REPO, capture_output=True, text=True)
    assert "--archs" not in every.stdout


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


def test_list_with_archs_and_its_error():
    result = subprocess.run([sys.executable, "-m", "flashkiln.generator", "generate", "--list", "--archs", "sm_80"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout and all("_sm80_" in line.split(":")[0] for line in result.stdout.splitlines())
    bad = subprocess.run([sys.executable, "-m", "flashkiln.generator", "list", "--archs", "sm_100a"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "error: archs sm_100a" in bad.stderr


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
