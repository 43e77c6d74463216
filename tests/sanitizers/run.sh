#!/usr/bin/env bash
# Sanitizer job: build flagos._C and the sim adapter with a sanitizer in a scratch copy of the
# tree and run the tests that drive the C router, the adapter loader and sim against them
# (the list, and why the plain runs leave those files out: selection.sh).
#   tests/sanitizers/run.sh address     AddressSanitizer (leak checking off: CPython and torch
#                                       keep allocations alive until exit by design)
#   tests/sanitizers/run.sh undefined   UndefinedBehaviorSanitizer (every finding fatal, and
#                                       without Python's -fwrapv, so signed overflow counts)
#   tests/sanitizers/run.sh address,undefined
#                                       both in one build and one pass of the tests (what
#                                       scripts/test.sh runs: half the time of two jobs)
set -euo pipefail
kind=${1:?usage: tests/sanitizers/run.sh address|undefined|address,undefined [pytest args]}
shift
runtimes=()
case "$kind" in
    address) runtimes=(libasan) ;;
    undefined) runtimes=(libubsan) ;;
    address,undefined) runtimes=(libasan libubsan) ;;
    *) echo "unknown sanitizer '$kind': use address, undefined or address,undefined" >&2; exit 2 ;;
esac
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
FLAGOS_SANITIZE=$kind "$PYTHON" setup.py build_ext --inplace >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
grep -q -- "-fsanitize=$kind" "$log" || { echo "the build did not use -fsanitize=$kind" >&2; exit 1; }
for lib in flagos/_C*.so flagos/adapters/libflagos_sim_adapter.so; do
    for runtime in "${runtimes[@]}"; do
        ldd "$lib" | grep "$runtime" >/dev/null || { echo "$lib was not built with $runtime" >&2; exit 1; }
    done
done
if [ "$kind" != undefined ]; then
    # libstdc++ is preloaded with the runtime so ASan's __cxa_throw interceptor can find the
    # real one (torch raises Python errors through C++ exceptions).
    export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
fi
if [ "$kind" != address ]; then
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1"
fi
export PYTHONPATH="$work"
"$PYTHON" -c "import flagos._C as c, sys; assert c.__file__.startswith('$work'), c.__file__"
# shellcheck source=selection.sh
. "$root/tests/sanitizers/selection.sh"
"$PYTHON" -m pytest -q -p no:cacheprovider --durations=10 $SANITIZED_CPU_TESTS "$@"
FLAGOS_TEST_CHIP=sim "$PYTHON" -m pytest -q -p no:cacheprovider --durations=5 $SANITIZED_SIM_TESTS "$@"
