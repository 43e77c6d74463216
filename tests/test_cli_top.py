"""`flagos top`: every device, and the programs that export flagos metrics with their fallback
share. This test process is such a program: it runs a model and serves its metrics."""
import argparse
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
from conftest import CHIP, device_mode_only
from flagos_cli import command_env, first_line, run_json, run_workload

import flagos
from flagos.tools import _top
from flagos.tools.cli import main

pytestmark = device_mode_only


@pytest.fixture
def watched(tmp_path, monkeypatch):
    """This process running a model with its exporter announced in a private runtime dir,
    plus two records top must cope with: a program that has ended, one that does not answer."""
    monkeypatch.setenv("FLAGOS_RUNTIME_DIR", str(tmp_path))
    exporter = flagos.metrics.start_http_server(0)
    model, held = run_workload()  # model alive: its weights stay on the device
    folder = tmp_path / "exporters"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True).stdout.strip()
    (folder / f"{ended}.json").write_text(json.dumps(
        {"pid": int(ended), "host": "127.0.0.1", "port": 1, "url": "http://127.0.0.1:1/metrics", "chip": "cpu"}))
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (folder / f"{silent.pid}.json").write_text(json.dumps(
        {"pid": silent.pid, "host": "127.0.0.1", "port": 1, "url": "http://127.0.0.1:1/metrics", "chip": "cpu"}))
    yield {"env": {"FLAGOS_RUNTIME_DIR": str(tmp_path)}, "model": model, "held": held, "ended": int(ended),
           "silent": silent.pid, "folder": folder}
    silent.kill()
    silent.wait()
    exporter.stop()


def test_once_json_shows_devices_and_the_programs_fallback_share(watched):
    view = run_json("top", "--once", env=watched["env"])
    report = flagos.fallback_report().to_dict()["totals"]

    rows = {p["pid"]: p for p in view["processes"]}
    assert sorted(rows) == sorted([os.getpid(), watched["silent"]])  # the ended one is gone
    assert not (watched["folder"] / f"{watched['ended']}.json").exists()
    assert rows[watched["silent"]]["status"].startswith("error:")

    me = rows[os.getpid()]
    assert (me["chip"], me["mode"], me["version"], me["status"]) == (CHIP, "device", flagos.__version__, "ok")
    assert me["calls"] == report["calls"] and me["fallback_calls"] == report["calls_by_route"]["fallback"] >= 1
    assert me["fallback_share"] == pytest.approx(report["fallback_call_share"])
    assert me["fallback_seconds"] == pytest.approx(report["fallback_s"], abs=1e-6)
    if CHIP == "sim":
        assert me["memory_used"] >= watched["held"]

    devices = {(d["chip"], d["index"]): d for d in view["devices"]}
    assert ("cpu", 0) in devices and ("sim", 0) in devices and ("sim", 1) in devices
    assert 0.0 <= devices[("cpu", 0)]["utilization"] <= 1.0
    assert devices[("sim", 0)]["utilization"] is None  # sim exposes none
    assert all(d["memory_total"] > 0 and d["status"] == "ok" for d in view["devices"])


def test_refreshing_view_and_usage_errors(watched, capsys):
    assert main(["top", "--interval", "0.1", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("flagos top ") == 2 and "every 0.1 s" in out
    share = flagos.fallback_report().to_dict()["totals"]["fallback_call_share"]
    mine = [line for line in out.splitlines() if line.startswith(f"{os.getpid()} ")]
    assert len(mine) == 2 and all(f"{100 * share:.1f}%" in line for line in mine)

    assert main(["top", "--interval", "0.1", "--count", "2", "--json"]) == 0
    frames = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(frames) == 2 and all(f["devices"] for f in frames)

    for bad in (["--interval", "0"], ["--count", "0"]):
        with pytest.raises(SystemExit) as info:
            main(["top", *bad])
        assert info.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_memory_bars_are_ten_wide_and_filled_to_the_share_used():
    assert [_top._bar(used, 8 << 30) for used in (None, 0, 2 << 30, 4 << 30, 8 << 30, 9 << 30)] == [
        "[..........]", "[..........]", "[##........]", "[#####.....]", "[##########]", "[##########]"]
    assert _top._bar(1, None) == "[..........]"


def test_a_programs_row_adds_up_its_exporters_samples(monkeypatch):
    """One program's row from its exporter's text (hand-computed): calls and fallback calls over
    every op, fallback seconds to the microsecond, memory over every device."""
    text = "\n".join([
        '# TYPE flagos_info gauge', 'flagos_info{chip="sim",mode="device",version="0.1.0"} 1',
        '# TYPE flagos_op_calls_total counter',
        'flagos_op_calls_total{op="aten::add.Tensor",route="native"} 3',
        'flagos_op_calls_total{op="aten::mm",route="fallback"} 1',
        '# TYPE flagos_op_fallback_seconds_total counter',
        'flagos_op_fallback_seconds_total{op="aten::mm"} 0.0000012345',
        '# TYPE flagos_device_memory_used_bytes gauge',
        'flagos_device_memory_used_bytes{device="0"} 1024', 'flagos_device_memory_used_bytes{device="1"} 2048',
        '# TYPE flagos_device_memory_total_bytes gauge',
        'flagos_device_memory_total_bytes{device="0"} 4096', ""])
    monkeypatch.setattr(_top.urllib.request, "urlopen", lambda url, timeout: contextlib.closing(io.BytesIO(text.encode())))
    row = _top.process_row({"pid": 7, "url": "http://127.0.0.1:9/metrics"})
    assert row == {"pid": 7, "url": "http://127.0.0.1:9/metrics", "chip": "sim", "mode": "device",
                   "version": "0.1.0", "calls": 4, "fallback_calls": 1, "fallback_share": 0.25,
                   "fallback_seconds": 0.000001, "memory_used": 3072, "status": "ok"}


def test_frames_come_every_two_seconds_by_default():
    parser = argparse.ArgumentParser()
    _top.add_arguments(parser)
    assert parser.parse_args([]).interval == 2.0 and parser.parse_args(["--interval", "0.5"]).interval == 0.5


def test_a_frame_reads_as_written():
    """A hand-built frame: the device line with its bar, memory and utilization; a program's
    row with its share and milliseconds; a program that could not be read shows dashes and why."""
    view = {"time": "2026-12-05T08:00:00+00:00",
            "devices": [{"chip": "sim", "index": 0, "name": "flagos sim device 0", "memory_used": 1 << 30,
                         "memory_total": 4 << 30, "utilization": 0.5, "mode": "device", "status": "ok"}],
            "processes": [
                {"pid": 7, "url": "http://127.0.0.1:9/metrics", "chip": "sim", "mode": "device", "calls": 4,
                 "fallback_calls": 1, "fallback_share": 0.25, "fallback_seconds": 0.4567, "memory_used": 3072,
                 "status": "ok"},
                {"pid": 8, "url": "http://127.0.0.1:10/metrics", "chip": None, "mode": None, "calls": None,
                 "fallback_calls": None, "fallback_share": None, "fallback_seconds": None, "memory_used": None,
                 "status": "error: URLError: refused"}]}
    lines = [" ".join(line.split()) for line in _top.format_frame(view, 2.0).splitlines()]
    assert lines[0] == "flagos top 2026-12-05T08:00:00+00:00 every 2 s, Ctrl-C to quit"
    assert lines[4] == "sim 0 flagos sim device 0 [##........] 1.0 GiB / 4.0 GiB 50.0% device ok"
    assert lines[-2] == "7 sim device 4 1 25.0% 456.7 3.0 KiB http://127.0.0.1:9/metrics"
    assert lines[-1] == "8 - - - - - error: URLError: refused"


@pytest.mark.parametrize("terminal", [False, True])
def test_the_python_call_shows_frames_as_the_command_does(monkeypatch, capsys, terminal):
    """`flagos.tools.top()` returns one frame and prints nothing; with once=False it prints
    frames every 2 s by default (sleeping what is left of the interval after the frame),
    redrawn in place on a terminal, one after another elsewhere, and as JSON lines when asked,
    never with the terminal's clear code."""
    view = {"time": "t", "devices": [], "processes": []}
    clock, slept = [100.0], []

    def frame():
        clock[0] += 0.5
        if clock[0] > 200:  # a loop that should have ended: as if Ctrl-C
            raise KeyboardInterrupt
        return dict(view)

    monkeypatch.setattr(_top, "frame", frame)
    monkeypatch.setattr(_top.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(_top.time, "sleep", lambda s: slept.append(s) or clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    assert flagos.tools.top() == view and capsys.readouterr().out == ""
    assert _top.top(once=False, count=2) == view
    text = _top.format_frame(view, 2.0)
    shown = _top._CLEAR + text if terminal else text + "\n"  # a blank line between frames
    assert capsys.readouterr().out == (shown + "\n") * 2    # and print's own newline
    assert slept == [1.5]  # 2 s less the frame's 0.5 s; none after the last frame
    _top.top(once=False, count=2, as_json=True)
    assert capsys.readouterr().out == (json.dumps(view) + "\n") * 2
    clock[0] = 190.0  # Ctrl-C in the sixth frame, with no count: the view returns, no traceback
    assert _top.top(once=False, as_json=True) == view
    assert capsys.readouterr().out == (json.dumps(view) + "\n") * 5


def test_a_piped_view_shows_each_frame_as_it_is_drawn(tmp_path):
    """`flagos top | less`: each frame reaches the pipe when it is drawn, not when top ends."""
    proc = subprocess.Popen([sys.executable, "-m", "flagos", "top", "--interval", "600"],
                            env=command_env({"FLAGOS_RUNTIME_DIR": str(tmp_path)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first_line(proc, timeout=60).startswith("flagos top ")
        assert proc.poll() is None  # still waiting for its next frame
    finally:
        proc.kill()
        proc.communicate()
