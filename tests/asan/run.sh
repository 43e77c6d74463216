#!/usr/bin/env bash
# AddressSanitizer job: build flagos._C and the sim adapter with ASan in a scratch copy of the
# tree and run the tests that drive the C router (unwrap, routes, fallback, report, errors),
# the adapter loader (broken adapters included) and sim against them.
# Leak checking is off: CPython and torch keep allocations alive until exit by design.
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
FLAGOS_SANITIZE=address "$PYTHON" setup.py -q build_ext --inplace 2>&1 | grep -v -i deprecat || true
for lib in flagos/_C*.so flagos/adapters/libflagos_sim_adapter.so; do
    ldd "$lib" | grep -q libasan || { echo "$lib was not built with ASan" >&2; exit 1; }
done
# libstdc++ is preloaded with the runtime so ASan's __cxa_throw interceptor can find the
# real one (torch raises Python errors through C++ exceptions).
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
export PYTHONPATH="$work"
"$PYTHON" -c "import flagos._C as c, sys; assert c.__file__.startswith('$work'), c.__file__"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_routes.py \
    tests/test_errors.py tests/test_native_mode.py tests/test_adapters.py tests/test_sim.py \
    tests/test_sim_fidelity.py "$@"
FLAGOS_TEST_CHIP=sim "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_device.py \
    tests/test_routes.py tests/test_errors.py "$@"
