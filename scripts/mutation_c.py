#!/usr/bin/env python3
"""Mutation testing of the C code (csrc/ and backends/sim/): generated mutants, each applied to
a scratch copy of the checkout, rebuilt, and run against the tests scripts/mutation_map.py
names for its file, on cpu and on sim.

    python scripts/mutation_c.py                          # every C file, --cap mutants each
    python scripts/mutation_c.py backends/sim/kernels.c --cap 10
    python scripts/mutation_c.py --list backends/sim/kernels.c   # the mutants, nothing run
    python scripts/mutation_c.py --report                 # the scores so far

Mutants: arithmetic (+ -, * /, %), compound assignments, comparisons (< <=, > >=, == !=),
&& ||, integer constants (0 -> 1, 1 -> 0, n -> n + 1, hexadecimal masks + 1) and `if`
conditions (negated, or removed: `if (0)`). Only code is mutated: comments, strings and
preprocessor lines are left alone, and a binary operator is one written with a space on each
side (the project's style), which tells `a * b` from `*p`. Every candidate of a file is
shuffled with the seed and the first --cap are taken, so a larger cap keeps the smaller one's
mutants and an interrupted run has tested a random sample.

Results: docs/mutation/c.json, the committed ledger (per file, per mutant; a file's results
are dropped when its source changes; scripts/mutation_ledger.py), resumed on the next run, on
this machine or another; scores in <work>/c-scores.json and .md. A mutant
that does not compile is "not viable", not killed. Runs under `nice`, one mutant at a time.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass

import mutation_common as common
import mutation_ledger
from mutation_check import ROOT, build, built_libraries
from mutation_map import source_files, tests_for


@dataclass(frozen=True)
class Mutant:
    path: str
    offset: int
    line: int
    original: str
    replacement: str
    kind: str

    @property
    def id(self) -> str:
        return f"{self.line}:{self.offset}:{self.original}->{self.replacement}"

    def label(self) -> str:
        return f"{self.path}:{self.line} {self.kind}: `{self.original.strip()}` -> `{self.replacement.strip()}`"

    def apply(self, text: str) -> str:
        assert text[self.offset:self.offset + len(self.original)] == self.original, self
        return text[:self.offset] + self.replacement + text[self.offset + len(self.original):]


# ---- generating the mutants ----------------------------------------------------------------

def code_mask(text: str) -> str:
    """The source with comments, string and character literals and preprocessor lines blanked
    (same length, newlines kept), so patterns only match code."""
    out = list(text)
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c == "#":
            j = i
            while j < n and not (text[j] == "\n" and text[j - 1] != "\\"):
                j += 1
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
            continue
        if c == "\n":
            at_line_start = True
            i += 1
            continue
        if not c.isspace():
            at_line_start = False
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


SWAPS = {
    "+": ("-", "arithmetic"), "-": ("+", "arithmetic"), "*": ("/", "arithmetic"),
    "/": ("*", "arithmetic"), "%": ("*", "arithmetic"),
    "+=": ("-=", "arithmetic"), "-=": ("+=", "arithmetic"), "*=": ("/=", "arithmetic"),
    "/=": ("*=", "arithmetic"),
    "<": ("<=", "comparison"), "<=": ("<", "comparison"), ">": (">=", "comparison"),
    ">=": (">", "comparison"), "==": ("!=", "comparison"), "!=": ("==", "comparison"),
    "&&": ("||", "logical"), "||": ("&&", "logical"),
}
# An operator with a space on each side, between an operand's end and an operand's start.
BINARY = re.compile(r"(?<=[\w)\]]) (\+=|-=|\*=|/=|<=|>=|==|!=|&&|\|\||[-+*/%<>]) (?=[\w(!~.&*-])")
DECIMAL = re.compile(r"(?<![\w.])(\d+)([uUlL]*)(?![\w.])")
HEX = re.compile(r"(?<![\w.])0[xX]([0-9a-fA-F]+)([uUlL]*)(?![\w.])")
IF = re.compile(r"\bif\s*\(")


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def candidates(path: str, text: str) -> list[Mutant]:
    """Every mutant of one file, in source order."""
    code = code_mask(text)
    found: list[Mutant] = []

    def add(offset, original, replacement, kind):
        found.append(Mutant(path, offset, line_of(text, offset), original, replacement, kind))

    for m in BINARY.finditer(code):
        op = m.group(1)
        replacement, kind = SWAPS[op]
        add(m.start(1), op, replacement, kind)
        if kind == "comparison" and op in ("<", ">", "<=", ">="):  # the negation as well
            negated = {"<": ">=", ">": "<=", "<=": ">", ">=": "<"}[op]
            add(m.start(1), op, negated, "comparison")
    for m in DECIMAL.finditer(code):
        value, suffix = int(m.group(1)), m.group(2)
        new = {0: 1, 1: 0}.get(value, value + 1)
        add(m.start(), m.group(0), f"{new}{suffix}", "constant")
    for m in HEX.finditer(code):
        digits, suffix = m.group(1), m.group(2)
        new = format(int(digits, 16) + 1, "x").rjust(len(digits), "0")
        add(m.start(), m.group(0), f"0x{new}{suffix}", "constant")
    for m in IF.finditer(code):
        start = m.end()  # just after "("
        depth, j = 1, start
        while j < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            j += 1
        condition = text[start:j - 1]
        add(start, condition, f"!({condition})", "negated condition")
        add(start, condition, "0", "removed condition")
    found.sort(key=lambda mu: (mu.offset, mu.replacement))
    return found


def chosen(path: str, text: str, seed: int, cap: int) -> list[Mutant]:
    """The first `cap` candidates after a shuffle by the seed: a larger cap extends a smaller one."""
    every = candidates(path, text)
    random.Random(f"{seed}:{path}").shuffle(every)
    return every[:cap] if cap else every


# ---- running them ------------------------------------------------------------------------------

def run_mutant(tree: str, mutant: Mutant, pristine: dict[str, bytes], timeout: float) -> common.Outcome:
    full = os.path.join(tree, mutant.path)
    with open(full) as f:
        original = f.read()
    t0 = time.monotonic()
    try:
        with open(full, "w") as f:
            f.write(mutant.apply(original))
        b = build(tree)
        if b.returncode != 0:
            error = next((ln for ln in (b.stderr + b.stdout).splitlines() if "error" in ln), "")
            return common.Outcome(common.NOT_VIABLE, error.strip()[:300], time.monotonic() - t0)
        outcome = common.run_selection(tree, tests_for(mutant.path), timeout)
        return common.Outcome(outcome.status, outcome.detail, time.monotonic() - t0)
    finally:
        with open(full, "w") as f:
            f.write(original)
        for lib, data in pristine.items():  # the unmutated build, newer than its sources
            with open(os.path.join(tree, lib), "wb") as f:
                f.write(data)


def file_score(path: str, entry: dict, chosen_ids: list[str]) -> common.Score:
    score = common.Score(path)
    results = entry.get("mutants", {})
    for mid in chosen_ids:
        r = results.get(mid)
        if r is None:
            score.add(common.PENDING)
        else:
            score.add(r["status"], r["seconds"], r["label"])
    return score


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="C files (default: csrc/*.c and backends/sim/*.c)")
    common.add_run_options(parser)
    parser.add_argument("--cap", type=int, default=60, help="mutants per file (0: every candidate)")
    parser.add_argument("--list", action="store_true", help="print the chosen mutants; run nothing")
    opts = parser.parse_args()

    files = common.mapped_files("c", opts.files)
    if files is None:
        return 2
    texts = {f: open(os.path.join(ROOT, f)).read() for f in source_files("c")}
    if opts.list:
        for f in files:
            every = candidates(f, texts[f])
            picked = chosen(f, texts[f], opts.seed, opts.cap)
            print(f"{f}: {len(picked)} of {len(every)} candidates (seed {opts.seed})")
            for m in picked:
                print("  " + m.label())
        return 0

    work = os.path.abspath(opts.work)
    os.makedirs(os.path.join(work, "c"), exist_ok=True)
    common.be_nice()
    # Results live in the committed ledger (scripts/mutation_ledger.py), not in the work folder:
    # a pass outlives the machine that started it.
    ledger = mutation_ledger.load("c")
    results = {}
    for f in source_files("c"):
        sha = common.file_sha(os.path.join(ROOT, f))
        entry = ledger.get(f)
        if entry is not None and entry.get("sha256") == sha:
            results[f] = entry
        elif f in files:
            if entry is not None:
                print(f"{f}: source changed since its results; starting it again", flush=True)
            results[f] = {"sha256": sha, "mutants": {}}
    command = "python scripts/mutation_c.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    if not opts.report:
        lock = common.hold_lock(work, "c")  # noqa: F841 (held while this process runs)
        tree = common.prepare_tree(work, "c")
        pristine = {lib: open(os.path.join(tree, lib), "rb").read() for lib in built_libraries(tree)}
        # the build/ folder of the scratch tree must not hold objects of another source
        shutil.rmtree(os.path.join(tree, "build"), ignore_errors=True)
        tree_print = common.fingerprint(tree)
        try:
            for f in files:
                known = results[f]["mutants"]
                todo = [m for m in common.shard(chosen(f, texts[f], opts.seed, opts.cap), opts.shard) if m.id not in known or
                        (opts.rerun_survivors and known[m.id]["status"] == common.SURVIVED)]
                if not todo:
                    continue
                secs = common.baseline(work, tree, f, tree_print)
                timeout = max(opts.min_timeout, opts.timeout_factor * secs)
                print(f"{f}: {len(todo)} mutants to run, timeout {timeout:.0f} s each", flush=True)
                for n, m in enumerate(todo, 1):
                    outcome = run_mutant(tree, m, pristine, timeout)
                    record = {"status": outcome.status, "seconds": round(outcome.seconds, 1),
                              "label": m.label(), "detail": (outcome.detail or "")[-300:]}
                    results[f]["mutants"][m.id] = record
                    mutation_ledger.merge("c", f, results[f]["sha256"], {m.id: record})
                    print(f"  [{n}/{len(todo)}] {outcome.status:10} {outcome.seconds:5.0f} s  {m.label()}"
                          + (f"\n      {outcome.detail}" if outcome.status != common.KILLED else ""), flush=True)
        except KeyboardInterrupt:
            print("\ninterrupted: the results so far are kept; run the same command to continue")

    scores = []
    for f in source_files("c"):
        if f in results and results[f]["mutants"]:
            ids = [m.id for m in chosen(f, texts[f], opts.seed, opts.cap)]
            ids += [mid for mid in results[f]["mutants"] if mid not in ids]  # from a larger cap
            scores.append(file_score(f, results[f], ids))
    out = os.path.join(work, "c-scores")
    print("\n" + common.write_scores(out, scores, command, f"seed {opts.seed}, cap {opts.cap} per file"))
    print(f"written: {out}.json, {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
