#!/usr/bin/env bash
# The suite on the lowest supported Python (3.10: the C code uses Py_NewRef and
# PyModule_AddObjectRef) and the lowest PyTorch with device mode (2.10; set TORCH_VERSION=2.9.1
# for the lowest one flagos accepts, where device-mode tests skip and native mode runs).
#
# Builds a virtual environment in a scratch folder, installs PyTorch's CPU build of that
# version from PyTorch's CPU index (TORCH_INDEX; PyPI's Linux wheels are CUDA builds of about
# 1 GB that pull several GB of nvidia packages), builds flagos in a scratch copy of the tree
# and runs the cpu suite and the chip tests on sim. See docs/testing.md.
#
#   bash scripts/lowest_versions.sh                 # python3.10, torch 2.10.0
#   PYTHON=/path/to/python3.10 TORCH_VERSION=2.9.1 bash scripts/lowest_versions.sh -x
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
TORCH_VERSION=${TORCH_VERSION:-2.10.0}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
is_310() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
    is_310 "$PYTHON" || { echo "PYTHON=$PYTHON is not Python 3.10" >&2; exit 1; }
else
    for candidate in "$HOME"/.pyenv/versions/3.10*/bin/python3.10 python3.10; do
        if is_310 "$candidate"; then PYTHON=$candidate; break; fi
    done
    [ -n "${PYTHON:-}" ] || { echo "no Python 3.10 found: set PYTHON to one" >&2; exit 1; }
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "== Python $("$PYTHON" -c 'import platform; print(platform.python_version())'), torch $TORCH_VERSION (CPU) in $work"
"$PYTHON" -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip "setuptools>=77" wheel
"$py" -m pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX" || {
    echo "could not install torch==$TORCH_VERSION (CPU build) from $TORCH_INDEX;" \
         "set TORCH_INDEX to a reachable mirror of PyTorch's CPU index" >&2; exit 1; }
"$py" -m pip install -q "pytest>=7" "diffusers>=0.30" "transformers>=4.44" "numpy"
"$py" -c "import torch; v = torch.__version__; assert v.split('+')[0] == '$TORCH_VERSION', v; print('torch', v)"

for item in setup.py pyproject.toml README.md csrc flagos backends tests docs examples; do
    cp -r "$root/$item" "$work/"
done
find "$work" -name '*.so' -delete
cd "$work"
"$py" setup.py -q build_ext --inplace
export PYTHONPATH="$work"
"$py" -c "import flagos._C as c; assert c.__file__.startswith('$work'), c.__file__"
CHIP_TESTS="tests/test_device.py tests/test_routes.py tests/test_errors.py tests/test_models.py"
"$py" -m pytest -q -p no:cacheprovider tests "$@"
FLAGOS_TEST_CHIP=sim "$py" -m pytest -q -p no:cacheprovider $CHIP_TESTS "$@"
echo "== lowest versions: the suite passed on Python 3.10 and torch $TORCH_VERSION"
