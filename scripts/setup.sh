#!/usr/bin/env bash
# Set up a fresh machine for flagos: uthash (Debian's uthash-dev), PyTorch (2.13.0 CPU build
# when no torch is installed) and flagos itself with its test and example extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! echo '#include <uthash.h>' | cc -E -x c - >/dev/null 2>&1; then
    if command -v apt-get >/dev/null; then
        SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq uthash-dev
    else
        echo "uthash.h is missing: install uthash (Debian/Ubuntu: uthash-dev, macOS: brew install uthash)" >&2
        exit 1
    fi
fi

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    # Exactly this version: plain `torch` would pull a multi-GB CUDA build.
    "$PYTHON" -m pip install -q "torch==2.13.0"
fi

# The build uses the environment's setuptools (no isolated download of the build tools);
# pyproject.toml's SPDX license string needs setuptools >= 77.
"$PYTHON" -m pip install -q -c constraints.txt "setuptools>=77" wheel
# The extras at the versions the suite has passed on (constraints.txt; refreshed on purpose with
# scripts/refresh_constraints.py), so a library release cannot change what a fresh clone tests.
"$PYTHON" -m pip install -q --no-build-isolation -c constraints.txt -e ".[test,examples]"
