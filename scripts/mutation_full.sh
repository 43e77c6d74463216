#!/usr/bin/env bash
# Systematic mutation testing of the Python package (all of flagos/, flagos/tools/ included)
# with cosmic-ray: each module's mutants run one at a time against the tests that
# scripts/mutation_map.py names for it, in a scratch copy of the checkout with the C libraries
# built in place, under `nice`. Resumable: interrupt it and run the same command again.
#
#   scripts/mutation_full.sh                          # every module: hours, not a CI job
#   scripts/mutation_full.sh flagos/core/_env.py flagos/core/_schema.py
#   scripts/mutation_full.sh --sample 10 --seed 1     # 10 mutants per module, the same 10 each time
#   scripts/mutation_full.sh --count                  # mutants per module, nothing run
#   scripts/mutation_full.sh --report                 # the scores so far
#   scripts/mutation_full.sh --survivors              # the diff of every surviving mutant
#
# Each mutant runs first against the tests that reach its line (a coverage pass per module,
# scripts/mutation_coverage.py), then, if it survives them, against the whole selection.
# Scores: .mutation/python-scores.json and .mutation/python-scores.md (--work DIR elsewhere).
# cosmic-ray is not a dependency of flagos: it is installed here, pinned, into
# .mutation/venv (a virtual environment that sees the machine's packages: torch, pytest, ...).
# C mutants: scripts/mutation_c.py. See docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
COSMIC_RAY_VERSION=8.7.0
VENV=.mutation/venv

COVERAGE_VERSION=7.17.5  # which tests reach each line: scripts/mutation_coverage.py

if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('cosmic-ray') != '$COSMIC_RAY_VERSION' or m.version('coverage') != '$COVERAGE_VERSION')" 2>/dev/null; then
    echo "installing cosmic-ray $COSMIC_RAY_VERSION and coverage $COVERAGE_VERSION into $VENV" >&2
    # No pip or setuptools of its own: the machine's setuptools builds flagos as it does elsewhere.
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
    "$PYTHON" -m pip --python "$VENV/bin/python" install -q "cosmic-ray==$COSMIC_RAY_VERSION" "coverage==$COVERAGE_VERSION"
fi
exec nice -n 10 "$VENV/bin/python" scripts/mutation_python.py "$@"
