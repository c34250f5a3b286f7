#!/usr/bin/env bash
# Run a command with `flashkiln` importable straight from this source tree, without installing
# anything: for GPU machines that have torch and cuda-bindings but no package registry.
# The import names map runtime/ -> flashkiln and generator/ -> flashkiln.generator (as in
# pyproject.toml), so a link farm mirrors that mapping: one per call, under build/pypath, so that
# calls running side by side (sanitizers beside the tests) never rebuild each other's.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/build/pypath"
farm=$(mktemp -d "$root/build/pypath/call.XXXXXX")
trap 'rm -rf "$farm"' EXIT
trap 'exit 130' INT  # so that the farm goes when `timeout` or ^C stops the call
trap 'exit 143' TERM
mkdir "$farm/flashkiln"
for f in "$root"/runtime/*; do ln -s "$f" "$farm/flashkiln/"; done
ln -s "$root/generator" "$farm/flashkiln/generator"
export PYTHONPATH="$farm${PYTHONPATH:+:$PYTHONPATH}"
"$@"
