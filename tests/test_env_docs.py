"""docs/environment.md and the code name the same environment variables."""
import pathlib
import re

from flagos.core._env import ENV_VARS

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "environment.md").read_text()


def _section(title: str) -> str:
    return DOC.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_runtime_table_is_exactly_the_env_table():
    documented = re.findall(r"^\| `(FLAGOS_[A-Z_]+)` \|", _section("Runtime"), re.M)
    assert documented == [v.name for v in ENV_VARS]


def test_defaults_and_choices_are_documented():
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(FLAGOS_[A-Z_]+)` \|(.*)$", _section("Runtime"), re.M)}
    for var in ENV_VARS:
        default_cell = rows[var.name].split("|")[0].strip()
        assert default_cell == (f"`{var.default}`" if var.default else "unset"), var.name
        for choice in var.choices:
            assert f"`{choice}`" in rows[var.name], (var.name, choice)


def test_every_variable_in_the_source_is_documented():
    used = set()
    for path in list((ROOT / "flagos").rglob("*.py")) + [ROOT / "setup.py"] + \
            list((ROOT / "csrc").rglob("*.[ch]")) + list((ROOT / "backends").rglob("*.[ch]")) + \
            list((ROOT / "tests").rglob("*.py")) + list((ROOT / "tests").rglob("*.sh")) + \
            list((ROOT / "scripts").glob("*.sh")):
        if path.name == "test_env_docs.py":
            continue
        text = path.read_text()
        # a variable is read by name from a string ("FLAGOS_X") or set in a script (FLAGOS_X=1);
        # C macros of the same prefix are neither
        used |= set(re.findall(r"[\"'](FLAGOS_[A-Z][A-Z_]*[A-Z])[\"'=]", text))
        used |= set(re.findall(r"(?m)(?:^|\s)(FLAGOS_[A-Z][A-Z_]*[A-Z])=", text))
    documented = set(re.findall(r"`(FLAGOS_[A-Z_]+)`", DOC))
    assert used - documented == set(), "undocumented: " + ", ".join(sorted(used - documented))
    assert documented - used == set(), "documented but unused: " + ", ".join(sorted(documented - used))
