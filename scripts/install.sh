#!/usr/bin/env bash
# Build the fork wheel and install it, with all of upstream's dependencies, Ray
# and NIXL, into the project virtualenv (.venv). Re-running after editing a
# patch or a module rebuilds and reinstalls only the fork (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
SUPPORTED="Python 3.11 or 3.12"
RAY_VERSION=2.60.0
NIXL_VERSION=1.5.1   # nixl-cu13: matches the torch 2.14.1+cu130 sglang 0.5.23 pins

die() { echo "install.sh: $*" >&2; exit 1; }
# "3.11" for an interpreter that runs; fails for one that does not (a name not on
# PATH, or a pyenv shim for a version pyenv has not selected).
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }
supported() { [ "$1" = 3.11 ] || [ "$1" = 3.12 ]; }

# The interpreter of the venv: $PYTHON if set, else python3.11, else python3.12.
# An existing venv is reused as it is unless $PYTHON asks for another version.
if [ -z "${PYTHON:-}" ] && [ -x "$VENV/bin/python" ]; then
  py_ver=$(py_version "$VENV/bin/python" 2>/dev/null) \
    || die "$VENV/bin/python does not run; remove $VENV and run make install again"
  supported "$py_ver" || die "$VENV is Python $py_ver; the fork needs $SUPPORTED: remove $VENV"
else
  if [ -n "${PYTHON:-}" ]; then
    py_ver=$(py_version "$PYTHON" 2>&1) \
      || die "PYTHON=$PYTHON does not run (${py_ver%%$'\n'*}); the fork needs $SUPPORTED"
    supported "$py_ver" || die "PYTHON=$PYTHON is Python $py_ver; the fork needs $SUPPORTED"
  else
    for candidate in python3.11 python3.12; do
      if py_ver=$(py_version "$candidate" 2>/dev/null) && supported "$py_ver"; then
        PYTHON=$candidate
        break
      fi
    done
    [ -n "${PYTHON:-}" ] || die "neither python3.11 nor python3.12 runs here; the fork needs" \
      "$SUPPORTED (install one, or set PYTHON=/path/to/python3.11 or python3.12)"
  fi
  if [ -x "$VENV/bin/python" ]; then
    have=$(py_version "$VENV/bin/python" 2>/dev/null || echo "broken")
    [ "$have" = "$py_ver" ] \
      || die "$VENV is Python $have but PYTHON=$PYTHON is $py_ver: remove $VENV to switch"
  else
    echo "install.sh: creating $VENV with $PYTHON (Python $py_ver)"
    "$PYTHON" -m venv "$VENV"
  fi
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
