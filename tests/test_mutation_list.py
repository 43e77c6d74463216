"""scripts/mutation_check.py's planted bugs stay plantable: each edit's original text is in its
file exactly once, so a refactor that moves a line fails here, in every CI run, rather than in
the next mutation check (which is not part of CI)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import mutation_check  # noqa: E402
import mutation_map  # noqa: E402


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
