"""Command line: `python -m flashkiln.generator {list,generate} ...`."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .build import DEFAULT_CACHE_DIR, GenerateError, generate, select
from .specs import SpecError, load_variants
from .toolchain import ToolchainError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashkiln.generator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_list = sub.add_parser("list", help="print each variant's name and hash")
    p_list.add_argument("--specs", type=Path, default=Path("specs"))
    p_list.add_argument("--filter", help="only variants whose name matches this regex")

    p_gen = sub.add_parser("generate", help="render, compile and write cubins plus manifest.json")
    p_gen.add_argument("--specs", type=Path, default=Path("specs"))
    p_gen.add_argument("--out", type=Path, default=Path("generated"))
    p_gen.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: all cores)")
    p_gen.add_argument("--filter", help="only variants whose name matches this regex")
    p_gen.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("FLASHKILN_BUILD_CACHE", DEFAULT_CACHE_DIR)))
    p_gen.add_argument("--no-progress", action="store_true")

    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            variants = select(load_variants(args.specs), args.filter)
            for v in variants:
                print(f"{v.descriptor.name}  {v.descriptor.hash}")
            print(f"{len(variants)} variant(s)", file=sys.stderr)
        else:
            generate(args.specs, args.out, args.jobs, args.filter, args.cache_dir, progress=not args.no_progress)
    except (SpecError, GenerateError, ToolchainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
