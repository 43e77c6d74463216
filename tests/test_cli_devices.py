"""`flagos devices`: one row per device of every available chip, as JSON, CSV and a table."""
import csv
import io

from flagos_cli import run_flagos, run_json

import flagos
from flagos.tools.cli import main

# three sim devices, the last one in a failed state
SIM = {"FLAGOS_SIM_DEVICES": "3", "FLAGOS_SIM_MEMORY": "48M",
       "FLAGOS_SIM_DTYPES": "float32,float16,bfloat16", "FLAGOS_SIM_FAIL_DEVICE": "2"}


def test_json_has_one_row_per_device_and_names_the_failed_one():
    rows = run_json("devices", env=SIM, returncode=1)  # 1: a device is in a failed state
    by_device = {(r["chip"], r["index"]): r for r in rows}
    # (and opencl's devices where the opencl adapter is built and finds one)
    assert sorted(k for k in by_device if k[0] != "opencl") == [("cpu", 0), ("sim", 0), ("sim", 1), ("sim", 2)]

    host = next(d for d in flagos.list_devices() if d.chip == "cpu")
    cpu = by_device[("cpu", 0)]
    assert (cpu["name"], cpu["vendor"], cpu["memory_total"], cpu["native_dtypes"], cpu["mode"], cpu["status"]) == \
        (host.name, host.vendor, host.total_memory, list(host.native_dtypes), "device", "ok")
    assert 0 < cpu["memory_used"] < cpu["memory_total"]

    for i in (0, 1):
        assert by_device[("sim", i)] == {
            "chip": "sim", "index": i, "name": f"flagos sim device {i}",
            "vendor": "flagos (emulated accelerator)", "memory_used": 0,
            "memory_total": 48 * 2**20, "native_dtypes": ["float32", "float16", "bfloat16"],
            "mode": "device", "status": "ok"}
    failed = by_device[("sim", 2)]
    assert failed["status"].startswith("error: DeviceError") and "SIM_ERROR_DEVICE_LOST" in failed["status"]
    assert failed["memory_total"] is None


def test_csv_has_the_same_rows():
    proc = run_flagos("devices", "--csv", env=SIM)
    assert proc.returncode == 1, proc.stderr
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert list(rows[0]) == ["chip", "index", "name", "vendor", "memory_used", "memory_total",
                             "native_dtypes", "mode", "status"]
    sim = [r for r in rows if r["chip"] == "sim"]
    assert [r["index"] for r in sim] == ["0", "1", "2"]
    assert sim[1]["memory_total"] == str(48 * 2**20) and sim[1]["native_dtypes"] == "float32 float16 bfloat16"
    assert sim[2]["memory_total"] == "" and "SIM_ERROR_DEVICE_LOST" in sim[2]["status"]
    cpu = next(r for r in rows if r["chip"] == "cpu")
    assert int(cpu["memory_total"]) > 0


def test_table_and_usage_errors(capsys):
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["CHIP", "INDEX", "NAME"]
    expected = flagos.tools.devices()
    assert len(lines) == 2 + len(expected)
    for line, row in zip(lines[2:], expected):
        assert line.split()[:2] == [row["chip"], str(row["index"])] and row["name"] in line
    try:
        main(["devices", "--json", "--csv"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--json with --csv was accepted")
    assert "not allowed with argument" in capsys.readouterr().err


def test_version_help_and_the_aliases_users_know(capsys, monkeypatch):
    from flagos.tools import SUBCOMMANDS, cli, command_module

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"flagos {flagos.__version__}\n"
    assert main([]) == 2                                     # no subcommand: usage, on stderr
    assert "COMMAND" in capsys.readouterr().err
    helps = cli.build_parser().format_help()
    for name in SUBCOMMANDS:                                 # each with its docstring's first line
        first_line = command_module(name).__doc__.strip().splitlines()[0]
        assert first_line.split("(")[0].strip()[:30] in " ".join(helps.split()), name
    monkeypatch.setattr("sys.argv", ["flagos-device-list", "--csv"])
    assert cli.devices_main() == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("chip,index,name")
