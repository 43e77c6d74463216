"""Which mutants of a changed module are still the mutants a run killed (the Python pass).

A result belongs to the source it ran on: change one line of a module and every mutant's key
(line, column, operator, occurrence) may shift. Most of a changed module is unchanged, though,
and a mutant inside an unchanged function is the same mutation of the same code, reached by
the same tests. So a mutant is named by its context, independent of where the function sits:

    <sha256 of its scope's text> +<line within the scope>:<column> <operator> #<occurrence within the scope>

where the scope is the innermost function around it, or the top-level statement it is in.
A killed mutant whose context the new source has again is carried over to the
new key without running it; survivors and everything else run again. This is the usual
incremental-mutation trade (Stryker's incremental mode): a change elsewhere in the module
could in principle hide a mutant's effect from its tests, which only a full run rules out.
"""
from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass

CARRIED_STATUSES = ("killed",)


@dataclass(frozen=True)
class Mutant:
    key: str         # the ledger's key: "line:col Operator #occurrence"
    line: int
    col: int
    operator: str
    occurrence: int  # cosmic-ray's: the operator's n-th mutation point in the module


def _scopes(source: str) -> list[tuple[int, int]]:
    """(first line, last line) of every function (decorators included) and top-level statement."""
    tree = ast.parse(source)
    spans = [(n.lineno, n.end_lineno) for n in tree.body]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first, node.end_lineno))
    return spans


def scope_span(spans: list[tuple[int, int]], line: int) -> tuple[int, int] | None:
    """The innermost span around `line` (the shortest one that holds it)."""
    around = [s for s in spans if s[0] <= line <= s[1]]
    return min(around, key=lambda s: s[1] - s[0]) if around else None


def contexts(source: str, mutants: list[Mutant]) -> dict[str, str]:
    """Each mutant's context (see the module's docstring); `mutants` must be all of the
    source's mutants, so an occurrence's place within its scope is known."""
    lines = source.splitlines()
    spans = _scopes(source)
    scope_of = {m.key: scope_span(spans, m.line) for m in mutants}
    first: dict[tuple, int] = {}  # (scope, operator) -> its lowest occurrence in that scope
    for m in mutants:
        k = (scope_of[m.key], m.operator)
        first[k] = min(first.get(k, m.occurrence), m.occurrence)
    digests: dict[tuple[int, int], str] = {}
    named = {}
    for m in mutants:
        span = scope_of[m.key]
        if span is None:
            continue
        if span not in digests:
            text = "\n".join(lines[span[0] - 1:span[1]])
            digests[span] = hashlib.sha256(text.encode()).hexdigest()[:16]
        within = m.occurrence - first[(span, m.operator)]
        named[m.key] = f"{digests[span]} +{m.line - span[0]}:{m.col} {m.operator} #{within}"
    return named


def carried_over(old_source: str, old_mutants: list[Mutant], old_records: dict[str, dict],
                 new_source: str, new_mutants: list[Mutant]) -> dict[str, dict]:
    """New key -> the old record, for every killed old mutant whose context the
    new source has again. A context that names more than one mutant on either side (two
    identical functions) carries nothing."""
    old_named = contexts(old_source, old_mutants)
    by_context: dict[str, list[str]] = {}
    for key, context in old_named.items():
        by_context.setdefault(context, []).append(key)
    new_named = contexts(new_source, new_mutants)
    new_count: dict[str, int] = {}
    for context in new_named.values():
        new_count[context] = new_count.get(context, 0) + 1
    carried = {}
    for key, context in new_named.items():
        old_keys = by_context.get(context, [])
        if len(old_keys) != 1 or new_count[context] != 1:
            continue
        record = old_records.get(old_keys[0])
        if record is not None and record.get("status") in CARRIED_STATUSES:
            carried[key] = record
    return carried
