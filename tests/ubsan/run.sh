#!/usr/bin/env bash
# UndefinedBehaviorSanitizer job: build flagos._C and the sim adapter with UBSan (every finding
# fatal, and without Python's -fwrapv, so signed overflow counts) in a scratch copy of the tree
# and run the same tests as the ASan job (tests/asan/run.sh) against them.
set -euo pipefail
PYTHON=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for item in setup.py pyproject.toml README.md csrc flagos backends tests docs; do
    [ -e "$root/$item" ] && cp -r "$root/$item" "$work"/
done
find "$work" -name '*.so' -delete
cd "$work"
log="$work/build.log"
FLAGOS_SANITIZE=undefined "$PYTHON" setup.py build_ext --inplace >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
grep -q -- "-fsanitize=undefined" "$log" || { echo "the build did not use -fsanitize=undefined" >&2; exit 1; }
for lib in flagos/_C*.so flagos/adapters/libflagos_sim_adapter.so; do
    ldd "$lib" | grep libubsan >/dev/null || { echo "$lib was not built with UBSan" >&2; exit 1; }
done
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1"
export PYTHONPATH="$work"
"$PYTHON" -c "import flagos._C as c, sys; assert c.__file__.startswith('$work'), c.__file__"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_routes.py \
    tests/test_errors.py tests/test_native_mode.py tests/test_adapters.py tests/test_sim.py \
    tests/test_sim_fidelity.py "$@"
FLAGOS_TEST_CHIP=sim "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_device.py \
    tests/test_routes.py tests/test_errors.py "$@"
