"""Run conformance cases in worker processes, so a segfault or an abort is a recorded crash.

Each worker activates one chip once and runs one case at a time. When a worker dies or runs
past the per-case timeout, the case it was running is recorded as `crash` and a fresh worker
takes its place.
"""
from __future__ import annotations

import fnmatch
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP_S = 300  # importing op_db takes ~12 s alone; the machine may be busy


def key_of(chip, case):
    op, dtype, direction = case
    return f"{chip}:{op}:{dtype}:{direction}"


class Worker:
    def __init__(self, chip):
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ)
        env.setdefault("FLAGOS_FALLBACK", "allow")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py"), chip],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env)
        self.buf = b""
        self.case = None
        self.started = time.monotonic()
        self.ready = False

    def lines(self):
        """Complete lines read so far; None at end of file (the worker died)."""
        data = os.read(self.proc.stdout.fileno(), 65536)
        if not data:
            return None
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in done if line.strip()]

    def send(self, case):
        self.case = case
        self.started = time.monotonic()
        self.proc.stdin.write((json.dumps(list(case)) + "\n").encode())
        self.proc.stdin.flush()

    def why_dead(self):
        """One line: the signal or exit code, and the last line the worker wrote to stderr."""
        try:
            # Its stdout is closed, so it is exiting; a loaded machine can take a while to
            # finish tearing torch down, and that must not read as a hang.
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        what = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        self.log.seek(0)
        tail = [s for s in self.log.read().decode(errors="replace").splitlines() if s.strip()]
        return f"{what}: {tail[-1][:200]}" if tail else what

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.log.close()


def run(chip, cases, workers=2, timeout=60.0, on_result=None):
    """Run cases [(op, dtype, direction)] on chip; returns {key: result}."""
    todo = list(reversed(cases))
    results = {}
    pool = []
    sel = selectors.DefaultSelector()

    def start():
        w = Worker(chip)
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        pool.append(w)

    def retire(w, outcome, message):
        if w.case is not None:
            record(w.case, {"outcome": outcome, "message": message, "samples": 0,
                            "seconds": round(time.monotonic() - w.started, 3)})
        sel.unregister(w.proc.stdout)
        pool.remove(w)
        w.kill()

    def record(case, result):
        key = key_of(chip, case)
        results[key] = result
        if on_result:
            on_result(key, result)

    def feed(w):
        w.case = None
        if todo:
            w.send(todo.pop())

    for _ in range(min(workers, len(todo))):
        start()
    try:
        while pool:
            for sk, _ in sel.select(timeout=1.0):
                w = sk.data
                lines = w.lines()
                if lines is None:
                    if not w.ready:
                        raise RuntimeError(f"a {chip} worker died while starting: {w.why_dead()}")
                    retire(w, "crash", w.why_dead())
                    if todo:
                        start()
                    continue
                for msg in lines:
                    if msg.get("ready"):
                        w.ready = True
                    else:
                        record(w.case, msg)
                    feed(w)
            now = time.monotonic()
            for w in list(pool):
                if w.case is None and w.ready and not todo:
                    retire(w, "", "")
                elif w.ready and w.case is not None and now - w.started > timeout:
                    retire(w, "crash", f"timed out after {timeout:.0f} s")
                    if todo:
                        start()
                elif not w.ready and now - w.started > STARTUP_S:
                    raise RuntimeError(f"a {chip} worker did not start: {w.why_dead()}")
    finally:
        for w in list(pool):
            w.kill()
    return results


# -- expected failures -------------------------------------------------------------------------

def load_expected():
    sys.path.insert(0, HERE)
    from expected_failures import EXPECTED
    return EXPECTED


def cause_of(key, expected):
    for cause, patterns in expected.items():
        if any(fnmatch.fnmatchcase(key, p) for p in patterns):
            return cause
    return None


def judge(results, expected, globs=True):
    """(unexpected, stale). unexpected: failing cases no pattern lists. stale: one line per
    listed pattern that now passes where it ran (strict: the list must shrink when a bug is
    fixed): "remove P" when all its cases pass, "narrow P" when a both-chips pattern passes on
    one chip. A run over some ops sees only part of what a pattern with a wildcard in its op
    field covers: globs=False leaves those out of `stale`."""
    unexpected = []
    matched = {}  # (pattern, chip) -> [cases run, cases failing]
    for key, r in sorted(results.items()):
        failing = r["outcome"] not in ("pass", "skip")
        chip = key.split(":")[0]
        for patterns in expected.values():
            for p in patterns:
                if fnmatch.fnmatchcase(key, p):
                    seen = matched.setdefault((p, chip), [0, 0])
                    seen[0] += r["outcome"] != "skip"
                    seen[1] += failing
        if failing and cause_of(key, expected) is None:
            unexpected.append(key)
    stale = []
    for p in sorted({p for p, _ in matched}):
        if not globs and any(c in p.split(":")[1] for c in "*?["):
            continue
        passing = [c for (q, c), (ran, failed) in matched.items() if q == p and ran and not failed]
        failing = [c for (q, c), (ran, failed) in matched.items() if q == p and failed]
        if passing and not failing:
            stale.append(f"remove {p!r}: it passes")
        elif passing:
            stale.append(f"narrow {p!r} to {', '.join(failing)}: it passes on {', '.join(passing)}")
    return unexpected, stale
