"""Spec files: expansion into descriptors, and errors that name file, line and key (CPU only)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashkiln.descriptor import VariantDescriptor
from flashkiln.generator.build import Selection
from flashkiln.generator.specs import SpecError, load_variants

REPO = Path(__file__).resolve().parent.parent

GOOD_TUNING = """\
fwd:
  sm_80:
    64: {tile_m: 128, tile_n: 64, warps: 4, stages: 1}
    128: {tile_m: 128, tile_n: 64, warps: 4, stages: 1}
    192: {tile_m: 128, tile_n: 64, warps: 4, stages: 1}
    192x128: {tile_m: 128, tile_n: 64, warps: 4, stages: 1}
  sm_90a:
    64: {tile_m: 128, tile_n: 64, warps: 4, stages: 1}
    128: {tile_m: 128, tile_n: 64, warps: 4, stages: 2}
"""

SM80_ROW_64 = "64: {tile_m: 128, tile_n: 64, warps: 4, stages: 1}"  # line 3 of GOOD_TUNING


def with_sm80_row_64(row: str) -> str:
    """GOOD_TUNING with the sm_80 head-dim-64 row (line 3) replaced."""
    return GOOD_TUNING.replace(SM80_ROW_64, row, 1)


GOOD_SPEC = """\
family: portable
tuning: tuning/portable.yaml
variants:
  - kernel: [fwd]
    arch: [sm_80, sm_90a]
    dtype: [fp16]
    head_dims: [64, 128]
    causal: [none]
"""


def write_specs(root: Path, spec: str, tuning: str = GOOD_TUNING, name: str = "portable.yaml") -> Path:
    """A specs/ directory under `root` with one spec file and tuning/portable.yaml."""
    specs = root / "specs"
    (specs / "tuning").mkdir(parents=True, exist_ok=True)
    (specs / name).write_text(textwrap.dedent(spec))
    (specs / "tuning" / "portable.yaml").write_text(textwrap.dedent(tuning))
    return specs


def expand(tmp_path: Path, spec: str, tuning: str = GOOD_TUNING) -> list[VariantDescriptor]:
    return [v.descriptor for v in load_variants(write_specs(tmp_path, spec, tuning))]


def spec_error(tmp_path: Path, spec: str, tuning: str = GOOD_TUNING) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_variants(write_specs(tmp_path, spec, tuning))
    return info.value


def issue_for(error: SpecError, key: str, contains: str = ""):
    """The single issue with this key path (and message fragment); fails listing them all otherwise."""
    found = [i for i in error.issues if i.key == key and contains in i.message]
    assert len(found) == 1, f"expected one issue {key!r} ~ {contains!r}, got:\n{error}"
    return found[0]


def assert_reported(error: SpecError, file: str, line: int, key: str, contains: str = "") -> None:
    """One issue at file:line for `key`, and the exception text shows it with its location."""
    issue = issue_for(error, key, contains)
    assert (issue.where.file, issue.where.line) == (file, line), str(issue)
    assert f"{file}:{line}: {key}: " in str(error)


SPEC = "specs/portable.yaml"
TUNING = "specs/tuning/portable.yaml"


# -- expansion --------------------------------------------------------------------------------

def test_default_specs_expand_to_918_unique_variants():
    variants = load_variants(REPO / "specs")
    # Two causal modes (none, and bottom_right, which runs top-left calls too). portable, per arch
    # (sm_80, sm_86, sm_90a, sm_120): fwd 40 (5 head dims, 2 dtypes, with and without a bias), bwd
    # 40 + 20 (deterministic, bias), bwd_pre and bwd_post 10 each, bwd_dq 20; sm_90a also: fwd 8
    # (window) + 8 (window and bias) + 8 (softcap, bf16, with and without a window), bwd 16
    # (window) + 8 (window and bias, deterministic) + 8 (softcap), bwd_dq 8 (window). hopper: fwd
    # 20 + 8 (second tunings of d 64 and 128) + 20 (bias) + 16 (window, both tunings of d 64 and 128)
    # + 4 (window, d 256) + 8 (window and bias), each dense and packed, + 12 (softcap, dense, one
    # tuning, d 64, 128 and 256), bwd 20 (d 64, 96, 128, 192/128, 256) + 20 (bias) + 20 (bias with
    # dBias) + 12 (window) + 8 (window and bias) + 8 (window, bias with dBias) + 12 (softcap),
    # bwd_post 10, and bwd_dbias 12 (d 64, 96, 128) + 8 (window, d 64 and 128)
    assert len(variants) == 918
    assert len({v.descriptor.hash for v in variants}) == 918
    assert len({v.descriptor.name for v in variants}) == 918
    assert sum(v.descriptor.packed for v in variants) == 76
    assert sum(v.descriptor.window for v in variants) == 160
    assert sum(v.descriptor.softcap for v in variants) == 40
    assert sum(v.descriptor.bias_grad for v in variants) == 28
    assert sum(v.relative_speed != 1 for v in variants) == 32
    archs = [v.descriptor.arch for v in variants]
    assert [archs.count(a) for a in ("sm_80", "sm_86", "sm_90a", "sm_120")] == [140, 140, 498, 140]
    assert {(v.descriptor.d_qk, v.descriptor.d_v) for v in variants} == {
        (64, 64), (96, 96), (128, 128), (192, 128), (256, 256)}
    kinds = [v.descriptor.kernel for v in variants]
    assert [kinds.count(k) for k in ("fwd", "bwd", "bwd_pre", "bwd_post", "bwd_dq", "bwd_dbias")] == [
        348, 372, 40, 50, 88, 20]
    assert sum(v.descriptor.bias == "additive" for v in variants) == 308
    assert {v.spec_file for v in variants} == {SPEC, "specs/hopper.yaml"}
    assert all(v.spec_file == "specs/hopper.yaml" for v in variants if v.descriptor.family == "hopper")


def test_the_default_set_leaves_out_the_groups_marked_full(tmp_path):
    full_group = GOOD_SPEC.split("variants:\n")[1].replace("[fp16]", "[bf16]") + "    set: full\n"
    variants = load_variants(write_specs(tmp_path, GOOD_SPEC + full_group))
    assert len(variants) == 8 and sum(v.full_only for v in variants) == 4
    assert {v.descriptor.dtype for v in Selection().variants(variants)} == {"fp16"}
    assert len(Selection(full=True).variants(variants)) == 8
    # A variant that a default group asks for too is in the default set.
    both = load_variants(write_specs(tmp_path / "both", GOOD_SPEC.split("variants:\n")[0] + "variants:\n" +
                                     full_group.replace("[bf16]", "[fp16]") + GOOD_SPEC.split("variants:\n")[1]))
    assert len(both) == 4 and not any(v.full_only for v in both)


def test_a_group_set_must_be_default_or_full(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC + "    set: most\n")
    assert_reported(error, SPEC, 9, "variants[0].set", "expected one of: default, full")


def test_the_full_sets_sm90a_portable_kernels_are_what_the_hopper_family_covers():
    """The default set builds each call's kernel once on sm_90a: what it leaves to the full set are
    portable kernels whose calls a hopper kernel of the default set runs (its backward serves
    deterministic calls, and stores the dS that the portable workspace route's bwd_dq reads)."""
    variants = load_variants(REPO / "specs")
    default = {v.descriptor.name for v in Selection().variants(variants)}
    hopper = [v.descriptor for v in variants if v.descriptor.family == "hopper" and v.descriptor.name in default]

    def covered(d: VariantDescriptor) -> bool:
        kernel, bias = ("bwd", "additive") if d.kernel == "bwd_dq" else (d.kernel, d.bias)
        return any(h.kernel == kernel and h.bias == bias and
                   all(getattr(h, f) == getattr(d, f) for f in ("dtype", "d_qk", "d_v", "causal", "window", "softcap"))
                   for h in hopper)

    full_only = [v.descriptor for v in variants if v.full_only]
    assert full_only and all(d.family == "portable" and d.arch == "sm_90a" for d in full_only)
    assert [d.name for d in full_only if not covered(d)] == []
    assert len(default) == 918 - len(full_only)


def test_portable_kernels_are_never_packed(tmp_path):
    # Their packed=false kernels read the sequence bounds at run time: a packed=true one would be a twin.
    error = spec_error(tmp_path, GOOD_SPEC + "    packed: [true]\n")
    assert "portable kernels read the sequence bounds at run time" in str(error)


def test_small_spec_expands_to_its_cross_product_with_tuned_fields(tmp_path):
    got = {(d.arch, d.d_qk, d.d_v, d.stages) for d in expand(tmp_path, GOOD_SPEC)}
    assert got == {("sm_80", 64, 64, 1), ("sm_80", 128, 128, 1), ("sm_90a", 64, 64, 1), ("sm_90a", 128, 128, 2)}


def test_exclude_removes_matching_combinations(tmp_path):
    spec = GOOD_SPEC + "exclude:\n  - {arch: sm_80, head_dims: 128}\n  - {arch: sm_90a, head_dims: 64}\n"
    got = {(d.arch, d.d_qk) for d in expand(tmp_path, spec)}
    assert got == {("sm_80", 64), ("sm_90a", 128)}


def test_head_dims_accepts_a_scalar(tmp_path):
    got = expand(tmp_path, GOOD_SPEC.replace("arch: [sm_80, sm_90a]", "arch: [sm_80]").replace("[64, 128]", "64"))
    assert [(d.d_qk, d.d_v) for d in got] == [(64, 64)]


def test_head_dims_accepts_a_pair_and_a_list_of_dims(tmp_path):
    spec = GOOD_SPEC.replace("arch: [sm_80, sm_90a]", "arch: [sm_80]").replace("[64, 128]", "[64, [192, 128]]")
    assert sorted((d.d_qk, d.d_v) for d in expand(tmp_path, spec)) == [(64, 64), (192, 128)]
    # A flat two-element list is two dims, not a pair.
    spec = GOOD_SPEC.replace("arch: [sm_80, sm_90a]", "arch: [sm_80]").replace("[64, 128]", "[192, 128]")
    assert sorted((d.d_qk, d.d_v) for d in expand(tmp_path / "flat", spec)) == [(128, 128), (192, 192)]


def test_overlapping_groups_are_built_once(tmp_path):
    group = GOOD_SPEC.split("variants:\n")[1]
    assert len(expand(tmp_path, GOOD_SPEC + group)) == 4


# -- errors: each names file, line and key ----------------------------------------------------

def test_unknown_top_level_key(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC.replace("variants:", "colour: blue\nvariants:"))
    assert_reported(error, SPEC, 3, "colour", "unknown key")


def test_unknown_axis_key(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC.replace("causal:", "causl:"))
    assert_reported(error, SPEC, 8, "variants[0].causl", "unknown key")
    assert "causal" in issue_for(error, "variants[0].causl").message  # lists the expected keys


@pytest.mark.parametrize(
    "old, new, line, key, shown",
    [
        ("dtype: [fp16]", "dtype: [fp16, fp8]", 6, "variants[0].dtype", "'fp8'"),
        ("arch: [sm_80, sm_90a]", "arch: [sm_70]", 5, "variants[0].arch", "'sm_70'"),
        ("causal: [none]", 'causal: ["yes"]', 8, "variants[0].causal", "'yes'"),
        ("causal: [none]", "causal: [yes]", 8, "variants[0].causal", "True"),  # YAML 1.1 reads yes as a bool
        ("head_dims: [64, 128]", "head_dims: [64, 80]", 7, "variants[0].head_dims", "80"),
        ("head_dims: [64, 128]", "head_dims: [[64, 128, 32]]", 7, "variants[0].head_dims", "expected d or [d_qk, d_v]"),
        ("causal: [none]", "causal: [none]\n    deterministic: [maybe]", 9, "variants[0].deterministic", "maybe"),
    ],
)
def test_unsupported_value(tmp_path, old, new, line, key, shown):
    error = spec_error(tmp_path, GOOD_SPEC.replace(old, new))
    assert_reported(error, SPEC, line, key, shown)
    assert "supported" in issue_for(error, key, shown).message or "expected" in issue_for(error, key, shown).message


def test_missing_required_axis(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC.replace("    dtype: [fp16]\n", ""))
    assert_reported(error, SPEC, 4, "variants[0].dtype", "required axis is missing")


def test_missing_required_axis_is_reported_once(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC.replace("    dtype: [fp16]\n", ""))
    assert [i.key for i in error.issues] == ["variants[0].dtype"]


def test_missing_top_level_key(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC.replace("tuning: tuning/portable.yaml\n", ""))
    assert_reported(error, SPEC, 1, "tuning", "required key is missing")


def test_empty_spec_file_reports_its_missing_keys(tmp_path):
    error = spec_error(tmp_path, "")
    for key in ("family", "tuning", "variants"):
        assert_reported(error, SPEC, 1, key, "required key is missing")


def test_empty_axis_list(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC.replace("causal: [none]", "causal: []"))
    assert_reported(error, SPEC, 8, "variants[0].causal", "empty list")


def test_missing_tuning_row_names_kernel_arch_and_dims(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC.replace("[64, 128]", "[64, 96]"))
    # Only sm_80 and sm_90a at 96 are missing; each is reported at the group.
    issues = [i for i in error.issues if "no tuning" in i.message]
    assert len(issues) == 2 and len(error.issues) == 2
    messages = sorted(i.message for i in issues)
    assert messages[0].startswith(f"no tuning for fwd sm_80 head dims 96 in {TUNING}")
    assert messages[1].startswith(f"no tuning for fwd sm_90a head dims 96 in {TUNING}")
    assert_reported(error, SPEC, 4, "variants[0]", "fwd sm_80 head dims 96")
    assert_reported(error, SPEC, 4, "variants[0]", "fwd sm_90a head dims 96")


def test_missing_tuning_file(tmp_path):
    specs = write_specs(tmp_path, GOOD_SPEC)
    (specs / "tuning" / "portable.yaml").unlink()
    with pytest.raises(SpecError) as info:
        load_variants(specs)
    assert_reported(info.value, SPEC, 2, "tuning", "does not exist")


def test_a_group_may_name_its_own_tuning_table(tmp_path):
    spec = GOOD_SPEC + (
        "  - kernel: [fwd]\n    arch: [sm_90a]\n    dtype: [fp16]\n    head_dims: [128]\n"
        "    causal: [none]\n    bias: [additive]\n    tuning: tuning/biased.yaml\n")
    specs = write_specs(tmp_path, spec)
    (specs / "tuning" / "biased.yaml").write_text(
        "fwd:\n  sm_90a:\n    128: {tile_m: 64, tile_n: 64, warps: 4, stages: 1}\n")
    got = {(d.arch, d.d_qk, d.bias, d.tile_m) for d in (v.descriptor for v in load_variants(specs))}
    assert got == {("sm_80", 64, "none", 128), ("sm_80", 128, "none", 128), ("sm_90a", 64, "none", 128),
                   ("sm_90a", 128, "none", 128), ("sm_90a", 128, "additive", 64)}
    (specs / "tuning" / "biased.yaml").unlink()
    with pytest.raises(SpecError) as info:
        load_variants(specs)
    assert_reported(info.value, SPEC, 15, "variants[1].tuning", "does not exist")


def test_tuning_row_with_unknown_field(tmp_path):
    tuning = GOOD_TUNING.replace("128: {tile_m: 128, tile_n: 64, warps: 4, stages: 2}",
                                 "128: {tile_m: 128, tile_n: 64, warps: 4, stages: 2, tile_k: 32}")
    error = spec_error(tmp_path, GOOD_SPEC, tuning)
    assert_reported(error, TUNING, 9, "fwd.sm_90a.128.tile_k", "unknown key")


def test_tuning_row_with_missing_field(tmp_path):
    tuning = with_sm80_row_64("64: {tile_m: 128, tile_n: 64, warps: 4}")
    error = spec_error(tmp_path, GOOD_SPEC, tuning)
    assert_reported(error, TUNING, 3, "fwd.sm_80.64", "missing performance field(s): stages")


def test_tile_that_does_not_fit_shared_memory(tmp_path):
    tuning = GOOD_TUNING.replace("  sm_90a:", "    256: {tile_m: 128, tile_n: 128, warps: 4, stages: 2}\n  sm_90a:")
    spec = GOOD_SPEC.replace("arch: [sm_80, sm_90a]", "arch: [sm_80]").replace("[64, 128]", "[256]")
    error = spec_error(tmp_path, spec, tuning)
    issue = issue_for(error, "fwd.sm_80.256", "shared memory")
    # 2 bytes * (128 * 256 + 2 stages * 128 * (256 + 256)) = 327680
    assert "327680 bytes" in issue.message and "166912" in issue.message and "sm_80" in issue.message
    assert (issue.where.file, issue.where.line) == (TUNING, 7)


def test_tile_m_must_be_a_multiple_of_16_warps(tmp_path):
    tuning = with_sm80_row_64("64: {tile_m: 64, tile_n: 64, warps: 8, stages: 1}")
    error = spec_error(tmp_path, GOOD_SPEC, tuning)
    assert_reported(error, TUNING, 3, "fwd.sm_80.64", "tile_m=64: must be a multiple of 16 * warps = 128")


def test_invalid_performance_value_in_tuning(tmp_path):
    tuning = with_sm80_row_64("64: {tile_m: 0, tile_n: 64, warps: 4, stages: 1}")
    error = spec_error(tmp_path, GOOD_SPEC, tuning)
    assert_reported(error, TUNING, 3, "fwd.sm_80.64", "tile_m=0 must be a positive integer")


def test_spec_that_expands_to_nothing(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC + "exclude:\n  - {kernel: fwd}\n")
    assert_reported(error, SPEC, 1, "variants", "expands to no variant")


def test_exclude_with_several_values_per_axis(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC + "exclude:\n  - {arch: [sm_80, sm_90a]}\n")
    assert_reported(error, SPEC, 10, "exclude[0].arch", "single value")


def test_invalid_yaml_syntax(tmp_path):
    spec = GOOD_SPEC.replace("dtype: [fp16]", "dtype: [fp16")
    error = spec_error(tmp_path, spec)
    assert len(error.issues) == 1
    issue = error.issues[0]
    assert issue.where.file == SPEC and "not valid YAML" in issue.message
    assert f"{SPEC}:" in str(error)


def test_invalid_yaml_syntax_names_the_offending_line(tmp_path):
    error = spec_error(tmp_path, GOOD_SPEC.replace("dtype: [fp16]", "dtype: [fp16"))
    # PyYAML notices the unclosed flow sequence at the next key, line 7.
    assert error.issues[0].where.line == 7


def test_all_errors_of_a_file_are_reported_together(tmp_path):
    spec = """\
    family: portable
    tuning: tuning/portable.yaml
    colour: blue
    variants:
      - kernel: [fwd]
        arch: [sm_70]
        dtype: [fp8]
        head_dims: [64]
        causal: [none]
      - kernel: [fwd]
        arch: [sm_80]
        dtype: [fp16]
        head_dims: []
        causal: [none]
    """
    error = spec_error(tmp_path, spec)
    assert_reported(error, SPEC, 3, "colour", "unknown key")
    assert_reported(error, SPEC, 6, "variants[0].arch", "sm_70")
    assert_reported(error, SPEC, 7, "variants[0].dtype", "fp8")
    assert_reported(error, SPEC, 13, "variants[1].head_dims", "empty list")
    assert len(error.issues) == 4
    assert str(error).startswith("4 problem(s) in the specs:")


def test_errors_of_several_files_are_reported_together(tmp_path):
    specs = write_specs(tmp_path, GOOD_SPEC.replace("dtype: [fp16]", "dtype: [fp8]"))
    (specs / "second.yaml").write_text(GOOD_SPEC.replace("causal: [none]", "causal: [sideways]"))
    with pytest.raises(SpecError) as info:
        load_variants(specs)
    assert_reported(info.value, SPEC, 6, "variants[0].dtype", "fp8")
    assert_reported(info.value, "specs/second.yaml", 8, "variants[0].causal", "sideways")


# -- command line -----------------------------------------------------------------------------

def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashkiln.generator", *args], cwd=cwd, capture_output=True, text=True)


def test_cli_list_with_filter():
    for kernel_set, count in (("default", 6), ("full", 12)):
        result = run_cli("list", "--specs", "specs", "--filter", "^fwd_portable_sm90a_bf16_d128_", "--set", kernel_set)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        # Two causal modes: full, with and without a bias, with and without a window, and 4 with a
        # softcap; the default set, the plain ones and the softcapped ones.
        assert len(lines) == count
        expected = {d.name: d.hash for d in (v.descriptor for v in load_variants(REPO / "specs"))
                    if d.kernel == "fwd" and d.family == "portable" and d.arch == "sm_90a" and d.dtype == "bf16"
                    and d.d_qk == d.d_v == 128
                    and (kernel_set == "full" or (d.bias == "none" and (d.softcap or not d.window)))}
        assert {tuple(line.split("  ")) for line in lines} == set(expected.items())
    assert "12 variant(s)" in result.stderr


def test_cli_list_on_a_broken_spec_dir(tmp_path):
    specs = write_specs(tmp_path, GOOD_SPEC.replace("dtype: [fp16]", "dtype: [fp8]"))
    result = run_cli("list", "--specs", str(specs))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: 1 problem(s) in the specs:")
    assert f"{SPEC}:6: variants[0].dtype: unsupported value 'fp8'" in result.stderr


def test_bwd_dq_must_repeat_the_bwd_tiles(tmp_path):
    tuning = GOOD_TUNING + textwrap.dedent("""\
        bwd:
          sm_90a:
            128: {tile_m: 64, tile_n: 128, warps: 8, stages: 2}
        bwd_dq:
          sm_90a:
            128: {tile_m: 64, tile_n: 64, warps: 4, stages: 2}
        """)
    spec = GOOD_SPEC.replace("kernel: [fwd]", "kernel: [bwd, bwd_dq]").replace("[sm_80, sm_90a]", "[sm_90a]") \
        .replace("[64, 128]", "[128]")
    error = spec_error(tmp_path, spec, tuning)
    assert len(error.issues) == 1
    assert_reported(error, TUNING, 15, "bwd_dq.sm_90a.128.tile_n", "64 must equal bwd.sm_90a.128.tile_n = 128")
    fixed = tuning.replace("128: {tile_m: 64, tile_n: 64, warps: 4", "128: {tile_m: 64, tile_n: 128, warps: 4")
    assert {d.kernel for d in expand(tmp_path, spec, fixed)} == {"bwd", "bwd_dq"}


def test_a_tuning_row_may_list_several_tunings(tmp_path):
    tuning = GOOD_TUNING.replace("128: {tile_m: 128, tile_n: 64, warps: 4, stages: 2}",
                                 "128:\n      - {tile_m: 128, tile_n: 64, warps: 4, stages: 2}\n"
                                 "      - {tile_m: 64, tile_n: 64, warps: 4, stages: 2, relative_speed: 0.9}")
    variants = load_variants(write_specs(tmp_path, GOOD_SPEC, tuning))
    sm90_128 = [v for v in variants if v.descriptor.arch == "sm_90a" and v.descriptor.d_qk == 128]
    assert [(v.descriptor.tile_m, v.relative_speed) for v in sm90_128] == [(128, 1.0), (64, 0.9)]
    assert len({v.descriptor.hash for v in sm90_128}) == 2
    assert all(v.relative_speed == 1.0 for v in variants if v not in sm90_128)


@pytest.mark.parametrize("rows, key, message", [
    ("[{tile_m: 128, tile_n: 64, warps: 4, stages: 2, relative_speed: 0.9}]", "fwd.sm_90a.128.relative_speed",
     "the first tuning is the reference"),
    ("[{tile_m: 128, tile_n: 64, warps: 4, stages: 2}, {tile_m: 64, tile_n: 64, warps: 4, stages: 2, "
     "relative_speed: fast}]", "fwd.sm_90a.128.[1].relative_speed", "expected a number"),
    ("[{tile_m: 128, tile_n: 64, warps: 4, stages: 2}, {tile_m: 128, tile_n: 64, warps: 4, stages: 2, "
     "relative_speed: 0.9}]", "fwd.sm_90a.128.[1]", "repeats an earlier tuning"),
    ("[{tile_m: 128, tile_n: 64, warps: 4, stages: 2}, {tile_m: 64, tile_n: 64, warps: 4, stages: 2}]",
     "fwd.sm_90a.128.[1].relative_speed", "a later tuning needs its measured speed"),
])
def test_listed_tunings_are_checked(tmp_path, rows, key, message):
    tuning = GOOD_TUNING.replace("128: {tile_m: 128, tile_n: 64, warps: 4, stages: 2}", f"128: {rows}")
    error = spec_error(tmp_path, GOOD_SPEC, tuning)
    issue_for(error, key, message)
