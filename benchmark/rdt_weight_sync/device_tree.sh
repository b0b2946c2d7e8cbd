#!/usr/bin/env bash
# What a GPU machine without sglang's dependencies needs on PYTHONPATH, besides
# this checkout's python/ (the fork's new modules) and Ray + NIXL
# (../shared/device/build_bundle.sh): sglang's own sglang/srt/environ.py, as
# the fork's patch series leaves it, taken from a freshly built fork wheel.
# It is the one upstream module the weight-sync core imports (sglang's envs).
#
#   usage, from the project root:  benchmark/rdt_weight_sync/device_tree.sh [OUT]
#   (default OUT: .devpkg/overlay); then PYTHONPATH=OUT:$PWD/python:<ray+nixl>
set -euo pipefail
out=${1:-.devpkg/overlay}
python=${PYTHON:-.venv/bin/python}
dist=$(mktemp -d)
"$python" python/fork_build.py --out "$dist" >/dev/null
mkdir -p "$out/sglang/srt"
unzip -p "$dist"/sglang-*.whl sglang/srt/environ.py > "$out/sglang/srt/environ.py"
rm -rf "$dist"
echo "wrote $out/sglang/srt/environ.py"
