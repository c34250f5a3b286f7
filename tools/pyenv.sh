#!/usr/bin/env bash
# Run a command with `flashkiln` importable straight from this source tree, without installing
# anything: for GPU machines that have torch and cuda-bindings but no package registry.
# The import names map runtime/ -> flashkiln and generator/ -> flashkiln.generator (as in
# pyproject.toml), so a link farm under build/pypath mirrors that mapping.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pkg="$root/build/pypath/flashkiln"
rm -rf "$root/build/pypath"
mkdir -p "$pkg"
for f in "$root"/runtime/*; do ln -s "$f" "$pkg/"; done
ln -s "$root/generator" "$pkg/generator"
export PYTHONPATH="$root/build/pypath${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
