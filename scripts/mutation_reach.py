"""Which tests reach a mutant: the map from a module's lines to the tests that ran them
(measured by scripts/mutation_coverage.py), and the lines whose coverage decides whether a
mutant on a given line runs. No dependency beyond the standard library, so the suite checks it.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

OUTSIDE_TESTS = -1  # the test index of lines run outside any test (the empty context)


@dataclass
class CoverageMap:
    """tests[r]: node ids of run r that ran a line of the module; lines: line -> {run: [test
    indexes]} (OUTSIDE_TESTS among them when the line also ran outside a test)."""
    tests: list[list[str]]
    lines: dict[int, dict[int, list[int]]]

    def selection(self, lines: range) -> list[list[str] | None] | None:
        """Per run of the selection: the node ids to run (None: the whole run, []: skip it),
        or None when the whole selection must run."""
        reached: dict[int, set[int]] = {}
        for line in lines:
            for run, tests in self.lines.get(line, {}).items():
                reached.setdefault(run, set()).update(tests)
        if not reached or any(OUTSIDE_TESTS in tests for tests in reached.values()):
            return None
        return [sorted(self.tests[run][t] for t in reached[run]) if run in reached else []
                for run in range(len(self.tests))]

    def to_json(self) -> dict:
        return {"tests": self.tests,
                "lines": {str(line): {str(r): t for r, t in runs.items()} for line, runs in self.lines.items()}}

    @classmethod
    def from_json(cls, data: dict) -> CoverageMap:
        return cls(data["tests"], {int(line): {int(r): t for r, t in runs.items()}
                                   for line, runs in data["lines"].items()})


def statement_lines(source: str, line: int) -> range:
    """The lines whose coverage tells whether a mutant on `line` runs: the innermost statement
    holding it (a compound statement's header only, not its body), or the line alone."""
    best = None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno and (node.end_lineno or 0) <= (best.end_lineno or 0):
                best = node
    if best is None:
        return range(line, line + 1)
    body = getattr(best, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        end = max(best.lineno, body[0].lineno - 1)  # the header, up to the first body line
        if line > end:  # a decorator line, or an `else:` arm's own line
            return range(line, line + 1)
        return range(best.lineno, end + 1)
    return range(best.lineno, (best.end_lineno or best.lineno) + 1)


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) positions of every annotation in a module that has
    `from __future__ import annotations` (PEP 563: annotations are kept as strings, never
    evaluated, so a mutant inside one changes nothing); none for other modules."""
    tree = ast.parse(source)
    postponed = any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
                    and any(alias.name == "annotations" for alias in node.names) for node in tree.body)
    if not postponed:
        return []
    spans = []
    for node in ast.walk(tree):
        annotation = (node.returns if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else
                      node.annotation if isinstance(node, (ast.arg, ast.AnnAssign)) else None)
        if annotation is not None:
            spans.append(((annotation.lineno, annotation.col_offset),
                          (annotation.end_lineno, annotation.end_col_offset)))
    return spans


def in_annotation(spans, position: tuple[int, int]) -> bool:
    return any(start <= tuple(position) < end for start, end in spans)
