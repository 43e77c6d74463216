"""The Prometheus exporter: scraped over real HTTP on 127.0.0.1 and parsed, inside a program
(flagos.metrics.start_http_server) and as `flagos metrics`."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
from conftest import CHIP, device_mode_only
from flagos_cli import command_env, first_line, run_workload
from prometheus_client.parser import text_string_to_metric_families

import flagos
from flagos.tools.cli import main

NAMES = {"flagos_device_memory_used_bytes", "flagos_device_memory_total_bytes",
         "flagos_device_utilization_ratio", "flagos_op_calls_total",
         "flagos_op_fallback_seconds_total", "flagos_info"}


def parse(text: str) -> dict:
    """family name as exposed -> [(labels, value)]; counters under their `_total` name."""
    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = [(s.labels, s.value) for s in family.samples]
    return out


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return parse(response.read().decode())


@pytest.fixture
def exporter(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGOS_RUNTIME_DIR", str(tmp_path))
    exporter = flagos.metrics.start_http_server(0)
    yield exporter
    exporter.stop()


@device_mode_only
def test_exporter_in_a_program_reports_its_ops_and_devices(exporter, tmp_path):
    model, held = run_workload()  # model alive: its weights stay on the device
    report = flagos.fallback_report()
    metrics = scrape(exporter.url)

    assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics" and exporter.port > 0
    # what a user prints: where it serves, not its server and thread objects
    assert repr(exporter) == f"Exporter(host='127.0.0.1', port={exporter.port}, url='{exporter.url}')"
    assert set(metrics) == NAMES
    assert metrics["flagos_info"] == [({"version": flagos.__version__, "chip": CHIP, "mode": "device"}, 1.0)]

    calls = {(labels["op"], labels["route"]): value for labels, value in metrics["flagos_op_calls_total"]}
    for row in report.rows:
        for route, count in row["calls"].items():
            assert calls[(row["op"], route)] == count, (row["op"], route)
    assert calls[("aten::gelu", "fallback")] == 1 and calls[("aten::gelu", "native")] == 0
    seconds = {labels["op"]: value for labels, value in metrics["flagos_op_fallback_seconds_total"]}
    # exact: the text format carries a float's shortest repr, which reads back as the same float
    assert seconds["aten::gelu"] == report.op("aten::gelu")["fallback_ns"] / 1e9
    assert sum(seconds.values()) == pytest.approx(report.fallback_seconds)

    # the devices of the active chip only, labelled chip/index/name
    info = flagos.info()
    used = {int(lb["index"]): v for lb, v in metrics["flagos_device_memory_used_bytes"]}
    total = {int(lb["index"]): v for lb, v in metrics["flagos_device_memory_total_bytes"]}
    for labels, _ in metrics["flagos_device_memory_total_bytes"]:
        assert labels == {"chip": CHIP, "index": labels["index"], "name": info["devices"][int(labels["index"])]}
    assert sorted(total) == list(range(info["device_count"]))
    chip = flagos.core._state.active().chip
    for i in total:
        free, capacity = chip.mem_get_info(i)
        assert total[i] == capacity
        assert 0 <= used[i] <= capacity
    if CHIP == "sim":  # the adapter's own pool: what this program holds is in use
        assert used[0] >= held and metrics["flagos_device_utilization_ratio"] == []
    else:  # the host: CPU utilization is exposed
        (labels, ratio), = metrics["flagos_device_utilization_ratio"]
        assert labels["chip"] == "cpu" and 0.0 <= ratio <= 1.0

    # announced for `flagos top`
    with open(tmp_path / "exporters" / f"{os.getpid()}.json") as f:
        record = json.load(f)
    assert record["url"] == exporter.url and record["chip"] == CHIP


@device_mode_only
def test_counters_follow_the_report(exporter):
    run_workload()
    flagos.reset_report()
    metrics = scrape(exporter.url)
    assert all(value == 0 for _, value in metrics["flagos_op_calls_total"])


def test_bad_port_names_the_fix(exporter):
    for bad in (70000, 65536, -1, True, "9491", 9491.0):
        with pytest.raises(flagos.ConfigError, match="0 to 65535"):
            flagos.metrics.start_http_server(bad)
    try:  # the highest port is a port: served, or refused by the machine, never by flagos
        flagos.metrics.start_http_server(65535).stop()
    except OSError as e:
        assert not isinstance(e, flagos.ConfigError) and "choose another port" in str(e)
    with pytest.raises(OSError, match=rf"127\.0\.0\.1:{exporter.port} \({os.strerror(errno.EADDRINUSE)}\); "
                                      "choose another port") as caught:
        flagos.metrics.start_http_server(exporter.port)
    assert caught.value.errno == errno.EADDRINUSE


def test_command_serves_every_device_until_terminated(tmp_path):
    env = command_env({"FLAGOS_RUNTIME_DIR": str(tmp_path), "FLAGOS_SIM_DEVICES": "3",
                       "FLAGOS_SIM_MEMORY": "32M"})
    # SIGINT as a terminal gives it even where this runs as a background job (nohup, `&` in a
    # script), which starts children with SIGINT ignored and Python then keeps it ignored
    proc = subprocess.Popen([sys.executable, "-m", "flagos", "metrics", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = first_line(proc)
        assert line.startswith("flagos metrics: serving http://127.0.0.1:"), (line, proc.stderr.read())
        url = line.split()[3]
        metrics = scrape(url)
        assert set(metrics) == NAMES
        total = {(lb["chip"], lb["index"]): v for lb, v in metrics["flagos_device_memory_total_bytes"]}
        assert total[("sim", "0")] == total[("sim", "2")] == 32 * 2**20 and ("sim", "3") not in total
        assert ("cpu", "0") in total
        assert metrics["flagos_info"] == [({"version": flagos.__version__, "chip": "", "mode": ""}, 1.0)]
        assert metrics["flagos_op_calls_total"] == []  # the command itself runs no ops
        assert os.path.exists(tmp_path / "exporters" / f"{proc.pid}.json")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert not os.path.exists(tmp_path / "exporters" / f"{proc.pid}.json")


def test_the_command_stops_quietly_on_ctrl_c(tmp_path):
    env = command_env({"FLAGOS_RUNTIME_DIR": str(tmp_path)})
    # SIGINT as a terminal gives it even where this runs as a background job (nohup, `&` in a
    # script), which starts children with SIGINT ignored and Python then keeps it ignored
    proc = subprocess.Popen([sys.executable, "-m", "flagos", "metrics", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert first_line(proc).startswith("flagos metrics: serving http://127.0.0.1:")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "exporters" / f"{proc.pid}.json")


def test_the_command_takes_ports_0_to_65535_and_serves_on_9491_by_default(capsys):
    for bad in ("-1", "65536"):
        assert main(["metrics", "--port", bad]) == 2
        assert f"--port must be from 0 to 65535, not {bad}" in capsys.readouterr().err
    assert main(["metrics", "--once", "--port", "65535"]) == 0  # the highest port is a port
    assert "flagos_info" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["metrics", "--help"])
    assert "default 9491;" in capsys.readouterr().out  # the port docs/cli.md names


def test_once_prints_one_scrape_and_a_taken_port_fails(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["metrics", "--port", str(taken.getsockname()[1])]) == 1
    assert "choose another port" in capsys.readouterr().err

    assert main(["metrics", "--once"]) == 0
    metrics = parse(capsys.readouterr().out)
    assert set(metrics) == NAMES
    # (and opencl where the opencl adapter is built and finds a device)
    assert {lb["chip"] for lb, _ in metrics["flagos_device_memory_used_bytes"]} - {"opencl"} == {"cpu", "sim"}


def test_missing_prometheus_client_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now fails
    assert main(["metrics", "--once"]) == 1
    assert "pip install flagos[metrics]" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError, match=r"pip install flagos\[metrics\]"):
        flagos.metrics.start_http_server(0)
