#!/usr/bin/env bash
# Conformance sweep: PyTorch's OpInfo database on the flagos device against plain CPU, on the
# cpu chip, on sim and on opencl (where its adapter was built and finds a device), for float32,
# float16, bfloat16, complex64 and int64, forward, forward+backward, and forward under
# inference mode (directions fwd, bwd, inf; tests/conformance, docs/conformance.md).
#
#   scripts/conformance.sh                     full sweep; writes its table to docs/conformance.md
#   scripts/conformance.sh --ops 'add,fft.*'   quick check of some ops (globs over op[.variant])
#   scripts/conformance.sh --chips sim --dtypes complex64 --directions bwd
#   scripts/conformance.sh --chips opencl      one chip alone (any chip flagos knows: opencl here)
#
# Exits non-zero on a failing case (mismatch, stride, error, crash) that
# tests/conformance/expected_failures.py does not list, and, on a full sweep, on a listed
# pattern that now passes. Every case's result: out/conformance/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p out/conformance
args=(--results out/conformance/results.jsonl)
if [ $# -eq 0 ]; then
    # only a full sweep writes the documented numbers
    args+=(--write-doc docs/conformance.md)
fi
CONFORMANCE_COMMAND="scripts/conformance.sh${*:+ $*}" exec nice -n 10 "$PYTHON" tests/conformance/run.py "${args[@]}" "$@"
