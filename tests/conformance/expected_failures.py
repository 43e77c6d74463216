"""Conformance cases expected to fail today, grouped by cause: {cause: [patterns]}.

A pattern is chip:op[.variant]:dtype:direction with fnmatch wildcards. The list only shrinks:
the sweep fails on a failing case that is not listed, and on a pattern whose cases now all pass.
"""

EXPECTED = {
}
