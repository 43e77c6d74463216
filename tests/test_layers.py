"""The package's layout is its architecture: the import contract in pyproject.toml holds, no module
imports one above it or sits in an import cycle, imports inside functions are few and say why,
and the Python code is clean under ruff."""
from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import grimp
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flagos"
MAX_FUNCTION_LEVEL_IMPORTS = 10  # flagos-to-flagos imports inside functions, package-wide


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
    """Run import-linter over the flagos package found under `root`, with `root`'s pyproject."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run([sys.executable, "-c", command, "--config", str(root / "pyproject.toml"),
                           "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contract_holds():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _copy_package(tmp_path: pathlib.Path) -> pathlib.Path:
    shutil.copytree(PACKAGE, tmp_path / "flagos", ignore=shutil.ignore_patterns(
        "*.so", "__pycache__", "*.json"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize("module, upward", [
    ("core/_env.py", "from .._activation import activate"),          # the leaf imports the top
    ("runtime/_tensor.py", "from ..report import _report"),           # runtime imports the report
    ("chips/cpu.py", "from .cuda import CHIP as CUDA"),               # one chip profile another
])
def test_an_upward_import_fails_the_contract_and_is_named(tmp_path, module, upward):
    root = _copy_package(tmp_path)
    path = root / "flagos" / module
    path.write_text(path.read_text() + f"\n{upward}  # planted\n")
    result = lint_imports(root)
    assert result.returncode != 0
    importer = "flagos." + module[:-3].replace("/", ".")
    assert importer in result.stdout and "BROKEN" in result.stdout, result.stdout


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("flagos", exclude_type_checking_imports=True)


def test_no_import_cycle_anywhere_in_the_package():
    graph = _graph()
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(start):
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for module in modules:
        if module not in index:
            visit(module)
    assert cycles == []


def _function_level_flagos_imports() -> list[tuple[str, int, str]]:
    """(file, line, the line above) of every flagos import made inside a function."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                internal = (isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("flagos"))) or (
                    isinstance(node, ast.Import) and any(a.name.split(".")[0] == "flagos" for a in node.names))
                if internal:
                    found.append((str(path.relative_to(ROOT)), node.lineno, lines[node.lineno - 2].strip()))
    return sorted(set(found))


def test_few_imports_inside_functions_each_with_its_reason():
    imports = _function_level_flagos_imports()
    assert len(imports) <= MAX_FUNCTION_LEVEL_IMPORTS, imports
    unexplained = [(f, line) for f, line, above in imports if not above.startswith("#")]
    assert unexplained == [], "a flagos import inside a function needs a one-line comment above it"


def test_the_python_code_is_clean_under_ruff():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "flagos", "tests", "scripts", "benchmarks",
                             "examples", "setup.py"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
