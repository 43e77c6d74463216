"""`flagos diagnose`: every chip and adapter with its status and reason, a smoke test per
available chip, a verdict; broken adapters and a failed device are reported while every other
chip is still diagnosed."""
import platform
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import CHIP
from flagos_cli import ROOT, run_flagos, run_json

import flagos
from flagos.tools import _diagnose, _smoke
from flagos.tools.cli import main

CHECKS = ["activate", "allocate", "copy round trip", "matmul vs CPU", "float16", "bfloat16"]


def guide_adapter() -> str:
    """The complete example adapter of docs/adapters.md (a working adapter to break)."""
    text = (ROOT / "docs" / "adapters.md").read_text()
    return next(b for b in re.findall(r"```c\n(.*?)```", text, re.S) if "flagos_adapter_get(void)\n{" in b)


def build(folder, name: str, source: str, *link: str) -> None:
    src = folder / f"{name}.c"
    src.write_text(source)
    subprocess.run(["cc", "-std=c11", "-w", "-fPIC", "-shared", f"-I{ROOT / 'csrc' / 'include'}",
                    str(src), "-o", str(folder / f"libflagos_{name}_adapter.so"), *link], check=True)


@pytest.fixture(scope="module")
def broken_adapters(tmp_path_factory):
    """Three adapters that cannot load, each for another reason."""
    folder = tmp_path_factory.mktemp("adapters")
    source = guide_adapter()
    init = "static int32_t toy_init(flagos_status *st) { return ok(st); }"
    assert init in source
    build(folder, "future", source.replace(".abi_major = FLAGOS_ADAPTER_ABI_MAJOR,",
                                           ".abi_major = FLAGOS_ADAPTER_ABI_MAJOR + 1,"))
    calls_vendor = "int vendor_runtime_init(void);\n" + source.replace(
        init, "static int32_t toy_init(flagos_status *st) { vendor_runtime_init(); return ok(st); }")
    build(folder, "nosymbol", calls_vendor)  # the symbol is nowhere
    runtime = folder / "runtime"
    runtime.mkdir()
    (folder / "libflagos_notes.txt").write_text("not a library: the search path lists only libflagos_*.so\n")
    (runtime / "vendor.c").write_text("int vendor_runtime_init(void) { return 0; }\n")
    subprocess.run(["cc", "-fPIC", "-shared", str(runtime / "vendor.c"), "-o",
                    str(runtime / "libtoyvendor.so")], check=True)
    build(folder, "nodriver", calls_vendor, f"-L{runtime}", "-ltoyvendor")
    (runtime / "libtoyvendor.so").unlink()  # the vendor's runtime library is not installed
    return folder


def test_broken_adapters_and_a_failed_device_are_reported_with_every_other_chip(broken_adapters):
    env = {"FLAGOS_ADAPTER_PATH": str(broken_adapters), "FLAGOS_SIM_FAIL_DEVICE": "1"}
    found = run_json("diagnose", env=env, returncode=1)
    chips = {c["chip"]: c for c in found["chips"]}

    assert {n: (chips[n]["status"], chips[n]["problem"]) for n in ("future", "nosymbol", "nodriver")} == {
        "future": ("broken", "abi_mismatch"), "nosymbol": ("broken", "missing_symbol"),
        "nodriver": ("broken", "driver_missing")}
    assert "built for adapter ABI 2." in chips["future"]["reason"] and "libflagos_future_adapter.so" in chips["future"]["reason"]
    assert "undefined symbol: vendor_runtime_init" in chips["nosymbol"]["reason"]
    assert "libtoyvendor.so" in chips["nodriver"]["reason"]
    for vendor_chip in ("npu", "mlu", "musa"):  # not installed here: unavailable, not broken
        assert chips[vendor_chip]["status"] == "unavailable" and chips[vendor_chip]["problem"] == "package_missing"
    assert chips["cuda"]["status"] == ("available" if torch.cuda.is_available() else "unavailable")

    # the other chips are still diagnosed in full
    assert (chips["cpu"]["status"], chips["sim"]["status"]) == ("available", "available")
    assert chips["sim"]["versions"] == {"adapter_abi": "{}.{}".format(*flagos._C.load_adapter(
        chips["sim"]["source"]).abi)} and chips["sim"]["device_count"] == 2
    smoke = {r["chip"]: r for r in found["smoke"]}
    # and opencl's where the opencl adapter is built and finds a device (PoCL)
    assert sorted(set(smoke) - {"opencl"}) == ["cpu", "sim"]
    assert "opencl" not in smoke or smoke["opencl"]["verdict"] != "fail", smoke["opencl"]
    assert [c["name"] for c in smoke["cpu"]["checks"]] == CHECKS
    assert smoke["cpu"]["verdict"] == "ok" and all(c["level"] == "OK" for c in smoke["cpu"]["checks"])
    # sim's second device is in a failed state: the round trip through it fails, the rest passes
    sim_checks = {c["name"]: c for c in smoke["sim"]["checks"]}
    assert sim_checks["copy round trip"]["level"] == "FAIL"
    assert "SIM_ERROR_DEVICE_LOST" in sim_checks["copy round trip"]["detail"]
    assert sim_checks["matmul vs CPU"]["level"] == "OK" and sim_checks["float16"]["level"] == "OK"
    assert sim_checks["bfloat16"]["level"] == "WARN" and "CPU fallback" in sim_checks["bfloat16"]["detail"]
    devices = {(d["chip"], d["index"]): d["status"] for d in found["devices"]}
    assert devices[("cpu", 0)] == devices[("sim", 0)] == "ok" and "SIM_ERROR_DEVICE_LOST" in devices[("sim", 1)]

    assert found["verdict"]["level"] == "fail"
    for problem in ("future is broken (ABI mismatch)", "nosymbol is broken (missing symbol)",
                    "sim:1 error", "smoke test failed on sim"):
        assert problem in found["verdict"]["text"], problem
    assert re.search(r"ready: (opencl, )?cpu$", found["verdict"]["text"]), found["verdict"]["text"]
    assert found["versions"]["torch"] == torch.__version__
    assert found["versions"]["python"] == platform.python_version()
    assert found["environment"]["FLAGOS_ADAPTER_PATH"] == str(broken_adapters)
    first = found["adapter_path"][0]
    assert (first["folder"], first["source"]) == (str(broken_adapters), "FLAGOS_ADAPTER_PATH")
    assert first["libraries"] == ["libflagos_future_adapter.so", "libflagos_nodriver_adapter.so",
                                  "libflagos_nosymbol_adapter.so"]
    # (the opencl adapter where setup.py found the OpenCL headers and ICD loader)
    assert [n for n in found["adapter_path"][-1]["libraries"]
            if n != "libflagos_opencl_adapter.so"] == ["libflagos_sim_adapter.so"]
    assert "chip future: ABI mismatch" in found["bug_report"]


def test_text_report_of_the_test_chip():
    proc = run_flagos("diagnose", "--chip", CHIP)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    section = out.split(f"Smoke test: {CHIP}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    marks = {line[8:].split("  ")[0].strip(): line[:8].strip() for line in section}
    assert list(marks) == CHECKS
    expected_bf16 = "[WARN]" if CHIP == "sim" else "[OK]"
    assert marks == {**{c: "[OK]" for c in CHECKS}, "bfloat16": expected_bf16}
    verdict = "OK with warnings on sim; ready: sim" if CHIP == "sim" else "OK: ready: cpu"
    assert f"Verdict: {verdict}" in out
    block = out.split("Bug report (paste this):\n```\n", 1)[1].split("\n```", 1)[0]
    assert block.startswith(f"flagos {flagos.__version__}, torch {torch.__version__}")
    assert f"smoke {CHIP}: {'warn' if CHIP == 'sim' else 'ok'}" in block


def test_python_function_keeps_this_process_as_it_is():
    before = flagos.info()
    found = flagos.tools.diagnose(chip=CHIP)  # this process is active: the test runs in a child
    assert flagos.info() == before
    assert [c["chip"] for c in found["chips"]] == [CHIP]
    (smoke,) = found["smoke"]
    assert smoke["chip"] == CHIP and smoke["verdict"] in ("ok", "warn")
    assert [c["name"] for c in smoke["checks"]] == CHECKS


def test_unknown_chip_is_a_usage_error_and_bad_settings_fail(monkeypatch, capsys):
    assert main(["diagnose", "--chip", "nosuchchip"]) == 2
    assert "unknown chip 'nosuchchip'; flagos knows: " in capsys.readouterr().err
    assert main(["diagnose", "--chip", "rknn", "--no-smoke"]) == 2
    assert "'rknn' cannot run under flagos: Rockchip NPUs have no PyTorch device" in capsys.readouterr().err
    assert main(["diagnose", "--chip", "Ascend", "--no-smoke", "--json"]) == 1  # vendor name of npu
    assert '"chip": "npu"' in capsys.readouterr().out

    monkeypatch.setenv("FLAGOS_FALLBACK", "sometimes")
    assert main(["diagnose", "--chip", "mps", "--no-smoke", "--json"]) == 1
    out = capsys.readouterr().out
    assert "FLAGOS_FALLBACK='sometimes' is not valid; use one of: allow, warn, error" in out
    assert "mps is not available" in out


def test_the_bug_report_names_the_first_problem_in_full_and_the_rest_by_name():
    def check(name, level, detail=""):
        return {"name": name, "level": level, "detail": detail}

    findings = {
        "versions": {"flagos": "0.1.0", "torch": "2.13.0", "python": "3.11.7", "os": "Linux"},
        "chips": [], "devices": [], "environment": {}, "verdict": {"text": "FAIL: sim"},
        "smoke": [{"chip": "sim", "verdict": "fail",
                   "checks": [check("tensor", "OK"), check("bfloat16", "WARN", "not native"),
                              check("matmul", "FAIL", "wrong values"), check("backward", "FAIL")]},
                  {"chip": "cpu", "verdict": "ok", "checks": [check("tensor", "OK")]}]}
    lines = _diagnose._bug_report(findings).splitlines()
    assert "smoke sim: fail (bfloat16: WARN not native; then matmul FAIL, backward FAIL)" in lines
    assert "smoke cpu: ok" in lines and lines[-1] == "verdict: FAIL: sim"


def _child_running(monkeypatch, script: str) -> "_smoke._Child":
    """A smoke child started as a new interpreter (the path of a caller that is not fresh),
    running `script` instead of the smoke test."""
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        return real_popen([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(_smoke.subprocess, "Popen", popen)
    return _smoke._Child("cpu", fork=False)


def test_a_smoke_child_past_its_deadline_is_killed_and_reported(monkeypatch):
    child = _child_running(monkeypatch, "import time; time.sleep(30)")
    answer = child.result(time.monotonic() + 0.5)
    assert child.proc.returncode == -signal.SIGKILL  # killed, not waited for
    assert answer["verdict"] == "fail"
    assert answer["checks"][0]["detail"] == f"the smoke test did not finish in {_smoke.TIMEOUT_S:.0f} s"


def test_a_crashed_smoke_child_is_reported_by_its_exit_code_and_last_error_line(monkeypatch):
    # os._exit: no exit handler (a coverage run's, say) writes after the error
    script = ("import os, sys\n"
              "print('Traceback (most recent call last):', file=sys.stderr)\n"
              "print('  File \"x.py\", line 1', file=sys.stderr)\n"
              "print('RuntimeError: the device went away', file=sys.stderr, flush=True)\n"
              "os._exit(3)\n")
    child = _child_running(monkeypatch, script)
    answer = child.result(time.monotonic() + 60)
    assert answer["verdict"] == "fail"
    assert answer["checks"][0]["detail"] == ("the test process ended without an answer "
                                             "(exit code 3: RuntimeError: the device went away)")


def _findings(**parts):
    """Findings as diagnose() makes them, built by hand."""
    base = {"versions": {"flagos": "0.1.0", "torch": "2.13.0", "python": "3.11.7", "os": "Linux"},
            "chips": [], "devices": [], "adapter_path": [], "environment": {}, "config_problems": [],
            "smoke": [], "verdict": {"text": "OK: ready: cpu"}, "seconds": 1.25, "bug_report": "-"}
    return {**base, **parts}


def _chip(name, status, reason="", versions=None, count=0):
    return {"chip": name, "status": status, "reason": reason, "versions": versions or {},
            "device_count": count, "mode": "device"}


CHIPS = [_chip("npu", "broken", "ABI mismatch: 2.0, flagos speaks 1.x", {"torch_npu": "2.13.0"}),
         _chip("cuda", "available", versions={"CUDA": "12.8"}, count=2),
         _chip("cpu", "available", count=1)]


def test_the_chips_and_devices_read_as_found_in_the_text_and_the_bug_report():
    """Each chip's line: available ones with their devices, mode and versions (when any), the
    others with their reason; devices that are not ok in the bug report; the smoke line names
    further problems only when there are any."""
    devices = [{"chip": "cuda", "index": 0, "status": "ok", "name": "GPU", "memory_used": 0,
                "memory_total": 1 << 30, "native_dtypes": ["float32"]},
               {"chip": "cuda", "index": 1, "status": "device lost"}]
    check = {"name": "matmul", "level": "FAIL", "detail": "wrong values"}
    smoke = [{"chip": "cuda", "verdict": "fail", "checks": [check]},
             {"chip": "cpu", "verdict": "fail", "checks": [check, dict(check, name="backward")]}]
    findings = _findings(chips=CHIPS, devices=devices, smoke=smoke)
    chips_section = _diagnose.format_text(findings).split("Chips\n", 1)[1].split("\n\n", 1)[0]
    assert chips_section.splitlines() == [
        "  [FAIL] npu   broken: ABI mismatch: 2.0, flagos speaks 1.x",
        "  [OK]   cuda  available, 2 device(s), device mode (CUDA 12.8)",
        "  [OK]   cpu   available, 1 device(s), device mode"]
    lines = _diagnose._bug_report(findings).splitlines()
    assert lines[1:4] == ["chip npu: ABI mismatch: 2.0, flagos speaks 1.x [torch_npu 2.13.0]",
                          "chip cuda: available, 2 device(s) [CUDA 12.8]", "chip cpu: available, 1 device(s)"]
    assert lines[4] == "device cuda:1: device lost" and not any(x.startswith("device cuda:0") for x in lines)
    assert lines[5:7] == ["smoke cuda: fail (matmul: FAIL wrong values)",
                          "smoke cpu: fail (matmul: FAIL wrong values; then backward FAIL)"]


def test_diagnose_counts_its_own_seconds_to_the_millisecond(monkeypatch):
    """`seconds` is the time diagnose() took (its own clock readings), rounded to 1 ms."""
    readings = iter([100.0, 101.23456])
    monkeypatch.setattr(_diagnose, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(readings))}))
    assert _diagnose.diagnose(chip="cpu", smoke=False)["seconds"] == 1.235


def test_the_text_report_reads_as_written():
    """The whole text of a hand-built diagnosis: devices (a failed one named, an ok one with its
    name, memory and dtypes), each adapter folder with its libraries or why it has none, the
    environment and its problems, the smoke checks, the verdict; and what an empty one says."""
    devices = [{"chip": "cuda", "index": 0, "status": "device lost"},
               {"chip": "cuda", "index": 1, "status": "ok", "name": "NVIDIA H100", "memory_used": 1 << 30,
                "memory_total": 80 << 30, "native_dtypes": ["float32", "bfloat16"]}]
    paths = [{"folder": "/opt/a", "source": "FLAGOS_ADAPTER_PATH", "exists": True,
              "libraries": ["libflagos_x_adapter.so", "libflagos_y_adapter.so"]},
             {"folder": "/opt/b", "source": "FLAGOS_ADAPTER_PATH", "exists": True, "libraries": []},
             {"folder": "/opt/c", "source": "package", "exists": False, "libraries": []}]
    smoke = [{"chip": "cuda", "verdict": "warn", "checks": [
        {"name": "activate", "level": "OK", "detail": "fine"}, {"name": "bfloat16", "level": "WARN", "detail": "slow"}]}]
    text = _diagnose.format_text(_findings(chips=CHIPS, devices=devices, adapter_path=paths,
                                           environment={"FLAGOS_DEVICE": "cuda"},
                                           config_problems=["FLAGOS_X bad"], smoke=smoke))
    assert text.split("\n\nDevices\n", 1)[1].split("\n\nVerdict", 1)[0].splitlines() == [
        "  [FAIL] cuda:0  device lost",
        "  [OK]   cuda:1  NVIDIA H100, 1.0 GiB / 80.0 GiB used, native float32 bfloat16",
        "",
        "Adapter search path",
        "  /opt/a  [FLAGOS_ADAPTER_PATH]  libflagos_x_adapter.so, libflagos_y_adapter.so",
        "  /opt/b  [FLAGOS_ADAPTER_PATH]  (empty)",
        "  /opt/c  [package]  (no such folder)",
        "",
        "Environment",
        "  FLAGOS_DEVICE=cuda",
        "  [FAIL] FLAGOS_X bad",
        "",
        "Smoke test: cuda",
        "  [OK]   activate         fine",
        "  [WARN] bfloat16         slow"]
    empty = _diagnose.format_text(_findings(chips=CHIPS[2:]))
    assert "\n\nDevices\n  (none)\n\nAdapter search path\n\nEnvironment\n  (no FLAGOS_* or vendor " \
           "variables set)\n\nVerdict: OK: ready: cpu  (1.2 s)\n" in empty
