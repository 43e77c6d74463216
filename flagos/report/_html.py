"""The fallback report as one self-contained HTML page (styles, chart and script inline).

`render(data)` takes `Report.to_dict()`, or the analysis `flagos analyze` makes (the same keys
plus command, status, verdict and target), and returns the page: totals, a bar chart of
fallback time by op (inline SVG), the per-op table (sortable by calls and fallback time) and
the first call sites. Nothing is fetched from elsewhere, so the file can be mailed or attached.
"""
from __future__ import annotations

from html import escape

from ._sites import short_site

CHART_OPS = 25          # bars in the chart: the ops with the most fallback time
BAR_WIDTH = 480         # pixels for the longest bar

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #1d2430; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
.meta { color: #5a6372; } .verdict { font-size: 16px; margin: 12px 0; }
.verdict b { color: #b3261e; }
code { font: 12px ui-monospace, "SFMono-Regular", Menlo, monospace; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 4px 10px; border-bottom: 1px solid #e3e6eb; text-align: left; vertical-align: top; }
th { background: #f4f6f9; position: sticky; top: 0; white-space: nowrap; }
td.meta { font-size: 12px; min-width: 20em; }
th.sortable { cursor: pointer; user-select: none; } th.sortable:hover { background: #e6ebf2; }
th[aria-sort=descending]::after { content: " \\25BC"; } th[aria-sort=ascending]::after { content: " \\25B2"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.fallback td.route { color: #b3261e; font-weight: 600; }
td.target-fallback { color: #b3261e; } td.target-unknown { color: #8a6d00; }
svg text { font: 12px ui-monospace, Menlo, monospace; fill: #1d2430; }
svg rect.bar { fill: #d9534f; }
ul.sites li { margin: 2px 0; }
"""

# Sort the op table by a numeric column: first click largest first, the next click reverses.
_SCRIPT = """
document.querySelectorAll("th.sortable").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0];
    var col = Array.prototype.indexOf.call(th.parentNode.children, th);
    var desc = th.getAttribute("aria-sort") !== "descending";
    table.querySelectorAll("th.sortable").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", desc ? "descending" : "ascending");
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = parseFloat(a.cells[col].dataset.value), y = parseFloat(b.cells[col].dataset.value);
      return desc ? y - x : x - y;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""

_ROUTES = ("override", "native", "fallback")


def _short_path(path: str) -> str:
    """A file as the table shows call sites: relative to the working directory or site-packages."""
    return short_site(f"{path}:").rstrip(":")


def _route(row: dict) -> str:
    return "/".join(k for k in _ROUTES if row["calls"][k])


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.2f}"


def _summary(data: dict) -> str:
    t = data["totals"]
    fallback_calls = t["calls_by_route"]["fallback"]
    lines = [
        "<h1>flagos fallback report</h1>",
        f'<p class="meta">chip <b>{escape(str(data.get("chip") or "-"))}</b> · '
        f'{data["elapsed_s"]:.2f} s tracked'
        + (f' · command <code>{escape(" ".join(data["command"]))}</code> (exit status '
           f'{data["status"]})' if data.get("command") else "") + "</p>",
        f'<p class="verdict">fallback share of op time <b>{100 * t["fallback_time_share"]:.1f}%</b>'
        f' · {t["fallback_ops"]} of {t["ops"]} ops and {fallback_calls} of {t["calls"]} calls '
        f'({100 * t["fallback_call_share"]:.1f}%) fell back · {1000 * t["fallback_s"]:.2f} ms in '
        f'fallbacks · {t["bytes_to_host"] / 1e6:.2f} MB to host, {t["bytes_to_device"] / 1e6:.2f} '
        f'MB back</p>',
    ]
    if data.get("downcast_to") or t.get("downcast_calls"):
        lines.append(f'<p class="meta" id="downcast">downcast (dtype_policy=&#x27;downcast&#x27;): '
                     f'{t.get("downcast_calls", 0)} calls made '
                     f'{escape(str(data.get("downcast_to") or "another dtype"))} instead of bfloat16, '
                     f'{t.get("downcast_bytes", 0) / 1e6:.3f} MB</p>')
    if t.get("bytes_between_devices"):
        lines.append(f'<p class="meta" id="between-devices">between devices: '
                     f'{t["bytes_between_devices"] / 1e6:.3f} MB copied from one flagos device to '
                     f'another</p>')
    target = data.get("target")
    if target:
        lines.append(f'<p class="verdict" id="target-verdict">{escape(target["verdict"])}'
                     f'<br><span class="meta">coverage: {escape(target["kind"])} '
                     f'<code title="{escape(str(target["source"]))}">'
                     f'{escape(_short_path(str(target["source"])))}</code></span></p>')
    return "\n".join(lines)


def _chart(ops: list[dict]) -> str:
    timed = sorted((r for r in ops if r["fallback_ns"] > 0), key=lambda r: -r["fallback_ns"])
    if not timed:
        return '<p id="no-fallback">No op fell back to the CPU.</p>'
    shown = timed[:CHART_OPS]
    label_w = 8 * max(len(r["op"]) for r in shown) + 16
    row_h, top = 22, 4
    longest = shown[0]["fallback_ns"]
    width = label_w + BAR_WIDTH + 90
    height = top + row_h * len(shown) + 4
    parts = [f'<svg id="fallback-chart" width="{width}" height="{height}" role="img" '
             f'viewBox="0 0 {width} {height}" aria-label="fallback time by op">']
    for i, r in enumerate(shown):
        y = top + i * row_h
        w = max(1.0, BAR_WIDTH * r["fallback_ns"] / longest)
        op = escape(r["op"])
        parts.append(
            f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{op}</text>'
            f'<rect class="bar" data-op="{op}" data-ms="{_ms(r["fallback_ns"])}" x="{label_w}" '
            f'y="{y + 3}" width="{w:.1f}" height="{row_h - 6}"><title>{op}: '
            f'{_ms(r["fallback_ns"])} ms in {r["calls"]["fallback"]} calls</title></rect>'
            f'<text x="{label_w + w + 6:.1f}" y="{y + 15}">{_ms(r["fallback_ns"])} ms</text>')
    parts.append("</svg>")
    if len(timed) > len(shown):
        parts.append(f'<p class="meta">{len(timed) - len(shown)} more ops fell back; the table '
                     f'lists them all.</p>')
    return "\n".join(parts)


def _table(ops: list[dict], target: dict | None) -> str:
    sortable = {"calls", "fallback calls", "fallback ms"}
    heads = ["op", "route", "calls", "fallback calls", "fallback ms", "MB to host", "MB from host",
             "dtypes", "first call site"]
    if target:
        heads += [f"on {target['chip']}", "why"]
    head = "".join(f'<th class="sortable" data-sort="num">{escape(h)}</th>' if h in sortable
                   else f"<th>{escape(h)}</th>" for h in heads)
    rows = []
    for r in sorted(ops, key=lambda r: (-r["fallback_ns"], -r["calls"]["fallback"],
                                        -sum(r["calls"].values()), r["op"])):
        calls = sum(r["calls"].values())
        cells = [
            f"<td><code>{escape(r['op'])}</code></td>",
            f'<td class="route">{_route(r)}</td>',
            f'<td class="num" data-value="{calls}">{calls}</td>',
            f'<td class="num" data-value="{r["calls"]["fallback"]}">{r["calls"]["fallback"]}</td>',
            f'<td class="num" data-value="{r["fallback_ns"]}">{_ms(r["fallback_ns"])}</td>',
            f'<td class="num">{r["bytes_to_host"] / 1e6:.3f}</td>',
            f'<td class="num">{r["bytes_to_device"] / 1e6:.3f}</td>',
            f"<td>{escape(', '.join(d.replace('torch.', '') for d in r.get('dtypes') or ()))}</td>",
            f'<td title="{escape(r["site"] or "")}"><code>{escape(short_site(r["site"]))}</code></td>',
        ]
        if target:
            t = r["target"]
            cells += [f'<td class="target-{t["route"]}">{t["route"]}</td>',
                      f'<td class="meta">{escape(t["reason"])}</td>']
        klass = "fallback" if r["calls"]["fallback"] else "native"
        rows.append(f'<tr class="{klass}" data-op="{escape(r["op"])}">{"".join(cells)}</tr>')
    return (f'<table id="ops"><thead><tr>{head}</tr></thead>\n<tbody>\n' + "\n".join(rows)
            + "\n</tbody></table>")


def _sites(ops: list[dict]) -> str:
    """Each first call site with the ops first called there, sites with most fallback time first."""
    by_site: dict[str, list[dict]] = {}
    for r in ops:
        by_site.setdefault(r["site"] or "-", []).append(r)
    order = sorted(by_site, key=lambda s: (-sum(r["fallback_ns"] for r in by_site[s]),
                                           -sum(r["calls"]["fallback"] for r in by_site[s]), s))
    items = []
    for site in order:
        names = ", ".join((f"<b>{escape(r['op'])}</b>" if r["calls"]["fallback"] else escape(r["op"]))
                          for r in sorted(by_site[site], key=lambda r: r["op"]))
        items.append(f'<li data-site="{escape(site)}"><code>{escape(short_site(site) if site != "-" else site)}'
                     f"</code>: {names}</li>")
    return '<ul class="sites" id="sites">\n' + "\n".join(items) + "\n</ul>"


def render(data: dict) -> str:
    """The page for a report's data (`Report.to_dict()` or a `flagos analyze` analysis)."""
    ops = data["ops"]
    target = data.get("target")
    title = f"flagos fallback report: {data.get('chip') or '-'}"
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        _summary(data),
        "<h2>Fallback time by op</h2>",
        _chart(ops),
        "<h2>Ops</h2>",
        '<p class="meta">Click <i>calls</i>, <i>fallback calls</i> or <i>fallback ms</i> to sort.</p>',
        _table(ops, target),
        "<h2>First call sites</h2>",
        '<p class="meta">Where each op was first called from code outside torch and flagos; '
        "ops in bold fell back.</p>",
        _sites(ops),
        f"<script>{_SCRIPT}</script>",
        "</body></html>",
        "",
    ])
