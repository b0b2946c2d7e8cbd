#!/usr/bin/env bash
# Build the fork wheel and install it, with all of upstream's dependencies, Ray
# and NIXL, into the project virtualenv (.venv). Re-running after editing a
# patch or a module rebuilds and reinstalls only the fork (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
RAY_VERSION=2.60.0
NIXL_VERSION=1.5.1   # nixl-cu13: matches the torch 2.14.1+cu130 sglang 0.5.23 pins

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

"$VENV/bin/python" python/fork_build.py --out dist
version=$("$VENV/bin/python" -c 'import tomllib; print(tomllib.load(open("python/pyproject.toml","rb"))["project"]["version"])')
tag=$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheel=$(ls dist/sglang-"$version"-"$tag"-*.whl)

# Dependencies: a no-op when they are already satisfied.
"${PIP[@]}" install -q "$wheel[ray]" "ray[default]==$RAY_VERSION" "nixl-cu13==$NIXL_VERSION" \
  pytest pytest-timeout
# The `nixl` meta package (what Ray imports) without its pull of both CUDA variants.
"${PIP[@]}" install -q --no-deps "nixl==$NIXL_VERSION"
# The fork itself, always (its version does not change between edits).
"${PIP[@]}" install -q --no-deps --force-reinstall "$wheel"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import nixl, ray, sglang
print(f"installed sglang {sglang.__version__} (ray {ray.__version__}, nixl {md.version('nixl')})")
PY
touch "$VENV/.fork-installed"
