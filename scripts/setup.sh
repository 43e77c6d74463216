#!/usr/bin/env bash
# Set up a fresh machine for flagos: uthash (Debian's uthash-dev), the OpenCL headers, ICD loader
# and PoCL (for the opencl chip), PyTorch (2.13.0 CPU build when no torch is installed) and
# flagos itself with its test and example extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
if ! echo '#include <uthash.h>' | cc -E -x c - >/dev/null 2>&1; then
    if command -v apt-get >/dev/null; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq uthash-dev
    else
        echo "uthash.h is missing: install uthash (Debian/Ubuntu: uthash-dev, macOS: brew install uthash)" >&2
        exit 1
    fi
fi

# The opencl chip: OpenCL headers, the ICD loader and PoCL (OpenCL on the CPU, what the suite's
# opencl run uses). Without them the build skips the opencl adapter and says so.
# (An ICD file names each installed OpenCL driver: headers without one give a chip with no device.)
if ! echo '#include <CL/cl.h>' | cc -E -x c - >/dev/null 2>&1 || ! ls /etc/OpenCL/vendors/*.icd >/dev/null 2>&1; then
    if command -v apt-get >/dev/null; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq ocl-icd-opencl-dev opencl-headers pocl-opencl-icd clinfo
    else
        echo "OpenCL headers or driver missing: the opencl chip will have no device or not be built (Debian/Ubuntu: apt-get install ocl-icd-opencl-dev opencl-headers pocl-opencl-icd)" >&2
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
