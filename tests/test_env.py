"""Every environment variable of docs/environment.md, set in the environment of a fresh
process (not through the Python API it maps to), has the documented effect.

FLAGOS_REPORT, FLAGOS_SIM_MEMORY, FLAGOS_SIM_FAIL_ALLOC_AT, FLAGOS_SIM_FAIL_DEVICE and
FLAGOS_SIM_DTYPES are tested the same way in test_routes.py and test_sim.py; FLAGOS_TEST_CHIP
by test_sim_kernels.py, which runs its sim cases in a process started with it.
"""
import ast
import os
import pathlib
import re
import subprocess

import pytest
from conftest import device_mode_only, run_python
from test_adapters import build, guide_example

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "environment.md").read_text()

pytestmark = device_mode_only

SHOW = """
    import json, torch, flagos
    i = flagos.info()
    print("INFO", json.dumps({k: i.get(k) for k in ("active", "chip", "mode", "device_count", "fallback")}))
"""


def info_of(proc) -> dict:
    import json
    line = next(l for l in proc.stdout.splitlines() if l.startswith("INFO "))
    return json.loads(line[5:])


# ---- choosing the chip -------------------------------------------------------------------

@pytest.mark.parametrize("env,chip", [
    ({"FLAGOS_DEVICE": "sim"}, "sim"),
    ({"FLAGOS_DEVICE_BACKEND": "sim"}, "sim"),
    ({"FLAGOS_DEVICE": "cpu", "FLAGOS_DEVICE_BACKEND": "sim"}, "cpu"),   # FLAGOS_DEVICE wins
    ({"FLAGOS_DEVICE": "sim", "FLAGOS_DEVICE_BACKEND": "cpu"}, "sim"),
], ids=["device", "backend alias", "device wins 1", "device wins 2"])
def test_device_variables_activate_at_import_torch(env, chip):
    # autoload at `import torch`: the script never calls activate()
    assert info_of(run_python(SHOW, env=env)) == {"active": True, "chip": chip, "mode": "device",
                                                   "device_count": 1 if chip == "cpu" else 2,
                                                   "fallback": "warn"}


def test_torch_autoload_off_leaves_flagos_inactive():
    proc = run_python(SHOW, env={"FLAGOS_DEVICE": "cpu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert info_of(proc)["active"] is False


@pytest.mark.parametrize("mode", ["native", "device"])
def test_mode_variable(mode):
    proc = run_python(SHOW + """
    print("DEVICE", flagos.device(), torch.ones(2, device=flagos.device()).device)
    """, env={"FLAGOS_DEVICE": "cpu", "FLAGOS_MODE": mode})
    assert info_of(proc)["mode"] == mode
    expected = "cpu:0 cpu" if mode == "native" else "flagos:0 flagos:0"
    assert f"DEVICE {expected}" in proc.stdout


def test_native_mode_variable_on_an_adapter_chip_is_refused():
    proc = run_python("""
        import flagos
        try:
            flagos.activate("sim")
        except flagos.ConfigError as e:
            print("ERR", e)
    """, env={"FLAGOS_MODE": "native", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert "ERR chip 'sim' is a C-ABI adapter: it runs in device mode only" in proc.stdout


def test_adapter_path_variable_finds_a_chip(tmp_path):
    build(tmp_path, "toy", guide_example())
    proc = run_python(SHOW + """
    print("SUM", (torch.ones(3, device="flagos") + torch.ones(3, device="flagos")).sum().item())
    print("LISTED", [d.chip for d in flagos.list_devices()])
    """, env={"FLAGOS_DEVICE": "toy", "FLAGOS_ADAPTER_PATH": f"/nonexistent:{tmp_path}"})
    assert info_of(proc)["chip"] == "toy" and "SUM 6.0" in proc.stdout
    assert "'toy'" in proc.stdout.split("LISTED", 1)[1]


# ---- the fallback policy and routes -------------------------------------------------------

POLICY_SCRIPT = """
    import warnings, torch, flagos
    a = torch.ones(3, device="flagos")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            a.add_(1)            # FLAGOS_ROUTE sends it to the fallback
            a.add_(1)
            print("RAN", a.cpu().tolist())
        except flagos.FallbackError as e:
            print("REFUSED", a.cpu().tolist(), str(e).split(" would")[0])
    print("WARNINGS", sum(issubclass(w.category, flagos.FallbackWarning) for w in caught))
"""


@pytest.mark.parametrize("chip,value,expected", [
    ("cpu", "allow", ["RAN [3.0, 3.0, 3.0]", "WARNINGS 0"]),
    ("sim", "warn", ["RAN [3.0, 3.0, 3.0]", "WARNINGS 1"]),
    ("cpu", "error", ["REFUSED [1.0, 1.0, 1.0] aten::add_", "WARNINGS 0"]),
    ("sim", "error", ["REFUSED [1.0, 1.0, 1.0] aten::add_", "WARNINGS 0"]),
    ("cpu", None, ["RAN [3.0, 3.0, 3.0]", "WARNINGS 1"]),   # default: warn
])
def test_fallback_variable(chip, value, expected):
    env = {"FLAGOS_DEVICE": chip, "FLAGOS_ROUTE": "aten::add_=fallback"}
    if value is not None:
        env["FLAGOS_FALLBACK"] = value
    proc = run_python(POLICY_SCRIPT, env=env)
    for line in expected:
        assert line in proc.stdout, (line, proc.stdout)


def test_route_variable_forces_routes_per_op_and_overload():
    proc = run_python("""
        import torch, flagos
        a = torch.ones(2, 2, device="flagos")
        out = (a @ a).cpu().tolist()
        try:
            a + a
        except flagos.FallbackError as e:
            print("ERR", str(e).split(" is routed")[0])
        a.add_(1)                      # another overload of add: not forced
        r = flagos.fallback_report()
        print("MM", out, r.op("aten::mm")["calls"], flagos.route_of("aten::add_.Tensor"))
    """, env={"FLAGOS_DEVICE": "cpu", "FLAGOS_FALLBACK": "allow",
              "FLAGOS_ROUTE": " aten::mm=fallback , aten::add.Tensor=error"})
    assert "ERR aten::add.Tensor" in proc.stdout
    assert "MM [[2.0, 2.0], [2.0, 2.0]] {'override': 0, 'native': 0, 'fallback': 1} native" in proc.stdout


@pytest.mark.parametrize("level,shown,hidden", [
    ("info", ["flagos INFO: flagos active on chip cpu (device mode, 1 device(s), fallback=allow)"],
     ["DEBUG"]),
    (None, [], ["flagos active"]),
])
def test_log_level_variable(level, shown, hidden):
    env = {"FLAGOS_DEVICE": "cpu", "FLAGOS_FALLBACK": "allow"}
    if level:
        env["FLAGOS_LOG_LEVEL"] = level
    proc = run_python("import torch; torch.ones(2, device='flagos') + 1", env=env)
    for text in shown:
        assert text in proc.stderr, proc.stderr
    for text in hidden:
        assert text not in proc.stderr, proc.stderr


# ---- the emulated accelerator -------------------------------------------------------------------

def test_sim_devices_variable():
    count = 3
    proc = run_python(SHOW + f"""
    import torch
    last = torch.ones(2, device="flagos:{count - 1}") * 2
    print("LAST", last.device, last.cpu().tolist(), torch.flagos.device_count())
    try:
        torch.ones(2, device="flagos:{count}")
    except RuntimeError as e:
        print("ERR", e)
    """, env={"FLAGOS_DEVICE": "sim", "FLAGOS_SIM_DEVICES": str(count)})
    assert info_of(proc)["device_count"] == count
    assert f"LAST flagos:{count - 1} [2.0, 2.0] {count}" in proc.stdout
    assert f"ERR flagos:{count} does not exist" in proc.stdout


def test_bad_sim_devices_value_names_the_variable():
    value = "17"
    proc = run_python("""
        import flagos
        try:
            flagos.activate("sim")
        except flagos.errors.AdapterError as e:
            print("ERR", e)
    """, env={"FLAGOS_SIM_DEVICES": value, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert f"FLAGOS_SIM_DEVICES='{value}' is not valid; use a whole number from 1 to 16" in proc.stdout


# ---- the build -------------------------------------------------------------------------------

def _setup_functions() -> str:
    """setup.py's function definitions (without the setup() call at its end)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))
            and not (isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("setuptools"))]
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


def test_uthash_include_variable_is_searched_first(tmp_path):
    (tmp_path / "uthash.h").write_text("/* a stand-in */\n")
    code = _setup_functions() + "\nprint('UTHASH', find_uthash())\n"
    proc = run_python(code, env={"FLAGOS_UTHASH_INCLUDE": str(tmp_path)})
    assert f"UTHASH {tmp_path}" in proc.stdout


@pytest.mark.parametrize("value,expected", [
    ("address", "-fsanitize=address'"),
    ("undefined", "-fno-wrapv"),
    ("address,undefined", "['-fsanitize=address,undefined', '-fno-sanitize-recover=undefined'"),
    ("thread", "FLAGOS_SANITIZE='thread' is not supported; use 'address'"),
    ("address,address", "FLAGOS_SANITIZE='address,address' is not supported"),
    ("", "([], [])"),
])
def test_sanitize_variable(value, expected):
    code = _setup_functions() + "\nprint('FLAGS', sanitizer_flags())\n"
    proc = run_python(code, env={"FLAGOS_SANITIZE": value}, check=False)
    assert expected in proc.stdout + proc.stderr


def test_every_documented_variable_is_tested_through_the_environment():
    documented = set(re.findall(r"^\| `(FLAGOS_[A-Z_]+)` \|", DOC, re.M))
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_env_docs.py")
    untested = {v for v in documented
                if not re.search(rf"[\"']{v}[\"']\s*:|\b{v}=|env=\{{[^}}]*\b{v}\b", tests)}
    assert untested == set(), "set in no test's environment: " + ", ".join(sorted(untested))


def test_test_order_seed_reaches_pytest_and_a_bad_one_is_refused(tmp_path):
    """scripts/test.sh hands FLAGOS_TEST_SEED to pytest-randomly and prints it; anything but an
    integer or `random` stops the script before a test runs."""
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\necho "ADDOPTS=$PYTEST_ADDOPTS"\nexit 1\n')  # stops the script
    fake_python.chmod(0o755)
    script = str(ROOT / "scripts" / "test.sh")
    env = {**os.environ, "PYTHON": str(fake_python), "FLAGOS_TEST_SEED": "7"}
    run = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "test order: --randomly-seed=7 " in run.stdout
    # both lanes (the cpu run; the sim run and the sanitizer jobs) get the seed
    addopts = [line for line in run.stdout.splitlines() if line.startswith("ADDOPTS=")]
    assert len(addopts) == 2 and all(line.split()[-1] == "--randomly-seed=7" for line in addopts)
    env["FLAGOS_TEST_SEED"] = " 7"
    run = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "ADDOPTS=" not in run.stdout
    assert "FLAGOS_TEST_SEED=' 7' is not a seed" in run.stderr
