"""Spec files: YAML that enumerates kernel variants, validated and expanded into descriptors.

A spec file (specs/*.yaml) names a family, its tuning table and groups of functional axes:

    family: portable
    tuning: tuning/portable.yaml
    variants:
      - kernel: [fwd]
        arch: [sm_80, sm_90a]
        dtype: [fp16, bf16]
        head_dims: [64, 128, [192, 128]]   # d, or [d_qk, d_v]
        causal: [none, bottom_right]
        bias: [none]                        # optional, default [none]
        deterministic: [false]              # optional, default [false]
        packed: [false]                     # optional, default [false]: a kernel for packed batches
        set: full                           # optional: built only in the full set (below)
    exclude:                                # optional: partial matches removed from the product
      - {arch: sm_80, head_dims: 256}

Each group expands to its cross product, minus the excludes. A group with `set: full` belongs to
the full set only (`generate --set full`, `make generate SET=full`): kernels a build may do
without, such as one family's duplicates of what another family covers on the same arch. The
tuning table gives each (kernel, arch, head dims) its performance fields; a group may name a table of its own
(`tuning: tuning/x.yaml` beside its axes) for variants that need other tiles (say, with a bias):

    fwd:
      sm_90a:
        128: {tile_m: 128, tile_n: 64, warps: 4, stages: 1}
        192x128: {...}

A row may also be a list of tunings: each becomes a kernel of its own, and the runtime picks one
per call by shape (flashkiln.tile_choice). Every tuning after the first gives its measured
`relative_speed` against the first on equal work (other than 1, which marks the first):

        64:
          - {tile_m: 192, tile_n: 128, warps: 16, stages: 2}
          - {tile_m: 128, tile_n: 128, warps: 12, stages: 2, relative_speed: 0.88}

Every error names its file, line and key; all errors are reported together.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from flashkiln import descriptor as D
from flashkiln.descriptor import VariantDescriptor

from . import located_yaml
from .families import FAMILIES
from .located_yaml import LocatedDict, LocatedList, Where, YamlSyntaxError

SPEC_KEYS = ("family", "tuning", "variants", "exclude")
SETS = ("default", "full")  # the default set is every group without `set: full`; the full set is all
# A group's axes, from the descriptor's table (d_qk and d_v share head_dims; the family is the file's).
AXES = tuple(dict.fromkeys(a.spec_key for a in D.AXES if a.spec_key))
REQUIRED_AXES = tuple(dict.fromkeys(a.spec_key for a in D.AXES if a.spec_key and a.spec_required))
AXIS_DEFAULTS = {a.spec_key: [a.default] for a in D.AXES if a.spec_key and not a.spec_required}
AXIS_DOMAINS: dict[str, tuple] = {a.spec_key: a.domain for a in D.AXES if a.spec_key and a.spec_key != "head_dims"}

@dataclass(frozen=True)
class SpecIssue:
    where: Where
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.key}: {self.message}"


class SpecError(ValueError):
    """One or more problems in the spec files; `issues` holds each with file, line and key."""

    def __init__(self, issues: list[SpecIssue]):
        self.issues = issues
        super().__init__(f"{len(issues)} problem(s) in the specs:\n" + "\n".join(f"  {i}" for i in issues))


@dataclass(frozen=True)
class Variant:
    """One expanded variant and the spec that asked for it."""

    descriptor: VariantDescriptor
    spec_file: str
    where: Where
    relative_speed: float = 1.0  # of this tuning against the variant's first (tile_choice)
    full_only: bool = False  # its group says `set: full`


@dataclass
class _Collector:
    issues: list[SpecIssue] = field(default_factory=list)

    def add(self, where: Where, key: str, message: str) -> None:
        issue = SpecIssue(where, key, message)
        if issue not in self.issues:  # one problem shared by many expanded variants is reported once
            self.issues.append(issue)


def head_dims_key(d_qk: int, d_v: int) -> str:
    """The tuning-table key of a head-dim pair: '128', or '192x128' when they differ."""
    return str(d_qk) if d_qk == d_v else f"{d_qk}x{d_v}"


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list) else [value]


def _parse_head_dims(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (value[0], value[1])
    return None


def _check_keys(mapping: LocatedDict, allowed: Iterable[str], context: str, out: _Collector) -> None:
    allowed = tuple(allowed)
    for key in mapping:
        if key not in allowed:
            out.add(mapping.key_where[key], f"{context}{key}", f"unknown key (expected one of: {', '.join(allowed)})")


def _axis_values(group: LocatedDict, axis: str, context: str, out: _Collector) -> list:
    """The validated values of one axis of a variant group (head dims as (d_qk, d_v) pairs)."""
    if axis not in group and axis not in AXIS_DEFAULTS:
        return []  # a missing required axis is reported once, by the caller
    raw = group.get(axis, AXIS_DEFAULTS.get(axis))
    where = group.key_where.get(axis, group.where)
    values = _as_list(raw)
    if not values:
        out.add(where, f"{context}{axis}", "empty list: the group would expand to nothing")
        return []
    parsed = []
    for value in values:
        if axis == "head_dims":
            dims = _parse_head_dims(value)
            if dims is None:
                out.add(where, f"{context}{axis}", f"{value!r}: expected d or [d_qk, d_v]")
            elif any(d not in D.AXIS["d_qk"].domain or d not in D.AXIS["d_v"].domain for d in dims):
                out.add(where, f"{context}{axis}",
                        f"{value!r}: unsupported head dim (supported: {', '.join(map(str, D.HEAD_DIMS))})")
            else:
                parsed.append(dims)
            continue
        domain = AXIS_DOMAINS[axis]
        if value not in domain or isinstance(value, bool) != isinstance(domain[0], bool):
            out.add(where, f"{context}{axis}",
                    f"unsupported value {value!r} (supported: {', '.join(map(str, domain))})")
        else:
            parsed.append(value)
    return parsed


def _matches(exclude: dict[str, Any], fields: dict[str, Any]) -> bool:
    return all(fields[k] == v for k, v in exclude.items())


def _parse_excludes(spec: LocatedDict, out: _Collector) -> list[dict[str, Any]]:
    excludes = []
    for i, item in enumerate(_as_list(spec.get("exclude", []))):
        context = f"exclude[{i}]."
        if not isinstance(item, LocatedDict) or not item:
            out.add(spec.key_where.get("exclude", spec.where), f"exclude[{i}]", "expected a mapping of axis: value")
            continue
        _check_keys(item, AXES, context, out)
        rule = {}
        for axis in item:
            if axis not in AXES:
                continue
            values = _axis_values(item, axis, context, out)
            if len(values) != 1:
                out.add(item.key_where[axis], f"{context}{axis}", "an exclude names a single value per axis")
                continue
            rule["d_qk_d_v" if axis == "head_dims" else axis] = values[0]
        excludes.append(rule)
    return excludes


def _load_tuning(path: Path, display: str, out: _Collector) -> LocatedDict | None:
    if not path.is_file():
        return None
    try:
        table = located_yaml.load(path, display)
    except YamlSyntaxError as exc:
        out.add(exc.where, "(file)", str(exc))
        return None
    if not isinstance(table, LocatedDict):
        out.add(Where(display, 1), "tuning", "expected a mapping kernel -> arch -> head dims -> fields")
        return None
    for kernel in table:
        if kernel not in D.KERNELS:
            out.add(table.key_where[kernel], str(kernel), f"unknown kernel (expected one of: {', '.join(D.KERNELS)})")
    return table


def tuning_rows(table: dict, kernel: str, arch: str, dims: tuple[int, int]) -> list | None:
    """The tunings of (kernel, arch, head dims) in a tuning table (a row or a list of rows), or None."""
    row: Any = table
    for key in (kernel, arch, head_dims_key(*dims)):
        if not isinstance(row, dict):
            return None
        # YAML reads `128:` as an int key, `192x128:` as a string key.
        row = row.get(key, row.get(int(key)) if isinstance(key, str) and key.isdigit() else None)
    rows = row if isinstance(row, list) else [row]
    return rows if rows and all(isinstance(r, dict) for r in rows) else None


def tuning_row(table: dict, kernel: str, arch: str, dims: tuple[int, int]) -> dict | None:
    """The first (default) tuning of (kernel, arch, head dims) in a tuning table, or None."""
    rows = tuning_rows(table, kernel, arch, dims)
    return rows[0] if rows else None


def _relative_speed(row: LocatedDict, first: bool, context: str, out: _Collector) -> float:
    speed = row.get("relative_speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed <= 4:
        out.add(row.where, f"{context}relative_speed", f"{speed!r}: expected a number in (0, 4]")
        return 1.0
    if first and speed != 1:
        out.add(row.where, f"{context}relative_speed", "the first tuning is the reference: its speed is 1")
    if not first and speed == 1:  # also when left out
        out.add(row.where, f"{context}relative_speed",
                "a later tuning needs its measured speed against the first, other than 1 (the runtime "
                "tells a variant's first tuning by its speed of 1)")
    return float(speed)


def _descriptor(fields: dict[str, Any], row: LocatedDict, context: str, group_where: Where, group_context: str,
                out: _Collector) -> VariantDescriptor | None:
    _check_keys(row, (*D.PERFORMANCE_FIELDS, "relative_speed"), context, out)
    missing = [k for k in D.PERFORMANCE_FIELDS if k not in row]
    if missing:
        out.add(row.where, context.rstrip("."), f"missing performance field(s): {', '.join(missing)}")
        return None
    perf = {k: row[k] for k in D.PERFORMANCE_FIELDS}
    problems = D.validation_errors({**fields, **perf})
    if problems:
        for p in problems:
            out.add(row.where, context.rstrip("."), p)
        return None
    desc = VariantDescriptor(**fields, **perf)
    family = FAMILIES[desc.family]
    functional = family.functional_errors(desc)
    for p in functional:
        out.add(group_where, group_context, p)
    for p in family.tuning_errors(desc):
        out.add(row.where, context.rstrip("."), p)
    return None if functional else desc


def _check_shared_tiles(tuning: LocatedDict, fields: dict[str, Any], row: LocatedDict, context: str,
                        out: _Collector) -> None:
    """A kernel that follows another's tiles (family.shared_tiles) must repeat the fields it shares."""
    shared = FAMILIES[fields["family"]].shared_tiles.get(fields["kernel"])
    if shared is None:
        return
    leader, keys = shared
    dims = (fields["d_qk"], fields["d_v"])
    leader_row = tuning_row(tuning, leader, fields["arch"], dims) or {}
    for key in keys:
        if key in row and row[key] != leader_row.get(key):
            out.add(row.where, f"{context}{key}",
                    f"{row[key]} must equal {leader}.{fields['arch']}.{head_dims_key(*dims)}.{key} = "
                    f"{leader_row.get(key, '(missing)')}: {fields['kernel']} works on the tiles {leader} makes")


def _tuning_of(mapping: LocatedDict, context: str, display: str, specs_root: Path,
               out: _Collector) -> tuple[LocatedDict | None, str]:
    """The tuning table a spec (or one of its groups) names under `tuning`, and its display path."""
    name = mapping.get("tuning")
    if not isinstance(name, str):
        if "tuning" in mapping:
            out.add(mapping.key_where["tuning"], context, "expected a path relative to the specs directory")
        return None, ""
    tuning_display = str(Path(display).parent / name)
    tuning = _load_tuning(specs_root / name, tuning_display, out)
    if tuning is None and not any(i.where.file == tuning_display for i in out.issues):
        out.add(mapping.key_where["tuning"], context, f"tuning table {tuning_display} does not exist")
    return tuning, tuning_display


def _expand_spec(path: Path, display: str, specs_root: Path, out: _Collector) -> list[Variant]:
    try:
        spec = located_yaml.load(path, display)
    except YamlSyntaxError as exc:
        out.add(exc.where, "(file)", str(exc))
        return []
    if not isinstance(spec, LocatedDict):
        out.add(Where(display, 1), "(file)", "expected a mapping with keys: " + ", ".join(SPEC_KEYS))
        return []
    _check_keys(spec, SPEC_KEYS, "", out)
    for key in ("family", "tuning", "variants"):
        if key not in spec:
            out.add(spec.where, key, "required key is missing")
    family = spec.get("family")
    if "family" in spec and family not in FAMILIES:
        out.add(spec.key_where["family"], "family",
                f"unknown family {family!r} (expected one of: {', '.join(FAMILIES)})")
        return []
    spec_tuning = _tuning_of(spec, "tuning", display, specs_root, out)

    groups = spec.get("variants", [])
    if not isinstance(groups, LocatedList):
        out.add(spec.key_where.get("variants", spec.where), "variants", "expected a list of variant groups")
        return []
    excludes = _parse_excludes(spec, out)

    variants: list[Variant] = []
    for gi, group in enumerate(groups):
        context = f"variants[{gi}]."
        where = groups.item_where[gi]
        if not isinstance(group, LocatedDict):
            out.add(where, f"variants[{gi}]", "expected a mapping of axis: [values]")
            continue
        _check_keys(group, (*AXES, "tuning", "set"), context, out)
        group_set = group.get("set", "default")
        if group_set not in SETS:
            out.add(group.key_where["set"], f"{context}set", f"expected one of: {', '.join(SETS)}")
        tuning, tuning_path = spec_tuning
        if "tuning" in group:
            tuning, tuning_path = _tuning_of(group, f"{context}tuning", display, specs_root, out)
        for axis in REQUIRED_AXES:
            if axis not in group:
                out.add(group.where, f"{context}{axis}", "required axis is missing")
        axes = {axis: _axis_values(group, axis, context, out) for axis in AXES}
        if any(not v for v in axes.values()):
            continue
        for combo in itertools.product(*(axes[a] for a in AXES)):
            fields = dict(zip(AXES, combo))
            d_qk, d_v = fields.pop("head_dims")
            fields.update(family=family, d_qk=d_qk, d_v=d_v)
            if any(_matches(rule, {**fields, "d_qk_d_v": (d_qk, d_v)}) for rule in excludes):
                continue
            if tuning is None:
                continue
            rows = tuning_rows(tuning, fields["kernel"], fields["arch"], (d_qk, d_v))
            if rows is None:
                out.add(where, f"variants[{gi}]",
                        f"no tuning for {fields['kernel']} {fields['arch']} head dims "
                        f"{head_dims_key(d_qk, d_v)} in {tuning_path} "
                        f"(add {fields['kernel']}: {fields['arch']}: {head_dims_key(d_qk, d_v)}: "
                        f"{{{', '.join(f'{k}: ...' for k in D.PERFORMANCE_FIELDS)}}})")
                continue
            seen = set()  # descriptor hashes of this row's tunings
            for ri, row in enumerate(rows):
                row_context = f"{fields['kernel']}.{fields['arch']}.{head_dims_key(d_qk, d_v)}." + \
                    (f"[{ri}]." if len(rows) > 1 else "")
                _check_shared_tiles(tuning, fields, row, row_context, out)
                speed = _relative_speed(row, ri == 0, row_context, out)
                desc = _descriptor(fields, row, row_context, where, f"variants[{gi}]", out)
                if desc is None:
                    continue
                if desc.hash in seen:
                    out.add(row.where, row_context.rstrip("."), "repeats an earlier tuning of the same row")
                    continue
                seen.add(desc.hash)
                variants.append(Variant(desc, display, where, speed, group_set == "full"))
    if not variants and not out.issues:
        out.add(spec.where, "variants", "the spec expands to no variant (everything excluded?)")
    return variants


def spec_files(specs_dir: Path) -> list[Path]:
    """The variant specs of a directory: its top-level *.yaml (tuning tables live below it)."""
    return sorted(p for p in specs_dir.glob("*.yaml") if p.is_file())


def load_variants(specs_dir: Path, files: list[Path] | None = None) -> list[Variant]:
    """Validate and expand every spec; raise SpecError naming all problems at once."""
    specs_dir = Path(specs_dir)
    files = spec_files(specs_dir) if files is None else files
    out = _Collector()
    if not files:
        out.add(Where(str(specs_dir), 0), "(specs)", "no spec files (*.yaml) found")
    variants: list[Variant] = []
    for path in files:
        display = str(Path(specs_dir.name) / path.relative_to(specs_dir)) if path.is_relative_to(specs_dir) else str(path)
        variants.extend(_expand_spec(path, display, specs_dir, out))
    if out.issues:
        raise SpecError(out.issues)
    # Identical descriptors asked for twice (overlapping groups or files) are built once, in the
    # default set where any group that asks for them is in it.
    unique: dict[str, Variant] = {}
    for v in variants:
        if v.descriptor.hash not in unique or (unique[v.descriptor.hash].full_only and not v.full_only):
            unique[v.descriptor.hash] = v
    return list(unique.values())
