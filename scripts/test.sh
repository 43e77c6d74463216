#!/usr/bin/env bash
# The test suite: everything in device mode on the cpu chip (with native mode, autoload, the
# adapter ABI and the real models), the chip-dependent tests again on the emulated accelerator
# sim and on the opencl chip (PoCL), and one AddressSanitizer + UndefinedBehaviorSanitizer job
# over the C router, the loader and the sim adapter.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CHIP_TESTS="tests/test_redirect.py tests/test_device.py tests/test_routes.py tests/test_errors.py tests/test_models.py tests/test_fidelity.py tests/test_ecosystem.py tests/test_autocast.py tests/test_policy.py tests/test_fallback_counters.py tests/test_fallback_staging.py tests/test_offload.py tests/test_accelerate.py tests/test_generators.py tests/test_streams.py tests/test_compile.py tests/test_cli_analyze.py tests/test_report_html.py tests/test_cli_compare.py tests/test_backward_errors.py tests/test_live_params.py tests/test_precision_policy.py tests/test_distributed.py tests/test_sharding.py tests/test_sequence_models.py tests/test_module_kinds.py tests/test_flex_attention.py tests/test_module_db.py tests/test_optim_db.py tests/test_examples.py"
# Random test order (pytest-randomly), so a test that depends on another's leftovers fails; the
# seed is printed first. FLAGOS_TEST_SEED picks it: an integer to repeat an
# order, "random" for a new one each run. The default is an order the whole suite has passed in.
SEED=${FLAGOS_TEST_SEED:-20261202}
[ "$SEED" = random ] && SEED=$(( (RANDOM << 15) | RANDOM ))
case "$SEED" in
    *[!0-9]*|"") echo "FLAGOS_TEST_SEED='$SEED' is not a seed: use an integer such as 7, or random" >&2; exit 2 ;;
esac
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -p randomly --randomly-seed=$SEED"
echo "test order: --randomly-seed=$SEED (repeat it with FLAGOS_TEST_SEED=$SEED bash scripts/test.sh)"
# Each file runs once per chip: the files the sanitizer job runs (tests/sanitizers/selection.sh)
# run there, in the instrumented build, and not again in the plain runs of the same chip.
. tests/sanitizers/selection.sh
# cpu-chip files that run in the second lane, to even out the lanes (none now: the sim and
# opencl runs made the second lane the longer one).
SECOND_LANE_CPU_TESTS=""
CPU_RUN="tests $(for f in $SECOND_LANE_CPU_TESTS $SANITIZED_CPU_TESTS; do printf -- '--ignore=%s ' "$f"; done)"
# The opencl run: what depends on the chip (its kernels, its memory, which is not the host's, its
# errors and fork rules). The files whose subject is a mechanism the same on every chip of its
# kind (errors inside backward, the CUDA redirect, the CLI tools and report pages, the process
# group, the refusals of compile and of flex_attention on C-ABI chips) run on the cpu chip and
# on sim only.
SAME_ON_EVERY_ADAPTER="tests/test_backward_errors.py tests/test_redirect.py tests/test_cli_analyze.py
    tests/test_cli_compare.py tests/test_report_html.py tests/test_distributed.py tests/test_compile.py
    tests/test_flex_attention.py"
# The files of list $1 that list $2 does not name.
without() {
    local skip=" $(echo $2) " f
    for f in $1; do case "$skip" in *" $f "*) ;; *) printf '%s ' "$f" ;; esac; done
}
OPENCL_RUN=$(without "$CHIP_TESTS" "$SAME_ON_EVERY_ADAPTER")
SIM_RUN=$(without "$CHIP_TESTS" "$SANITIZED_SIM_TESTS")
# Two lanes, side by side (neither writes what the other reads; the sanitizer job builds and
# tests a copy of the tree of its own): the cpu chip's run in the foreground, its output live;
# in the background the sim run, SECOND_LANE_CPU_TESTS if any, the opencl run (the chip-dependent tests
# again on PoCL's OpenCL CPU device; skipped, and said so, where the opencl adapter was not
# built) and the sanitizer job (AddressSanitizer and UndefinedBehaviorSanitizer in one build),
# their output printed whole at the end. Each run lists its slowest tests: what to look at when
# the suite grows slow.
# One OpenMP thread per process unless the caller says otherwise: the two lanes already keep
# both cores of a small machine busy, and OpenMP threads that spin-wait after each parallel op
# take the core the other lane needs (measured: two pytest runs side by side took 16% longer
# with PyTorch's default thread count). The models here are small enough not to miss the threads.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
(
    set -e
    FLAGOS_TEST_CHIP=sim "$PYTHON" -m pytest -q --durations=15 $SIM_RUN "$@"
    if [ -n "$SECOND_LANE_CPU_TESTS" ]; then
        "$PYTHON" -m pytest -q --durations=15 $SECOND_LANE_CPU_TESTS "$@"
    fi
    if ls flagos/adapters/libflagos_opencl_adapter*.so >/dev/null 2>&1; then
        FLAGOS_TEST_CHIP=opencl "$PYTHON" -m pytest -q --durations=15 $OPENCL_RUN "$@"
    else
        echo "opencl run skipped: the opencl adapter was not built (scripts/setup.sh installs PoCL)"
    fi
    bash tests/sanitizers/run.sh address,undefined
) >"$logs/sim-and-sanitizers" 2>&1 &
second_lane=$!
cpu_status=0
"$PYTHON" -m pytest -q --durations=15 $CPU_RUN "$@" || cpu_status=$?
second_status=0
wait "$second_lane" || second_status=$?
echo "== sim and opencl runs, sanitizer job (ASan + UBSan) (exit $second_status)"
cat "$logs/sim-and-sanitizers"
echo "== cpu run exit $cpu_status, sim and opencl runs and sanitizer job exit $second_status"
[ "$cpu_status" -eq 0 ] && [ "$second_status" -eq 0 ]
