"""Which tests run each line of a module, so that a Python mutant runs the tests that reach it
instead of its module's whole selection (scripts/mutation_python.py, `--narrow`, the default).

The coverage pass runs a module's selection (scripts/mutation_map.py) once on the unmutated
tree with every Python process measured: the pytest process and the ones its tests start
(scripts/mutation_pytest/sitecustomize.py), each line recorded under the node id of the test
that ran it (scripts/mutation_pytest/mutation_plugin.py). A mutant then runs

- the tests that ran its statement, when every process that ran it did so inside a test;
- the whole selection when the statement also ran outside any test (import, collection: every
  test reaches it) or in no measured process (one killed by a signal; a forked child is
  measured, under the test that forked it).

A mutant that survives the narrow run runs the whole selection before it counts as a survivor:
narrowing makes kills cheaper and never turns a killed mutant into a survivor.

The map of a module is kept in <work>/python/coverage/<module>.json for one fingerprint of the
tree (sources and tests); any change to either measures it again.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys

import coverage
import mutation_common as common
from mutation_map import tests_for
from mutation_reach import OUTSIDE_TESTS, CoverageMap


def measure(work: str, tree: str, module: str, tree_print: str) -> CoverageMap:
    """The module's map, measured on the unmutated tree unless known for this fingerprint."""
    path = os.path.join(work, "python", "coverage", module.replace("/", "__") + ".json")
    known = common.load_json(path, {})
    if known.get("fingerprint") == tree_print:
        return CoverageMap.from_json(known["map"])
    runs = tests_for(module)
    target = os.path.join(tree, module)
    data_dir = os.path.join(work, "python", "coverage-data")
    tests: list[list[str]] = []
    lines: dict[int, dict[int, set[int]]] = {}
    print(f"coverage  {module}: which tests run each line", flush=True)
    for index, run in enumerate(runs):
        shutil.rmtree(data_dir, ignore_errors=True)
        os.makedirs(data_dir)
        outcome = common.run_selection(tree, [run], extra_env={"MUTATION_COVERAGE_DIR": data_dir,
                                                               "MUTATION_COVERAGE_INCLUDE": target})
        if outcome.status != common.SURVIVED:
            sys.exit(f"coverage pass failed for {module} ({outcome.status}): {outcome.detail}")
        names: dict[str, int] = {}
        for data_file in glob.glob(os.path.join(data_dir, "coverage.*")):
            data = coverage.CoverageData(basename=data_file)
            data.read()
            for measured in data.measured_files():
                if os.path.realpath(measured) != os.path.realpath(target):
                    continue
                for line, contexts in data.contexts_by_lineno(measured).items():
                    slot = lines.setdefault(line, {}).setdefault(index, set())
                    for context in contexts:
                        slot.add(OUTSIDE_TESTS if not context else names.setdefault(context, len(names)))
        tests.append(sorted(names, key=names.get))
        print(f"coverage  {module}: {run.label()}: {len(names)} tests reach it ({outcome.seconds:.0f} s)",
              flush=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    result = CoverageMap(tests, {line: {r: sorted(t) for r, t in runs_.items()} for line, runs_ in lines.items()})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    common.save_json(path, {"fingerprint": tree_print, "map": result.to_json()})
    return result
