"""What scripts/mutation_full.sh (Python, through cosmic-ray) and scripts/mutation_c.py share:
the scratch tree the mutants are applied to, a test selection run against it with a timeout,
and the per-file scores written as JSON and as a markdown table.

The scratch tree is a copy of the checkout (the folders scripts/mutation_check.py copies) with
the C extension and the sim adapter built in place, so `PYTHONPATH=<tree>` makes every process
a test starts (`conftest.run_python`, `python -m flagos`, a pytest child) import the mutated
copy, C libraries included. Each start copies the checkout again, so a mutation left behind by
a killed run never survives into the next one.

    python scripts/mutation_common.py --run-tests FILE   # the selection of FILE on the tree in cwd
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from mutation_check import COPIED, ROOT, Run, build, built_libraries, test_env
from mutation_map import source_files, tests_for, unmapped

# The three outcomes that count; anything else is reported but left out of the score.
KILLED, SURVIVED, TIMEOUT = "killed", "survived", "timeout"
NOT_VIABLE, ERROR, PENDING = "not viable", "error", "pending"
FINGERPRINTED = ("setup.py", "pyproject.toml", "csrc", "backends", "flagos", "tests")


def be_nice() -> None:
    """Run at niceness 10 or lower priority: the machine is shared."""
    current = os.nice(0)
    if current < 10:
        os.nice(10 - current)


def file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def fingerprint(root: str, items=FINGERPRINTED) -> str:
    """A hash of the sources and tests of a tree: a baseline recorded for one fingerprint is
    reused only while nothing changed."""
    h = hashlib.sha256()
    for item in items:
        top = os.path.join(root, item)
        paths = [top] if os.path.isfile(top) else sorted(
            os.path.join(d, f) for d, dirs, files in os.walk(top) for f in files
            if "__pycache__" not in d and not f.endswith((".so", ".pyc")) and
            not os.path.relpath(d, root).startswith("build"))
        for p in paths:
            h.update(os.path.relpath(p, root).encode() + b"\0")
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def hold_lock(work: str, kind: str):
    """One run of a kind at a time per work folder (a second would rewrite its tree under it)."""
    handle = open(os.path.join(work, f"{kind}.lock"), "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another {kind} mutation run is using {work}; wait for it or pass another --work")
    return handle  # held until the process exits


def prepare_tree(work: str, kind: str) -> str:
    """<work>/tree-<kind>: a fresh copy of the checkout with its C libraries built (reused
    from <work>/libs/<hash of the C sources> when they were built before)."""
    tree = os.path.join(work, f"tree-{kind}")
    shutil.rmtree(tree, ignore_errors=True)
    os.makedirs(tree)
    for item in COPIED:
        src = os.path.join(ROOT, item)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(tree, item),
                            ignore=shutil.ignore_patterns("*.so", "__pycache__", "build", ".mutation"))
        elif os.path.exists(src):
            shutil.copy2(src, tree)
    libs = os.path.join(work, "libs", fingerprint(tree, ("setup.py", "csrc", "backends")))
    if os.path.isdir(libs):
        for folder, _, files in os.walk(libs):
            for f in files:
                rel = os.path.relpath(os.path.join(folder, f), libs)
                # a fresh mtime: newer than the sources, so the build sees it up to date
                shutil.copy(os.path.join(folder, f), os.path.join(tree, rel))
    else:
        print("building the C extension and the sim adapter in the scratch tree ...", flush=True)
        b = build(tree)
        if b.returncode != 0:
            sys.exit(f"the unmutated scratch tree does not build:\n{b.stdout}\n{b.stderr}")
        for lib in built_libraries(tree):
            os.makedirs(os.path.dirname(os.path.join(libs, lib)), exist_ok=True)
            shutil.copy2(os.path.join(tree, lib), os.path.join(libs, lib))
    probe = subprocess.run([sys.executable, "-c", "import flagos._C as c; print(c.__file__)"],
                           cwd=tree, env=test_env(tree, Run("cpu", ())), capture_output=True, text=True)
    if not probe.stdout.startswith(tree):
        sys.exit(f"flagos._C does not come from the scratch tree: {probe.stdout}{probe.stderr}")
    return tree


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, so a killed mutation run leaves no
    test run behind working on a tree that is about to be rebuilt."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Outcome:
    status: str
    detail: str
    seconds: float


def pytest_command(run: Run) -> list[str]:
    # one order for the baseline, the coverage pass and every mutant; the plugin narrows a run
    # to the tests that reach a mutant (scripts/mutation_pytest/mutation_plugin.py)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-p", "mutation_plugin", *run.paths]
    return cmd + (["-k", run.k] if run.k else [])


def selection_env(tree: str, run: Run, only_file: str | None, extra_env: dict | None) -> dict:
    env = test_env(tree, run)
    env["PYTHONPATH"] = os.pathsep.join((tree, os.path.join(tree, "scripts", "mutation_pytest")))
    if only_file:
        env["MUTATION_ONLY_TESTS"] = only_file
    env.update(extra_env or {})
    return env


def run_selection(tree: str, runs: list[Run], timeout: float | None = None,
                  only: list[list[str] | None] | None = None, extra_env: dict | None = None) -> Outcome:
    """Run each pytest run of a selection until one fails. Killed: a run exited non-zero (a
    failing test, a collection error from a broken import, a crashed process) other than
    pytest's 5 (nothing collected: the selection is wrong, reported as an error). Timeout: the
    whole selection took longer than `timeout` seconds. Each run is a process group of its own,
    killed when the run ends, so no process a test started outlives it. `only[i]`, when given,
    narrows run i to those node ids (an empty list skips it; None runs it whole)."""
    t0 = time.monotonic()
    detail = ""
    for index, run in enumerate(runs):
        node_ids = only[index] if only is not None else None
        if node_ids is not None and not node_ids:
            continue
        left = None if timeout is None else max(1.0, timeout - (time.monotonic() - t0))
        only_file = None
        if node_ids:
            only_file = os.path.join(tree, ".mutation-only-tests")
            with open(only_file, "w") as f:
                f.write("\n".join(node_ids) + "\n")
        proc = subprocess.Popen(pytest_command(run), cwd=tree, env=selection_env(tree, run, only_file, extra_env),
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)
        try:
            out, _ = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return Outcome(TIMEOUT, f"{run.label()}: over {timeout:.0f} s", time.monotonic() - t0)
        except BaseException:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
        # what the tests started and a mutant kept alive (a server that ignores its stop
        # signal) goes with the run, not on spinning through the next mutants
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        lines = out.strip().splitlines()
        last = lines[-1] if lines else ""
        detail = f"{run.label()}: {last}"
        if proc.returncode == 5:
            return Outcome(ERROR, f"{detail} (no test selected)", time.monotonic() - t0)
        if proc.returncode != 0:
            failed = next((ln for ln in lines if ln.startswith(("FAILED", "ERROR"))), "")
            return Outcome(KILLED, f"{run.label()}: exit {proc.returncode}: {failed or last}"[:400],
                           time.monotonic() - t0)
    return Outcome(SURVIVED, detail, time.monotonic() - t0)


# ---- baselines: every selection passes on the unmutated tree --------------------------------

def baseline(work: str, tree: str, path: str, tree_print: str) -> float:
    """Seconds the selection of `path` takes on the unmutated tree; runs it (and exits when it
    fails) unless the same selection passed before on a tree with the same fingerprint (files
    that share a selection share its baseline)."""
    record = os.path.join(work, "baselines.json")
    known = load_json(record, {})
    runs = tests_for(path)
    key = f"{tuple(runs)!r}@{tree_print}"
    if key in known:
        return known[key]
    print(f"baseline  {path}: " + "; ".join(r.label() for r in runs), flush=True)
    outcome = run_selection(tree, runs)
    if outcome.status != SURVIVED:
        sys.exit(f"baseline failed for {path} ({outcome.status}): {outcome.detail}\n"
                 "the unmutated tree must pass the selection; fix it in scripts/mutation_map.py")
    print(f"baseline  {path}: passed in {outcome.seconds:.0f} s", flush=True)
    known = load_json(record, {})
    known[key] = round(outcome.seconds, 1)
    save_json(record, known)
    return outcome.seconds


# ---- results ----------------------------------------------------------------------------------

def load_json(path: str, default):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def save_json(path: str, data) -> None:
    """Written to a temporary file and renamed: an interrupted run never leaves half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


@dataclass
class Score:
    path: str
    killed: int = 0
    survived: int = 0
    timeout: int = 0
    not_viable: int = 0
    error: int = 0
    pending: int = 0
    seconds: float = 0.0  # spent on the tested mutants
    survivors: list[str] = field(default_factory=list)

    def add(self, status: str, seconds: float = 0.0, label: str = "") -> None:
        key = {KILLED: "killed", SURVIVED: "survived", TIMEOUT: "timeout", NOT_VIABLE: "not_viable",
               ERROR: "error", PENDING: "pending"}[status]
        setattr(self, key, getattr(self, key) + 1)
        if status != PENDING:
            self.seconds += seconds
        if status == SURVIVED and label:
            self.survivors.append(label)

    @property
    def tested(self) -> int:
        return self.killed + self.survived + self.timeout

    @property
    def total(self) -> int:
        return self.tested + self.not_viable + self.error + self.pending

    @property
    def score(self) -> float | None:
        """Killed or timed out, over the mutants tested; None before any was."""
        return (self.killed + self.timeout) / self.tested if self.tested else None

    def row(self) -> dict:
        return {"file": self.path, "killed": self.killed, "survived": self.survived,
                "timeout": self.timeout, "not_viable": self.not_viable, "error": self.error,
                "pending": self.pending, "tested": self.tested, "total": self.total,
                "score": None if self.score is None else round(self.score, 4),
                "seconds_per_mutant": round(self.seconds / max(1, self.tested + self.not_viable), 1),
                "survivors": self.survivors}


def write_scores(out_base: str, scores: list[Score], command: str, note: str = "") -> str:
    """<out_base>.json (machine-readable) and <out_base>.md (the table); returns the table."""
    rows = [s.row() for s in scores]
    total = Score("total")
    for s in scores:
        for key in ("killed", "survived", "timeout", "not_viable", "error", "pending", "seconds"):
            setattr(total, key, getattr(total, key) + getattr(s, key))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    save_json(out_base + ".json", {"date": stamp, "command": command, "note": note, "files": rows,
                                   "total": {k: v for k, v in total.row().items() if k != "survivors"}})
    lines = [f"`{command}` — {stamp}" + (f" — {note}" if note else ""), "",
             "| file | killed | timeout | survived | not viable | pending | score | s / mutant |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows + [dict(total.row(), file="**total**")]:
        score = "—" if r["score"] is None else f"{100 * r['score']:.0f}%"
        name = r["file"] if r["file"].startswith("*") else f"`{r['file']}`"
        lines.append(f"| {name} | {r['killed']} | {r['timeout']} | {r['survived']} | "
                     f"{r['not_viable']} | {r['pending']} | {score} | {r['seconds_per_mutant']} |")
    table = "\n".join(lines) + "\n"
    with open(out_base + ".md", "w") as f:
        f.write(table)
    return table


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options both passes (Python and C) take, with the same meaning."""
    parser.add_argument("--work", default=os.path.join(ROOT, ".mutation"),
                        help="folder for the scratch tree, sessions and scores (default: .mutation)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-factor", type=float, default=3.0)
    parser.add_argument("--min-timeout", type=float, default=60.0)
    parser.add_argument("--report", action="store_true", help="only write and print the scores")
    parser.add_argument("--rerun-survivors", action="store_true",
                        help="run the surviving mutants again (after a test or the map was added to)")
    parser.add_argument("--shard", type=parse_shard, default=(1, 1), metavar="K/N",
                        help="take the K-th of every N chosen mutants, so N lanes (each with a --work "
                             "of its own) share the same files without running a mutant twice")


def parse_shard(text: str) -> tuple[int, int]:
    """`K/N` with 1 <= K <= N, as --shard takes it."""
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard: write K/N with 1 <= K <= N, e.g. 2/3")
    return int(k), int(n)


def shard(items: list, which: tuple[int, int]) -> list:
    """This lane's part of a run's mutants: every N-th from the K-th on, in the run's order, so the
    N parts are disjoint and together are the whole."""
    k, n = which
    return items[k - 1::n]


def mapped_files(kind: str, asked: list[str]) -> list[str] | None:
    """The files to mutate (those asked for, else every file of the kind), or None after saying
    which files have no tests in scripts/mutation_map.py (the map must be completed first)."""
    missing = unmapped(kind)
    if missing:
        print("no tests named in scripts/mutation_map.py for:", *missing, sep="\n  ", file=sys.stderr)
        return None
    files = asked or source_files(kind)
    for f in files:
        tests_for(f)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description="run the test selection of FILE on the tree in cwd")
    parser.add_argument("--run-tests", metavar="FILE", required=True)
    parser.add_argument("--only", metavar="JSON",
                        help="a JSON list, per run of the selection, of the node ids to run (null: all)")
    opts = parser.parse_args()
    die_with_parent()  # cosmic-ray starts this runner in a session of its own
    only = load_json(opts.only, None) if opts.only else None
    outcome = run_selection(os.getcwd(), tests_for(opts.run_tests), only=only)
    print(f"{outcome.status}: {outcome.detail} ({outcome.seconds:.0f} s)")
    return {SURVIVED: 0, KILLED: 1}.get(outcome.status, 3)


if __name__ == "__main__":
    sys.exit(main())
