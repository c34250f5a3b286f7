"""Command line: `python -m flashkiln.generator {list,generate,merge,wheel} ...`."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .build import (DEFAULT_CACHE_DIR, GenerateError, MergeError, Selection, generate, merge, parse_archs, parse_shard,
                    plan_units)
from .render import PROBES
from .specs import SETS, SpecError, load_variants
from .toolchain import ToolchainError


def _selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--specs", type=Path, default=Path("specs"))
    parser.add_argument("--filter", help="only variants whose name matches this regex")
    parser.add_argument("--exclude", help="drop variants whose name matches this regex")
    parser.add_argument("--archs", type=parse_archs, help="only these archs, comma-separated (e.g. sm_80,sm_90a; "
                                                          "default: every arch the specs list)")
    parser.add_argument("--set", choices=SETS, default="default",
                        help="default: every spec group without `set: full`; full: every group")


def _build_args(parser: argparse.ArgumentParser) -> None:
    _selection_args(parser)
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: all cores)")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("FLASHKILN_BUILD_CACHE", DEFAULT_CACHE_DIR)))
    parser.add_argument("--no-progress", action="store_true")


def _selection(args: argparse.Namespace, shard: tuple[int, int] | None = None) -> Selection:
    return Selection(args.filter, args.exclude, shard, args.archs, full=args.set == "full")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashkiln.generator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_list = sub.add_parser("list", help="print each variant's name and hash")
    _selection_args(p_list)

    p_gen = sub.add_parser("generate", help="render, compile and write cubins plus manifest.json")
    _build_args(p_gen)
    p_gen.add_argument("--out", type=Path, default=Path("generated"))
    p_gen.add_argument("--shard", type=parse_shard, help="i/n: build only shard i of n (merge them with `merge`)")
    p_gen.add_argument("--list", action="store_true", help="print the compile units and variants it would build, "
                                                           "compile nothing")
    p_gen.add_argument("--quiet", action="store_true", help="no per-unit report")
    p_gen.add_argument("--probe", action="append", default=[], choices=sorted(PROBES),
                       help="compile a measurement probe into every kernel (tools/bwd_timeline.py reads `timeline`); "
                            "such a build is for measuring, not for shipping")

    p_merge = sub.add_parser("merge", help="combine the outputs of sharded generate runs")
    p_merge.add_argument("--out", type=Path, required=True)
    p_merge.add_argument("shards", type=Path, nargs="+")

    p_wheel = sub.add_parser("wheel", help="build a wheel of the runtime with the specs' cubins")
    _build_args(p_wheel)
    p_wheel.add_argument("--out", type=Path, default=Path("dist"))
    p_wheel.add_argument("--per-arch", action="store_true", help="one wheel per arch instead of one of them all")

    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            variants = _selection(args).variants(load_variants(args.specs))
            for v in variants:
                print(f"{v.descriptor.name}  {v.descriptor.hash}")
            print(f"{len(variants)} variant(s)", file=sys.stderr)
        elif args.command == "generate":
            selection = _selection(args, args.shard)
            if args.list:
                units = plan_units(args.specs, selection, tuple(args.probe))
                for unit in units:
                    print(f"{unit.name}: " + " ".join(v.descriptor.name for v in unit.variants))
                print(f"{sum(len(u.variants) for u in units)} variant(s) in {len(units)} unit(s)", file=sys.stderr)
            else:
                generate(args.specs, args.out, args.jobs, selection, args.cache_dir, progress=not args.no_progress,
                         report=not args.quiet, probes=tuple(args.probe))
        elif args.command == "merge":
            merge(args.out, args.shards)
        else:
            from .wheel import build_wheel, build_wheels_per_arch

            build = build_wheels_per_arch if args.per_arch else build_wheel
            build(args.specs, args.out, args.jobs, _selection(args),
                  args.cache_dir, progress=not args.no_progress)
    except (SpecError, GenerateError, MergeError, ToolchainError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
