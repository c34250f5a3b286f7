"""Command line of the runtime: `python -m flashkiln {list,verify,cache list,cache clear}`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .archs import ARCHS
from .errors import FlashkilnError
from .jit import JitCache
from .registry import KernelRegistry


def per_arch(kernels) -> dict[str, tuple[int, int]]:
    """(variants, cubin bytes) per arch of the manifest's kernels, in ARCHS order."""
    counts = {a: (sum(e.arch == a for e in kernels), sum({e.cubin: e.cubin_bytes for e in kernels
                                                         if e.arch == a}.values())) for a in ARCHS}
    return {a: c for a, c in counts.items() if c[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashkiln", description=__doc__)
    parser.add_argument("--kernel-dir", type=Path, help="default: $FLASHKILN_KERNEL_DIR, the packaged kernels, "
                                                        "or the checkout's generated/")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the variants of the installed kernels: name, hash, arch")
    sub.add_parser("verify", help="check every cubin against the manifest's sha256")
    cache = sub.add_parser("cache", help="the JIT cache")
    cache.add_argument("action", choices=["list", "clear"])
    args = parser.parse_args(argv)
    try:
        if args.command == "cache":
            jit_cache = JitCache()
            if args.action == "list":
                entries = jit_cache.entries()
                for e in entries:
                    print(f"{e.name}  {e.hash}  {e.cubin_bytes} bytes  {e.cubin}")
                print(f"{len(entries)} JIT entr{'y' if len(entries) == 1 else 'ies'} in {jit_cache.root}",
                      file=sys.stderr)
            else:
                print(f"removed {jit_cache.clear()} file(s) from {jit_cache.root}")
            return 0
        registry = KernelRegistry(args.kernel_dir)
        if args.command == "list":
            for e in registry.manifest.kernels:
                print(f"{e.name}  {e.hash}  {e.arch}")
            for arch, (count, size) in per_arch(registry.manifest.kernels).items():
                runs_on = ", ".join(f"{c[0]}.{c[1]}" for c in ARCHS[arch].capabilities())
                print(f"{arch}: {count} variant(s), {size / 2**20:.1f} MiB of cubins (runs on compute capability "
                      f"{runs_on})", file=sys.stderr)
            build = registry.manifest.build
            print(f"{len(registry.manifest.kernels)} variant(s) in {registry.directory} (flashkiln "
                  f"{build.get('flashkiln_version')}, {build.get('cuda_flavor')}, NVRTC "
                  f"{build.get('toolchain', {}).get('nvrtc')})", file=sys.stderr)
            return 0
        problems = registry.verify()
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(registry.manifest.kernels)} variant(s) checked: "
              + ("all cubins match the manifest" if not problems else f"{len(problems)} problem(s)"))
        return 1 if problems else 0
    except FlashkilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
