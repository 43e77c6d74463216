"""scripts/mutation_check.py's planted bugs stay plantable: each edit's original text is in its
file exactly once, so a refactor that moves a line fails here, in every CI run, rather than in
the next mutation check (which is not part of CI). And the systematic pass's narrowing (scripts/mutation_reach.py, the
pytest plugin of scripts/mutation_pytest/) never leaves out a test that reaches a mutant, and
its committed ledger (scripts/mutation_ledger.py) keeps what a run found for the source it ran on;
lanes that split one run (--shard) share its mutants out without a gap or a mutant run twice."""
import argparse
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import mutation_check  # noqa: E402
import mutation_common  # noqa: E402
import mutation_context  # noqa: E402
import mutation_ledger  # noqa: E402
import mutation_map  # noqa: E402
import mutation_reach  # noqa: E402


@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.name)
def test_every_planted_bug_still_finds_its_line(mutation):
    for path, original, replacement in mutation.edits:
        text = open(os.path.join(ROOT, path)).read()
        assert text.count(original) == 1, f"{mutation.name}: {path} holds {original!r} {text.count(original)} times"
        assert original != replacement
    assert mutation.runs, f"{mutation.name} names no tests to catch it"


def test_mutation_names_are_unique():
    names = [m.name for m in mutation_check.MUTATIONS]
    assert len(names) == len(set(names))


def test_every_source_file_names_its_tests_for_mutation_testing():
    """scripts/mutation_full.sh and mutation_c.py stop on a file without a selection: a new module
    is given its tests in scripts/mutation_map.py when it lands, not when a pass meets it."""
    assert mutation_map.unmapped("python") == [] and mutation_map.unmapped("c") == []


# ---- scripts/mutation_reach.py: a narrowed mutant run may never leave out a test that reaches it

SOURCE = '''\
import os

LIMIT = 3


@staticmethod
def pick(values,
         limit=LIMIT):
    if (len(values) >
            limit):
        return values[:limit]
    total = sum(v
                for v in values)
    return total
'''


@pytest.mark.parametrize("line, lines", [
    (10, range(9, 11)),   # an `if` over two lines: its header, not its body
    (9, range(9, 11)),
    (11, range(11, 12)),  # a statement in the body
    (13, range(12, 14)),  # the second line of a two-line statement: the whole statement
    (7, range(7, 9)),     # a default value: the `def` header (it runs at import)
    (6, range(6, 7)),     # a decorator: its own line
    (3, range(3, 4)),
])
def test_statement_lines_cover_the_whole_statement_a_mutant_sits_in(line, lines):
    assert mutation_reach.statement_lines(SOURCE, line) == lines


def test_a_mutant_runs_the_tests_that_reached_its_statement_per_run():
    reach = mutation_reach.CoverageMap(
        tests=[["t.py::a", "t.py::b", "t.py::c"], ["s.py::x"]],
        lines={5: {0: [0]}, 6: {0: [2]}, 7: {0: [1], 1: [0]}, 8: {0: [mutation_reach.OUTSIDE_TESTS, 1]}})
    assert reach.selection(range(5, 7)) == [["t.py::a", "t.py::c"], []]  # run 1 never reached it: skipped
    assert reach.selection(range(7, 8)) == [["t.py::b"], ["s.py::x"]]


def test_a_line_run_outside_any_test_or_by_no_test_runs_the_whole_selection():
    reach = mutation_reach.CoverageMap(tests=[["t.py::a"]], lines={8: {0: [mutation_reach.OUTSIDE_TESTS, 0]}})
    assert reach.selection(range(7, 9)) is None   # at import: every test reaches it
    assert reach.selection(range(20, 22)) is None  # no measured process ran it (one killed by a signal, say)
    assert mutation_reach.CoverageMap.from_json(reach.to_json()) == reach


def test_the_plugin_runs_only_the_listed_tests(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_kept():\n    pass\n\ndef test_left_out():\n    assert False\n")
    only = tmp_path / "only.txt"
    only.write_text("test_two.py::test_kept\n")
    env = dict(os.environ, MUTATION_ONLY_TESTS=str(only),
               PYTHONPATH=os.path.join(ROOT, "scripts", "mutation_pytest"))
    env.pop("MUTATION_COVERAGE_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-p", "mutation_plugin", "test_two.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 deselected" in proc.stdout


FORKING_TESTS = """
import os
import target

def test_forks():
    pid = os.fork()
    if pid == 0:
        target.in_child()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    target.in_parent()
"""


def test_the_coverage_pass_measures_forked_children_under_the_test_that_forked(tmp_path):
    """A line only a forked child runs is recorded under the test that forked it, so its
    mutants run that test instead of the whole selection (mutation_pytest/sitecustomize.py)."""
    coverage = pytest.importorskip("coverage")  # in flagos's test extra
    (tmp_path / "target.py").write_text("def in_child():\n    return 1\n\n\ndef in_parent():\n    return 2\n")
    (tmp_path / "test_fork.py").write_text(FORKING_TESTS)
    data = tmp_path / "data"
    data.mkdir()
    env = dict(os.environ, MUTATION_COVERAGE_DIR=str(data), MUTATION_COVERAGE_INCLUDE=str(tmp_path / "target.py"),
               PYTHONPATH=os.path.join(ROOT, "scripts", "mutation_pytest") + os.pathsep + str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-p", "mutation_plugin", "test_fork.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    contexts: dict[int, set[str]] = {}
    files = sorted(data.glob("coverage.*"))
    assert len(files) == 2, files  # the pytest process's and the child's
    for data_file in files:
        measured = coverage.CoverageData(basename=str(data_file))
        measured.read()
        for name in measured.measured_files():
            for line, names in measured.contexts_by_lineno(name).items():
                contexts.setdefault(line, set()).update(names)
    assert contexts[2] == {"test_fork.py::test_forks"}  # in_child's body: the child's only
    assert contexts[6] == {"test_fork.py::test_forks"}  # in_parent's body
    assert "" in contexts[1]                             # the def lines ran at import


def test_mutants_inside_postponed_annotations_are_found_and_nothing_else():
    source = ("from __future__ import annotations\n"
              "limit: int | None = 3 | 4\n"
              "def f(x: str | None = None, *, y: 'a' = 1 | 2) -> dict | None:\n"
              "    return x or y\n")
    spans = mutation_reach.annotation_spans(source)
    assert mutation_reach.in_annotation(spans, (2, 11))       # the | of `int | None`
    assert not mutation_reach.in_annotation(spans, (2, 22))   # the | of `3 | 4`: a value
    assert mutation_reach.in_annotation(spans, (3, 13))       # `str | None`
    assert not mutation_reach.in_annotation(spans, (3, 42))   # `1 | 2`, a default
    assert mutation_reach.in_annotation(spans, (3, 55))       # the return annotation
    # without the future import, annotations are evaluated: nothing is set aside
    assert mutation_reach.annotation_spans(source.split("\n", 1)[1]) == []


# ---- scripts/mutation_ledger.py: results outlive the machine, and never outlive their source

@pytest.fixture
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(mutation_ledger, "LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.setattr(mutation_ledger, "ROOT", str(tmp_path))  # its lock file, under .mutation/
    return tmp_path / "ledger"


def test_ledger_keeps_results_per_source_and_operator_set(ledger_dir):
    killed = {"status": "killed", "seconds": 3.0}
    survived = {"status": "survived", "seconds": 9.5, "diff": ["-    if a < b:", "+    if a <= b:"]}
    mutation_ledger.merge("python", "flagos/a.py", "sha1", {"10:4 X #0": killed},
                          match={"operators": "reduced"}, info={"mutants_total": 3})
    mutation_ledger.merge("python", "flagos/a.py", "sha1", {"2:0 Y #1": survived},
                          match={"operators": "reduced"}, info={"mutants_total": 3})
    mutation_ledger.merge("python", "flagos/b.py", "shaB", {"1:0 Z #0": killed}, match={"operators": "reduced"})
    assert mutation_ledger.entry_for("python", "flagos/a.py", "sha1", operators="reduced") == \
        {"10:4 X #0": killed, "2:0 Y #1": survived}
    assert mutation_ledger.load("python")["flagos/a.py"]["mutants_total"] == 3
    # another source, or another operator set: nothing of the old results is served
    assert mutation_ledger.entry_for("python", "flagos/a.py", "sha2", operators="reduced") == {}
    assert mutation_ledger.entry_for("python", "flagos/a.py", "sha1", operators="all") == {}
    # the first result for a new source starts its entry, the old one kept as an earlier source
    mutation_ledger.merge("python", "flagos/a.py", "sha2", {"5:0 W #0": killed}, match={"operators": "reduced"})
    data = mutation_ledger.load("python")
    assert data["flagos/a.py"]["mutants"] == {"5:0 W #0": killed} and data["flagos/a.py"]["sha256"] == "sha2"
    assert [e["sha256"] for e in data["flagos/a.py"]["earlier"]] == ["sha1"]
    assert mutation_ledger.entry_for("python", "flagos/a.py", "sha1", operators="reduced") == \
        {"10:4 X #0": killed, "2:0 Y #1": survived}
    assert data["flagos/b.py"]["mutants"] == {"1:0 Z #0": killed}


def test_a_lane_on_an_older_source_adds_to_its_entry_not_over_the_newer_one(ledger_dir):
    """Two lanes on one module, one started before its source changed: the older lane's
    results must not wipe out the newer source's (kills carried over included)."""
    killed = {"status": "killed", "seconds": 3.0}
    merge = lambda sha, key: mutation_ledger.merge("python", "flagos/a.py", sha, {key: killed},  # noqa: E731
                                                   match={"operators": "reduced"})
    merge("old", "1:0 A #0")
    merge("new", "1:0 A #0")   # the newer lane, its kills carried over
    merge("old", "2:0 B #0")   # the older lane goes on
    merge("new", "3:0 C #0")
    entry = mutation_ledger.load("python")["flagos/a.py"]
    assert entry["sha256"] == "new" and set(entry["mutants"]) == {"1:0 A #0", "3:0 C #0"}
    assert mutation_ledger.entry_for("python", "flagos/a.py", "old", operators="reduced") == \
        {"1:0 A #0": killed, "2:0 B #0": killed}
    # the file reads back as written, and only the last EARLIER_KEPT sources are kept
    for n in range(mutation_ledger.EARLIER_KEPT + 1):
        merge(f"later{n}", "9:0 Z #0")
    entry = mutation_ledger.load("python")["flagos/a.py"]
    assert len(entry["earlier"]) == mutation_ledger.EARLIER_KEPT
    assert entry["sha256"] == f"later{mutation_ledger.EARLIER_KEPT}"
    assert mutation_ledger.entry_for("python", "flagos/a.py", "old", operators="reduced") == {}


def test_ledger_is_one_line_per_mutant_in_line_order(ledger_dir):
    mutants = {f"{line}:0 X #0": {"status": "killed", "seconds": 1.0} for line in (100, 9, 20)}
    mutation_ledger.merge("c", "csrc/x.c", "s", mutants)
    text = (ledger_dir / "c.json").read_text()
    lines = [ln.strip() for ln in text.splitlines() if '"status"' in ln]
    assert [ln.split(":")[0] for ln in lines] == ['"9', '"20', '"100']
    assert len(text.splitlines()) == 10  # braces, the file's sha and one line for each mutant


@pytest.mark.parametrize("lanes", [1, 2, 3, 7, 25])
def test_shards_split_a_runs_mutants_into_disjoint_parts_that_make_the_whole(lanes):
    mutants = [f"m{i}" for i in range(23)]
    parts = [mutation_common.shard(mutants, (k, lanes)) for k in range(1, lanes + 1)]
    assert sorted(m for part in parts for m in part) == sorted(mutants)
    assert sum(map(len, parts)) == len(mutants)  # none run twice
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # the lanes get even shares


@pytest.mark.parametrize("text, expected", [("1/1", (1, 1)), ("2/3", (2, 3)), ("3/3", (3, 3))])
def test_a_shard_is_written_k_of_n(text, expected):
    assert mutation_common.parse_shard(text) == expected


@pytest.mark.parametrize("text", ["0/2", "3/2", "2", "a/b", "1/0", "-1/2", "1/2/3", ""])
def test_a_shard_that_cannot_be_is_refused_with_the_form_to_write(text):
    with pytest.raises(argparse.ArgumentTypeError, match="write K/N with 1 <= K <= N"):
        mutation_common.parse_shard(text)


OLD_SOURCE = """\
LIMIT = 3


def kept(a, b):
    if a < b:
        return a + 1
    return b - 1


def changed(x):
    return x * 2
"""
NEW_SOURCE = """\
LIMIT = 4


def added(y):
    return y < 0


def kept(a, b):
    if a < b:
        return a + 1
    return b - 1


def changed(x):
    return x * 3
"""


def at(source, line, text, operator, n):
    """A mutant as cosmic-ray names it: `n`, the operator's n-th point in the source."""
    col = source.splitlines()[line - 1].index(text)
    return mutation_context.Mutant(f"{line}:{col} {operator} #{n}", line, col, operator, n)


def test_kills_in_unchanged_functions_carry_over_to_their_new_place():
    old = [at(OLD_SOURCE, 1, "3", "NumberReplacer", 0), at(OLD_SOURCE, 5, "<", "Lt_GtE", 0),
           at(OLD_SOURCE, 6, "1", "NumberReplacer", 1), at(OLD_SOURCE, 7, "-", "Sub_Add", 0),
           at(OLD_SOURCE, 11, "2", "NumberReplacer", 2)]
    records = {m.key: {"status": "killed"} for m in old}
    records[old[3].key] = {"status": "survived"}  # `b - 1` survived: it runs again
    new = [at(NEW_SOURCE, 1, "4", "NumberReplacer", 0), at(NEW_SOURCE, 5, "<", "Lt_GtE", 0),
           at(NEW_SOURCE, 5, "0", "NumberReplacer", 1), at(NEW_SOURCE, 9, "<", "Lt_GtE", 1),
           at(NEW_SOURCE, 10, "1", "NumberReplacer", 2), at(NEW_SOURCE, 11, "-", "Sub_Add", 0),
           at(NEW_SOURCE, 15, "3", "NumberReplacer", 3)]
    carried = mutation_context.carried_over(OLD_SOURCE, old, records, NEW_SOURCE, new)
    # `kept` moved from line 4 to line 8: its `<` and its `1` are other occurrences now, the
    # same mutants; the changed function, the changed constant and the new function carry nothing
    assert carried == {"9:9 Lt_GtE #1": {"status": "killed"}, "10:19 NumberReplacer #2": {"status": "killed"}}


def test_identical_functions_carry_nothing():
    method = "    def f(self, a):\n        return a + 1\n"
    once, twice = "class A:\n" + method, "class A:\n" + method + "\n\nclass B:\n" + method
    old = [at(once, 3, "+", "Add_Sub", 0)]
    new = [at(twice, 3, "+", "Add_Sub", 0), at(twice, 8, "+", "Add_Sub", 1)]
    records = {m.key: {"status": "killed"} for m in old}
    assert mutation_context.carried_over(once, old, records, twice, new) == {}
    assert mutation_context.carried_over(once, old, records, once, old) == records  # the same source: all
