"""The supported Python and PyTorch versions: what README.md and pyproject.toml claim is what
the code accepts, and a PyTorch outside the tested range is told so.

scripts/lowest_versions.sh runs the suite on the lowest supported Python and PyTorch.
"""
import logging
import pathlib
import re

import pytest
import torch

import flagos
from flagos import _activation

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYPROJECT = (ROOT / "pyproject.toml").read_text()

# C API names the sources use that appeared after Python 3.9, with the version that added them
NEWER_C_API = {"Py_NewRef": (3, 10), "Py_XNewRef": (3, 10), "PyModule_AddObjectRef": (3, 10),
               "Py_IsNone": (3, 10), "Py_IsTrue": (3, 10), "Py_IsFalse": (3, 10),
               "PyObject_GetOptionalAttr": (3, 13), "PyDict_GetItemRef": (3, 13),
               "PyList_GetItemRef": (3, 13), "Py_GetConstant": (3, 13)}


def c_sources():
    return list((ROOT / "csrc").rglob("*.[ch]")) + list((ROOT / "backends").rglob("*.[ch]"))


def lowest_python_the_c_code_needs() -> tuple[int, int]:
    needed = (3, 8)
    for path in c_sources():
        text = path.read_text()
        for name, version in NEWER_C_API.items():
            if re.search(rf"\b{name}\s*\(", text):
                needed = max(needed, version)
    return needed


def claimed_lowest_python() -> set[tuple[int, int]]:
    readme = {tuple(map(int, m)) for m in re.findall(r"Python (\d)\.(\d+)\+", README)}
    pyproject = {tuple(map(int, m)) for m in re.findall(r'requires-python = ">=(\d)\.(\d+)"', PYPROJECT)}
    assert readme and pyproject, "README.md or pyproject.toml no longer states the lowest Python"
    return readme | pyproject


@pytest.mark.xfail(claimed_lowest_python() == {(3, 9)}, strict=True,
                   reason="README.md ('Python 3.9+') and pyproject.toml "
                   "(requires-python >=3.9) claim 3.9, but the C code uses Py_NewRef and "
                   "PyModule_AddObjectRef (3.10+): the claim must say 3.10")
def test_claimed_lowest_python_is_what_the_c_code_needs():
    assert claimed_lowest_python() == {lowest_python_the_c_code_needs()}


def test_the_running_python_is_supported():
    assert (__import__("sys").version_info[:2]) >= lowest_python_the_c_code_needs()


def test_readme_states_the_tested_torch_range():
    low, high = re.search(r"flagos accepts PyTorch (\d+\.\d+) to (\d+\.\d+)", README).groups()
    assert (low, high) == _activation.TESTED_TORCH
    assert f'"torch>={low}"' in PYPROJECT


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("version,warned", [
    ("2.8.0", True), ("2.8.9+cu121", True), ("2.9.0", False), ("2.9.1+cpu", False),
    ("2.13.0+cpu", False), ("2.14.1", False), ("2.15.0", True), ("3.0.0", True),
    ("2.10.0a0+git1234", False),
])
def test_torch_outside_the_tested_range_is_warned_about(monkeypatch, version, warned):
    records = _Records()
    log = logging.getLogger("flagos")
    log.addHandler(records)
    monkeypatch.setattr(torch, "__version__", version)
    try:
        _activation._warn_untested_torch()
    finally:
        log.removeHandler(records)
    expected = [f"flagos is made for PyTorch 2.9 to 2.14; this is {version}"] if warned else []
    assert records.messages == expected


def test_activation_on_an_untested_torch_warns_on_stderr():
    from conftest import run_python
    proc = run_python("""
        import torch
        torch.__version__ = "2.16.0"
        import flagos
        flagos.activate("cpu", mode="native")
    """)
    assert "flagos is made for PyTorch 2.9 to 2.14; this is 2.16.0" in proc.stderr
    assert flagos.info()["torch"] == torch.__version__


def test_constraints_pin_every_extra_the_setup_installs():
    """scripts/setup.sh installs the test and example extras under constraints.txt: each of them
    must have a pin there, or a library release could change what a fresh clone tests."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    extras = re.search(r"\[project\.optional-dependencies\](.*?)\n\[", PYPROJECT, re.S).group(1)
    wanted = set()
    for group in ("test", "examples"):
        listed = re.search(rf"^{group} = \[(.*?)\]", extras, re.S | re.M).group(1)
        for requirement in re.findall(r'"([^"]+)"', listed):
            wanted.add(re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[;]", requirement)[0]).lower())
    assert wanted, "no extras found in pyproject.toml"
    missing = sorted(wanted - set(pins))
    assert not missing, f"constraints.txt has no pin for {missing}: run scripts/refresh_constraints.py"
    assert "torch" not in pins, "constraints.txt must not pin torch: flagos supports a range"
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup.sh").read_text()
