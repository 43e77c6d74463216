"""The pytest plugin of the mutation runs (`-p mutation_plugin`, see scripts/mutation_common.py).

- MUTATION_ONLY_TESTS=<file>: run only the tests whose node ids the file lists, one per line
  (the tests that ran the mutated line, from scripts/mutation_coverage.py).
- During the coverage pass (MUTATION_COVERAGE_DIR set, coverage started by sitecustomize.py):
  each test's lines are recorded under its node id, and the processes it starts inherit the
  node id through MUTATION_COVERAGE_CONTEXT. Lines run outside any test (imports, collection)
  are recorded under the empty context.
"""
import os

import pytest

try:
    import coverage  # installed in the mutation runs' environment only (scripts/mutation_full.sh)
except ImportError:
    coverage = None

CONTEXT = "MUTATION_COVERAGE_CONTEXT"


def _coverage():
    if coverage is None or not os.environ.get("MUTATION_COVERAGE_DIR"):
        return None
    return coverage.Coverage.current()


def _switch(context: str) -> None:
    cov = _coverage()
    if cov is not None:
        os.environ[CONTEXT] = context
        cov.switch_context(context)


def pytest_collection_modifyitems(config, items):
    only = os.environ.get("MUTATION_ONLY_TESTS")
    if not only:
        return
    with open(only) as f:
        wanted = {line.rstrip("\n") for line in f if line.strip()}
    kept = [item for item in items if item.nodeid in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
    items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _switch(item.nodeid)
    yield


def pytest_sessionfinish(session, exitstatus):
    _switch("")
