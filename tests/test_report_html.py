"""`flagos.fallback_report().save("report.html")`: one self-contained page, read back here with
a real HTML parser and checked against the report's own data."""
import json
from html.parser import HTMLParser

import torch
from conftest import CHIP, device_mode_only

import flagos
from flagos.report._html import render
from flagos.report._sites import short_site

pytestmark = device_mode_only

VOID = {"meta", "br", "img", "input", "link", "hr", "source", "wbr", "col", "area", "base"}


class Page(HTMLParser):
    """What the page holds: op table rows, chart bars, call sites, and every tag's nesting."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.problems, self.tags = [], [], []
        self.headers, self.rows, self.bars, self.sites = [], [], [], {}
        self.scripts, self.title = [], ""
        self._cell = self._row = self._site = None
        self._in = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "th":
            self.headers.append(a)
        elif tag == "tr" and "data-op" in a:
            self._row = {"op": a["data-op"], "class": a.get("class"), "cells": []}
        elif tag == "td" and self._row is not None:
            self._cell = {"attrs": a, "text": ""}
        elif tag == "rect" and a.get("class") == "bar":
            self.bars.append(a)
        elif tag == "li" and "data-site" in a:
            self._site = a["data-site"]
            self.sites[self._site] = ""
        elif tag == "script" or tag == "title" and "svg" not in self.stack:  # the page's title
            self._in = tag

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()
        if tag == "td" and self._cell is not None:
            self._row["cells"].append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None
        elif tag == "li":
            self._site = None
        elif tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data
        if self._site is not None:
            self.sites[self._site] += data
        if self._in == "script":
            self.scripts.append(data)
        elif self._in == "title":
            self.title += data


def _run_model(dev):
    """A small model with two ops forced to the CPU fallback; its output must match PyTorch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    xs = [torch.randn(8, 16) for _ in range(3)]
    with torch.no_grad():
        expected = [model(x).softmax(-1).cumsum(-1) for x in xs]
        model.to(dev)
        flagos.set_route("aten::gelu", "fallback")
        flagos.set_route("aten::cumsum", "fallback")
        with flagos.track() as report:
            got = [model(x.to(dev)).softmax(-1).cumsum(-1).cpu() for x in xs]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    return report


def test_page_holds_the_report(dev, tmp_path):
    report = _run_model(dev)
    data = report.to_dict()
    path = tmp_path / "report.html"
    report.save(str(path))
    page = Page()
    page.feed(path.read_text())
    page.close()
    assert page.problems == [] and page.stack == []  # every element closed where it opened
    assert page.title == f"flagos fallback report: {CHIP}"

    # the table: one row per op, with the report's route, calls, fallback calls and time
    rows = {r["op"]: r for r in page.rows}
    assert set(rows) == {r["op"] for r in data["ops"]}
    for r in data["ops"]:
        cells = rows[r["op"]]["cells"]
        assert cells[0]["text"] == r["op"]
        assert cells[1]["text"] == "/".join(k for k in ("override", "native", "fallback") if r["calls"][k])
        assert int(cells[2]["attrs"]["data-value"]) == sum(r["calls"].values()) == int(cells[2]["text"])
        assert int(cells[3]["attrs"]["data-value"]) == r["calls"]["fallback"]
        assert int(cells[4]["attrs"]["data-value"]) == r["fallback_ns"]
        assert cells[4]["text"] == f"{r['fallback_ns'] / 1e6:.2f}"
        # an op first seen where no frame is user code (autograd's engine thread) has no site
        assert cells[8]["text"] == short_site(r["site"]) and cells[8]["attrs"]["title"] == (r["site"] or "")
        assert rows[r["op"]]["class"] == ("fallback" if r["calls"]["fallback"] else "native")
    assert rows["aten::gelu"]["cells"][3]["text"] == "3" and rows["aten::cumsum"]["cells"][3]["text"] == "3"

    # sortable by calls and by fallback time, with the page's own script
    sortable = [h for h in page.headers if h.get("class") == "sortable"]
    assert len(sortable) == 3 and all(h["data-sort"] == "num" for h in sortable)
    assert any("aria-sort" in s and "dataset.value" in s for s in page.scripts)

    # the chart: one bar per op that spent time in the fallback, longest first
    timed = sorted((r for r in data["ops"] if r["fallback_ns"]), key=lambda r: -r["fallback_ns"])
    assert [b["data-op"] for b in page.bars] == [r["op"] for r in timed]
    assert {"aten::gelu", "aten::cumsum"} <= {b["data-op"] for b in page.bars}
    widths = [float(b["width"]) for b in page.bars]
    assert widths == sorted(widths, reverse=True) and widths[0] == 480.0
    for b, r in zip(page.bars, timed):
        assert b["data-ms"] == f"{r['fallback_ns'] / 1e6:.2f}"

    # first call sites: every op listed under the site the report gives it; a fallback's site is
    # where it first fell back (this file), other ops keep where the process first saw them
    for r in data["ops"]:
        assert r["op"] in page.sites[r["site"] or "-"]
    for op in ("aten::gelu", "aten::cumsum"):
        assert rows[op]["cells"][8]["attrs"]["title"].startswith(__file__ + ":")

    # self-contained: nothing loaded from elsewhere
    for tag, attrs in page.tags:
        assert tag not in ("link", "img", "iframe", "object", "embed"), tag
        assert not (tag == "script" and "src" in attrs)
        for name in ("src", "href"):
            assert name not in attrs, (tag, attrs)
    assert "@import" not in path.read_text() and "url(" not in path.read_text()


def test_page_without_fallbacks_says_so(dev, tmp_path):
    x = torch.randn(4, 4)
    with flagos.track() as report:
        y = (x.to(dev) * 2).cpu()
    torch.testing.assert_close(y, x * 2)
    report.save(tmp_path / "quiet.htm")  # a path object, and the .htm suffix
    page = Page()
    page.feed((tmp_path / "quiet.htm").read_text())
    assert page.bars == [] and ("p", {"id": "no-fallback"}) in page.tags
    assert {r["op"] for r in page.rows} == {r["op"] for r in report.to_dict()["ops"]}


def test_save_picks_the_format_by_suffix(dev, tmp_path):
    x = torch.randn(3)
    flagos.set_route("aten::neg", "fallback")
    with flagos.track() as report:
        (-x.to(dev)).cpu()
    for name in ("report.json", "report.txt"):  # anything but .html/.htm stays JSON, as before
        report.save(tmp_path / name)
        assert json.loads((tmp_path / name).read_text()) == json.loads(report.to_json())
    assert report.op("aten::neg")["calls"]["fallback"] == 1


def test_an_op_without_a_call_site(dev, tmp_path):
    """An op first seen where no frame is user code (autograd's engine thread runs backward)
    has no site: its cell shows "-" and it is listed under "-"."""
    x = torch.randn(3)
    flagos.set_route("aten::neg", "fallback")
    with flagos.track() as tracked:
        (-x.to(dev)).cpu()
    rows = [dict(r, site=None) if r["op"] == "aten::neg" else r for r in tracked.rows]
    report = flagos.report._report.Report(rows, tracked.elapsed_s, tracked.chip)
    report.save(tmp_path / "no-site.html")
    page = Page()
    page.feed((tmp_path / "no-site.html").read_text())
    cells = next(r for r in page.rows if r["op"] == "aten::neg")["cells"]
    assert cells[8]["text"] == "-" and cells[8]["attrs"]["title"] == ""
    assert "aten::neg" in page.sites["-"]


def _row(op, fallback, native, ns, to_host, to_device, site=None):
    return {"op": op, "calls": {"override": 0, "native": native, "fallback": fallback, "error": 0},
            "fallback_ns": ns, "bytes_to_host": to_host, "bytes_to_device": to_device, "site": site}


def _page_of(report, path) -> tuple[Page, str]:
    report.save(str(path))
    text = path.read_text()
    page = Page()
    page.feed(text)
    page.close()
    return page, text


def test_a_page_of_a_report_built_by_hand(tmp_path):
    """Hand-computed figures: rows by fallback time, longest first (then fallback calls), the
    megabytes of each row and of the summary, and the downcast line only where a downcast
    policy or downcast calls are in the report."""
    first, second = "/home/u/project/train.py:12", "/home/u/project/train.py:20"
    rows = [_row("aten::mm", 3, 0, 2_500_000, 3_000_000, 1_500_000),
            _row("aten::cat", 2, 0, 9_000_000, 10, 123_456_789_000, site=first),
            _row("aten::sort", 2, 0, 1_000_000, 987_654_321_000, 2_000, site=second),
            _row("aten::add.Tensor", 0, 5, 0, 0, 0, site=first)]
    page, text = _page_of(flagos.Report(rows, elapsed_s=1.0, chip="sim"), tmp_path / "plain.html")
    assert [r["op"] for r in page.rows] == ["aten::cat", "aten::mm", "aten::sort", "aten::add.Tensor"]
    cat = page.rows[0]["cells"]
    assert (cat[5]["text"], cat[6]["text"]) == ("0.000", "123456.789")
    assert (page.rows[1]["cells"][5]["text"], page.rows[1]["cells"][6]["text"]) == ("3.000", "1.500")
    assert page.rows[2]["cells"][5]["text"] == "987654.321"
    assert "12.50 ms in fallbacks · 987657.32 MB to host, 123458.29 MB back" in text
    assert 'id="downcast"' not in text
    # call sites, most fallback time first; the ops that fell back there in bold
    sites = [line for line in text.splitlines() if line.startswith("<li data-site=")]
    assert sites == [
        f'<li data-site="{first}"><code>{short_site(first)}</code>: aten::add.Tensor, <b>aten::cat</b></li>',
        '<li data-site="-"><code>-</code>: <b>aten::mm</b></li>',
        f'<li data-site="{second}"><code>{short_site(second)}</code>: <b>aten::sort</b></li>']
    _, downcast = _page_of(flagos.Report(rows, elapsed_s=1.0, chip="sim", downcast_to="torch.float32"),
                           tmp_path / "downcast.html")
    assert 'id="downcast"' in downcast and "0 calls made torch.float32 instead of bfloat16" in downcast


def test_every_figure_and_the_chart_geometry_exactly(tmp_path):
    """The summary's shares, milliseconds and megabytes with values large enough that a unit off
    by one part in a million shows; the downcast and between-devices lines; and the chart's
    geometry (hand-computed): 8 px a label character plus 16, 22 px a row, the longest bar
    480 px, the others in proportion, each label ending left of its bar."""
    rows = [_row("aten::sort", 7, 0, 123_456_789_000, 987_654_321_000, 123_456_789_000),
            _row("aten::mm", 1, 3, 61_728_394_500, 0, 0),
            _row("aten::neg", 1, 0, 1, 0, 0)]  # a single nanosecond still draws a bar
    report = flagos.Report(rows, elapsed_s=1000.0, bytes_between_devices=1_234_567_891)
    page, text = _page_of(report, tmp_path / "exact.html")
    assert page.title == "flagos fallback report: -"
    assert '<p class="meta">chip <b>-</b> · 1000.00 s tracked</p>' in text
    assert ('<p class="verdict">fallback share of op time <b>18.5%</b> · 3 of 3 ops and 9 of 12 '
            'calls (75.0%) fell back · 185185.18 ms in fallbacks · 987654.32 MB to host, '
            '123456.79 MB back</p>') in text
    assert ('<p class="meta" id="between-devices">between devices: 1234.568 MB copied from one '
            'flagos device to another</p>') in text
    assert 'id="downcast"' not in text

    svg = next(a for tag, a in page.tags if tag == "svg")
    label_w = 8 * len("aten::sort") + 16
    assert (svg["width"], svg["height"]) == (str(label_w + 480 + 90), str(4 + 22 * 3 + 4)) == ("666", "74")
    assert svg["viewbox"] == "0 0 666 74"  # the parser lowercases names
    assert [(b["data-op"], b["x"], b["y"], b["width"], b["height"], b["data-ms"]) for b in page.bars] == [
        ("aten::sort", "96", "7", "480.0", "16", "123456.79"),
        ("aten::mm", "96", "29", "240.0", "16", "61728.39"),
        ("aten::neg", "96", "51", "1.0", "16", "0.00")]
    texts = [a for tag, a in page.tags if tag == "text"]
    assert [(a["x"], a["y"]) for a in texts] == [
        ("88", "19"), ("582.0", "19"), ("88", "41"), ("342.0", "41"), ("88", "63"), ("103.0", "63")]
    assert "<title>aten::sort: 123456.79 ms in 7 calls</title>" in text
    assert "more ops fell back" not in text  # every timed op has its bar

    # the downcast line where the data has no downcast counts (an analysis of an older report)
    data = report.to_dict()
    del data["totals"]["downcast_calls"], data["totals"]["downcast_bytes"]
    data["downcast_to"] = "float16"
    assert ("downcast (dtype_policy=&#x27;downcast&#x27;): 0 calls made float16 instead of "
            "bfloat16, 0.000 MB</p>") in render(data)
    counted = flagos.Report([dict(rows[0], downcast_calls=3, downcast_bytes=1_234_567_891)], elapsed_s=1.0)
    assert ("downcast (dtype_policy=&#x27;downcast&#x27;): 3 calls made another dtype instead of "
            "bfloat16, 1234.568 MB</p>") in render(counted.to_dict())


def test_the_chart_shows_the_25_longest_and_counts_the_rest(tmp_path):
    rows = [_row(f"aten::op{i:02d}", 1, 0, 1_000 * (i + 1), 0, 0) for i in range(30)]
    page, text = _page_of(flagos.Report(rows, elapsed_s=1.0), tmp_path / "many.html")
    assert [b["data-op"] for b in page.bars] == [f"aten::op{i:02d}" for i in range(29, 4, -1)]
    assert "<p class=\"meta\">5 more ops fell back; the table lists them all.</p>" in text
    assert len(page.rows) == 30


def test_ties_in_fallback_time_go_to_fallback_calls_then_calls():
    """Rows and call sites with the same fallback time: most fallback calls first, then (rows)
    most calls; the op's name or the site's path only last."""
    rows = [_row("aten::a", 0, 5, 0, 0, 0), _row("aten::b", 0, 9, 0, 0, 0),
            _row("aten::c", 2, 0, 0, 0, 0, site="/src/z.py:1"), _row("aten::d", 1, 0, 0, 0, 0, site="/src/a.py:1")]
    page = Page()
    page.feed(render(flagos.Report(rows, elapsed_s=1.0).to_dict()))
    assert [r["op"] for r in page.rows] == ["aten::c", "aten::d", "aten::b", "aten::a"]
    assert list(page.sites) == ["/src/z.py:1", "/src/a.py:1", "-"]
