"""The fallback report: which aten ops ran where, how often, at what cost."""
from __future__ import annotations

import atexit
import json
import os
import sys
import time
import warnings
from contextlib import contextmanager

from .. import _C
from ..core import _env, _state
from ..core._callers import program_stacklevel
from ..integrations import _compile
from ..runtime import _transfers
from ._html import render
from ._sites import short_site

_ROUTES = ("override", "native", "fallback")
_since = time.perf_counter()
_atexit_registered = False


class Report:
    """Counters per op for one span of time (since the last reset, or one `track()` scope).

    `str(report)` is an aligned table; `to_dict()`, `to_json()` and `save(path)` give the
    same data for tools (`save("report.html")` writes a page with a chart, JSON otherwise).
    """

    def __init__(self, rows: list[dict] | None = None, elapsed_s: float = 0.0, chip: str | None = None,
                 compiled_calls: int = 0, downcast_to: str | None = None,
                 bytes_between_devices: int = 0):
        self.rows = [r for r in (rows or []) if sum(r["calls"].values())]
        # Calls of torch.compile'd graphs: they run generated code, not routed ops, so
        # their ops are not in the rows.
        self.compiled_calls = compiled_calls
        self.rows.sort(key=lambda r: (-r["calls"]["fallback"], -r["fallback_ns"], r["op"]))
        self.elapsed_s = elapsed_s
        self.chip = chip
        # dtype_policy="downcast" on a chip without native bfloat16: the dtype bfloat16 ran in
        self.downcast_to = downcast_to
        # Bytes copied from one flagos device to another (a model split over devices): counted
        # by the copy ops themselves, not by any op's row
        self.bytes_between_devices = bytes_between_devices

    # -- totals ---------------------------------------------------------
    def calls(self, route: str | None = None) -> int:
        routes = _ROUTES if route is None else (route,)
        return sum(r["calls"][k] for r in self.rows for k in routes)

    @property
    def fallback_ops(self) -> list[str]:
        return [r["op"] for r in self.rows if r["calls"]["fallback"]]

    @property
    def fallback_seconds(self) -> float:
        return sum(r["fallback_ns"] for r in self.rows) / 1e9

    @property
    def downcast_calls(self) -> int:
        """Op calls whose bfloat16 output dtype the downcast policy changed."""
        return sum(r.get("downcast_calls", 0) for r in self.rows)

    @property
    def downcast_bytes(self) -> int:
        """Bytes of the tensors those calls made (in the dtype they were made in)."""
        return sum(r.get("downcast_bytes", 0) for r in self.rows)

    def op(self, name: str) -> dict | None:
        """The row of one op ('aten::add.Tensor'), or None if it did not run."""
        return next((r for r in self.rows if r["op"] == name), None)

    def to_dict(self) -> dict:
        total = self.calls()
        return {
            "chip": self.chip,
            "elapsed_s": self.elapsed_s,
            "totals": {
                "ops": len(self.rows),
                "calls": total,
                "calls_by_route": {k: self.calls(k) for k in _ROUTES},
                "fallback_ops": len(self.fallback_ops),
                "fallback_s": self.fallback_seconds,
                "fallback_call_share": self.calls("fallback") / total if total else 0.0,
                "fallback_time_share": (self.fallback_seconds / self.elapsed_s
                                        if self.elapsed_s else 0.0),
                "bytes_to_host": sum(r["bytes_to_host"] for r in self.rows),
                "bytes_to_device": sum(r["bytes_to_device"] for r in self.rows),
                "bytes_between_devices": self.bytes_between_devices,
                "compiled_graph_calls": self.compiled_calls,
                "downcast_calls": self.downcast_calls,
                "downcast_bytes": self.downcast_bytes,
            },
            "downcast_to": self.downcast_to,
            "ops": [dict(r) for r in self.rows],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path) -> None:
        """Write the report to `path`: a self-contained HTML page for .html/.htm, JSON otherwise."""
        path = os.fspath(path)
        if path.lower().endswith((".html", ".htm")):
            text = render(self.to_dict())
        else:
            text = self.to_json()
        with open(path, "w") as f:
            f.write(text)

    def __str__(self) -> str:
        d = self.to_dict()
        t = d["totals"]
        head = ("op", "route", "calls", "fallback ms", "MB to host", "MB from host", "first call site")
        body = []
        for r in self.rows:
            c = r["calls"]
            route = "/".join(k for k in _ROUTES if c[k])
            body.append((r["op"], route, str(sum(c.values())), f"{r['fallback_ns'] / 1e6:.2f}",
                         f"{r['bytes_to_host'] / 1e6:.3f}", f"{r['bytes_to_device'] / 1e6:.3f}",
                         short_site(r["site"])))
        widths = [max(len(x) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
        numeric = {2, 3, 4, 5}

        def fmt(row):
            return "  ".join(v.rjust(w) if i in numeric else v.ljust(w)
                             for i, (v, w) in enumerate(zip(row, widths))).rstrip()

        lines = [f"flagos fallback report (chip: {self.chip or '-'}, {self.elapsed_s:.2f} s)",
                 fmt(head), fmt(tuple("-" * w for w in widths))]
        lines += [fmt(r) for r in body]
        lines.append(
            f"total: {t['ops']} ops, {t['calls']} calls; fallback: {t['fallback_ops']} ops, "
            f"{t['calls_by_route']['fallback']} calls ({100 * t['fallback_call_share']:.1f}% of "
            f"calls), {1000 * t['fallback_s']:.2f} ms ({100 * t['fallback_time_share']:.1f}% of "
            f"{self.elapsed_s:.2f} s), {t['bytes_to_host'] / 1e6:.2f} MB to host, "
            f"{t['bytes_to_device'] / 1e6:.2f} MB back")
        if t["bytes_between_devices"]:
            lines.append(f"between devices: {t['bytes_between_devices'] / 1e6:.3f} MB copied from "
                         f"one flagos device to another ({t['bytes_between_devices']} bytes)")
        if self.downcast_to or t["downcast_calls"]:
            lines.append(f"downcast (dtype_policy='downcast'): {t['downcast_calls']} calls made "
                         f"{self.downcast_to or 'another dtype'} instead of bfloat16, "
                         f"{t['downcast_bytes'] / 1e6:.3f} MB")
        if self.compiled_calls:
            lines.append(f"compiled graphs: {self.compiled_calls} calls of torch.compile'd graphs "
                         f"ran as generated code; their ops are not counted in this table")
        return "\n".join(lines)

    __repr__ = __str__


def _chip() -> str | None:
    state = _state.active_or_none()
    return state.chip.name if state else None


def _downcast_to() -> str | None:
    state = _state.active_or_none()
    to = state.downcast_to if state else None
    return str(to).removeprefix("torch.") if to is not None else None


def fallback_report() -> Report:
    """Every op routed since activation or the last `reset_report()`."""
    return Report(_C.table(), time.perf_counter() - _since, _chip(), _compile.compiled_calls(),
                  _downcast_to(), _transfers.total())


def reset_report() -> None:
    """Zero all counters (the downcast counts and the bytes between devices too) and restart
    the clock."""
    global _since
    _C.reset_counters()
    _transfers.reset()
    _compile.reset_compiled_calls()
    _since = time.perf_counter()


def _diff(after: list[dict], before: list[dict]) -> list[dict]:
    prev = {r["op"]: r for r in before}
    out = []
    for r in after:
        p = prev.get(r["op"])
        if p is None:
            out.append(r)
            continue
        d = dict(r)
        d["calls"] = {k: r["calls"][k] - p["calls"][k] for k in r["calls"]}
        for k in ("fallback_ns", "bytes_to_host", "bytes_to_device", "downcast_calls",
                  "downcast_bytes"):
            d[k] = r[k] - p[k]
        out.append(d)
    return out


@contextmanager
def track():
    """`with flagos.track() as report:` — the report of just this scope, filled in at exit."""
    report = Report(chip=_chip(), downcast_to=_downcast_to())
    before = _C.table()
    compiled_before = _compile.compiled_calls()
    between_before = _transfers.total()
    start = time.perf_counter()
    try:
        yield report
    finally:
        scoped = Report(_diff(_C.table(), before), time.perf_counter() - start, _chip(),
                        _compile.compiled_calls() - compiled_before, _downcast_to(),
                        _transfers.total() - between_before)
        report.__dict__.update(scoped.__dict__)


def _write_at_exit() -> None:
    path = _env.get("FLAGOS_REPORT")
    if not path:
        return
    report = fallback_report()
    try:
        report.save(path)
    except OSError as e:
        # Never lose the run: say why, and put the report where it can still be read.
        warnings.warn(f"FLAGOS_REPORT={path!r} could not be written ({e}); the report follows "
                      f"on stderr. Point FLAGOS_REPORT at a writable file.", RuntimeWarning, stacklevel=1)
        print(report.to_json(), file=sys.stderr)


def _check_writable(path: str) -> None:
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        warnings.warn(f"FLAGOS_REPORT={path!r} is not writable ({e}); the report will go to "
                      f"stderr at exit instead. Point FLAGOS_REPORT at a writable file.",
                      RuntimeWarning, stacklevel=program_stacklevel())


def on_activate() -> None:
    global _atexit_registered, _since
    _since = time.perf_counter()
    path = _env.get("FLAGOS_REPORT")
    if path:
        _check_writable(path)
    if not _atexit_registered:
        atexit.register(_write_at_exit)
        _atexit_registered = True
