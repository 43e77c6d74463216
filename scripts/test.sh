#!/usr/bin/env bash
# The test suite: device mode on the cpu chip (with native mode, autoload and the real models),
# then the AddressSanitizer job over the C router.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pytest -q tests "$@"
bash tests/asan/run.sh
