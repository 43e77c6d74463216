"""A conformance worker: activates one chip once, then runs cases read from stdin.

Protocol: one JSON object per line. The worker writes {"ready": true} once the op database is
loaded, then for each task [key, dtype, direction] one result object. Results go to the original
stdout; anything the ops print goes to stderr, so it cannot corrupt the protocol.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings


def main(chip: str) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    warnings.simplefilter("ignore")
    os.environ.setdefault("FLAGOS_FALLBACK", "allow")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness
    import torch

    import flagos

    torch.set_num_threads(1)
    flagos.activate(chip)
    dev = flagos.device()
    harness.ops()
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        key, dtype, direction = json.loads(line)
        start = time.perf_counter()
        result = harness.run_case(key, dtype, direction, dev)
        result["seconds"] = round(time.perf_counter() - start, 3)
        out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
