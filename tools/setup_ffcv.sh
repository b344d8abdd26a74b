#!/usr/bin/env bash
# Make FFCV's own virtual environment, the benchmark's peer: bash tools/setup_ffcv.sh [VENV]
#
# FFCV is never a dependency of mmcache. tools/ffcv_peer.py runs in this environment (default
# .venv-ffcv/ at the repository root) and tools/ffcv_bench.py calls it from mmcache's. Needs
# only apt and pip: FFCV 1.0.2 is an sdist whose C++ extension is compiled against the system's
# OpenCV and libturbojpeg, found with pkg-config. Idempotent: a second run installs nothing
# and checks the import again. PYTHON=python3.11 picks the interpreter (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-ffcv}"
PY="${PYTHON:-python3}"
CONSTRAINTS="$ROOT/tools/ffcv-constraints.txt"

say() { echo "setup_ffcv: $*"; }

# 1. System packages for the extension's build: a C++ compiler, pkg-config, and the headers and
#    .pc files of OpenCV (opencv4) and libturbojpeg.
packages=(g++ pkg-config libturbojpeg0-dev libopencv-dev)
include="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
prefix="$("$PY" -c 'import sys; print(sys.base_prefix)')"
if [ ! -f "$include/Python.h" ]; then
    [ "$prefix" = /usr ] || { say "no Python.h in $include for $PY"; exit 1; }
    packages+=(python3-dev)
fi
if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    [ "$prefix" = /usr ] || { say "$PY lacks the venv module"; exit 1; }
    packages+=(python3-venv)
fi
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    say "apt-get install ${missing[*]}"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}"
fi
for pc in libturbojpeg "opencv4 opencv"; do
    found=""
    for name in $pc; do pkg-config --exists "$name" && found="$name" && break; done
    [ -n "$found" ] || { say "pkg-config finds none of: $pc"; exit 1; }
done

# 2. The environment. torch 2.13.0 (CPU) is the one mmcache's environment uses; FFCV imports it.
if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    say "creating $VENV"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi
# The constraints keep numpy below 2 (see the file): FFCV 1.0.2 was written for numpy 1.x.
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" torch==2.13.0 "numpy<2"
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" ffcv==1.0.2 pillow

# 3. The check, from / so that no folder named ffcv shadows the installed package.
cd /
"$VENV/bin/python" -c 'import ffcv; from ffcv.loader import Loader'
"$VENV/bin/python" -c '
from importlib.metadata import version
print("setup_ffcv: ok:", ", ".join(f"{n} {version(n)}" for n in ("ffcv", "numba", "numpy", "torch", "opencv-python")))
'
