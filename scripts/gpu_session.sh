#!/usr/bin/env bash
# Everything to run on a machine with an NVIDIA GPU, in one call, most telling first, inside
# one time budget (a lent GPU is often counted by the minute):
#
#   bash scripts/gpu_session.sh OUTDIR            # budget: GPU_SESSION_SECONDS, default 540
#
# 1. build flagos in place where it is not built (uthash: FLAGOS_UTHASH_INCLUDE, setup.py)
# 2. gpu_check's attention check in device mode (the fused kernel the cuda chip picks)
# 3. the per-op cost of the cuda chip against plain CUDA, with the floor (dispatch_overhead.py)
# 4. gpu_check in device mode, then in native mode (every check, full sizes)
# 5. the chip-dependent test files on the cuda chip (FLAGOS_TEST_CHIP=cuda, the CHIP_TESTS of
#    scripts/test.sh), one line per test as it runs, so a cut run still says what passed
#
# Each step gets at most its own limit and never more than what is left of the budget; a step
# that does not fit is skipped and said so. Every log and JSON file goes to OUTDIR, and all of
# them into OUTDIR/gpu_session.tar.gz as well (one file to fetch). The figures go to
# benchmarks/README.md by hand. Exit status 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/gpu_session.sh OUTDIR}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_SESSION_SECONDS:-540}
case "$BUDGET" in *[!0-9]*|"") echo "GPU_SESSION_SECONDS='$BUDGET' is not a number of seconds" >&2; exit 2 ;; esac
export PYTHONUNBUFFERED=1 NVIDIA_TF32_OVERRIDE=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
status=0

# step NAME LIMIT COMMAND...: run COMMAND with LIMIT seconds or what is left, its output in
# OUTDIR/NAME.log
step() {
    local name=$1 limit=$2 left
    shift 2
    left=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$left" -lt 20 ]; then
        echo "[$name] skipped: ${left} s of the budget left"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0 rc
    t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && status=1
    echo "[$name] exit $rc in $(( $(date +%s) - t0 )) s (limit $limit s)"
}

if ! ls flagos/_C*.so > /dev/null 2>&1; then
    step build 180 "$PYTHON" setup.py build_ext --inplace
fi
step attention 90 "$PYTHON" benchmarks/gpu_check.py --modes device --checks attention --quick \
    --json "$OUT/attention.json"
step dispatch_device 90 "$PYTHON" benchmarks/dispatch_overhead.py --chip cuda --mode device \
    --number 500 --repeat 5 --json "$OUT/dispatch_device.json"
step gpu_check_device 200 "$PYTHON" benchmarks/gpu_check.py --modes device --json "$OUT/gpu_check_device.json"
step gpu_check_native 150 "$PYTHON" benchmarks/gpu_check.py --modes native --json "$OUT/gpu_check_native.json"
CHIP_TESTS=$(sed -n 's/^CHIP_TESTS="\(.*\)"$/\1/p' scripts/test.sh)
# shellcheck disable=SC2086 # the list is words
step chip_tests 400 env FLAGOS_TEST_CHIP=cuda "$PYTHON" -m pytest -v -p no:cacheprovider -p no:randomly \
    --tb=short -rfE $CHIP_TESTS
grep -cE " PASSED" "$OUT/chip_tests.log" 2>/dev/null | sed 's/^/chip tests passed: /'
grep -E " (FAILED|ERROR)" "$OUT/chip_tests.log" 2>/dev/null | head -40
( cd "$OUT" && tar czf gpu_session.tar.gz --exclude gpu_session.tar.gz ./*.log ./*.json 2>/dev/null )
echo "gpu_session: $(( $(date +%s) - START )) s of $BUDGET; logs in $OUT (and $OUT/gpu_session.tar.gz)"
exit "$status"
