"""One compile cache folder per chip (integrations/_caches.py) and `flagos cache`."""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys
import types
import warnings

import pytest
from conftest import run_python
from flagos_cli import run_flagos

import flagos
from flagos.integrations import _caches
from flagos.tools import _cache

COMPILE = """
    import json, os, torch, flagos
    from torch._dynamo.utils import counters
    flagos.activate(None)  # FLAGOS_DEVICE
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    x = torch.arange(8.0)
    torch.testing.assert_close(f(x), torch.sin(x) * 2 + 1)
    print(json.dumps({"caches": flagos.info()["caches"],
                      "inductor_env": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                      "misses": counters["inductor"]["fxgraph_cache_miss"],
                      "hits": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def _last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _files(folder: pathlib.Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_chips_compile_into_their_own_folders(tmp_path):
    """A cpu program compiles a function, then starts a sim program (its environment, with the
    cache variables the cpu activation set) that compiles the same function: the sim program
    compiles it again into its own folder instead of loading the cpu program's graph."""
    cpu = _last_json(run_python(COMPILE, env={"FLAGOS_DEVICE": "cpu", "FLAGOS_CACHE_DIR": str(tmp_path)}))
    inherited = {"TORCHINDUCTOR_CACHE_DIR": cpu["caches"]["inductor"], "TRITON_CACHE_DIR": cpu["caches"]["triton"]}
    sim = _last_json(run_python(COMPILE, env={"FLAGOS_DEVICE": "sim", "FLAGOS_CACHE_DIR": str(tmp_path),
                                              **inherited}))
    cpu_folder, sim_folder = pathlib.Path(cpu["caches"]["folder"]), pathlib.Path(sim["caches"]["folder"])
    assert cpu_folder.parent == sim_folder.parent == tmp_path
    assert cpu_folder.name.startswith("cpu-") and sim_folder.name.startswith("sim-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([cpu_folder.name, sim_folder.name])
    for run, folder in ((cpu, cpu_folder), (sim, sim_folder)):
        assert run["inductor_env"] == str(folder / "inductor")
        assert run["caches"]["inductor_set_by"] == run["caches"]["triton_set_by"] == "flagos"
        assert (run["misses"], run["hits"]) == (1, 0)  # compiled, not loaded from the other
        written = _files(folder / "inductor")
        assert any(name.startswith("fxgraph/") for name in written), written
        assert any(name.endswith(".so") for name in written), written
        mark = json.loads((folder / _caches.MARKER).read_text())
        assert mark["chip"] == folder.name.split("-")[0]
        # the chip's own architecture names the folder (not "unknown")
        assert mark["architecture"] == flagos.chips.profile(mark["chip"]).architecture() != "unknown"
        assert folder.name == _caches.folder_name(mark["chip"], mark["vendor"], mark["architecture"])


def test_a_user_set_inductor_folder_is_kept(tmp_path):
    """Inductor reads TORCHINDUCTOR_CACHE_DIR when it compiles: left as the user set it, it is
    where the artefacts go (the compilation itself is the test above's)."""
    mine = tmp_path / "mine"
    code = """
        import json, os, flagos
        caches = flagos.activate(None)["caches"]
        print(json.dumps({"caches": caches, "inductor_env": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                          "triton_env": os.environ.get("TRITON_CACHE_DIR")}))
    """
    run = _last_json(run_python(code, env={"FLAGOS_DEVICE": "cpu", "FLAGOS_CACHE_DIR": str(tmp_path / "flagos"),
                                           "TORCHINDUCTOR_CACHE_DIR": str(mine)}))
    assert run["inductor_env"] == str(mine)
    assert run["caches"]["inductor"] == str(mine) and run["caches"]["inductor_set_by"] == "user"
    assert run["caches"]["triton_set_by"] == "flagos"  # the one the user did not set
    assert run["triton_env"] == str(pathlib.Path(run["caches"]["folder"]) / "triton")
    # both set: nothing of the program's goes to the chip's folder, which is not even made
    both = _last_json(run_python(code, env={"FLAGOS_DEVICE": "cpu", "FLAGOS_CACHE_DIR": str(tmp_path / "unused"),
                                            "TORCHINDUCTOR_CACHE_DIR": str(mine), "TRITON_CACHE_DIR": str(mine)}))
    assert both["caches"]["folder"] is None and both["triton_env"] == str(mine)
    assert both["caches"]["triton_set_by"] == both["caches"]["inductor_set_by"] == "user"
    assert not (tmp_path / "unused").exists()


def test_an_unusable_folder_warns_and_the_process_goes_on(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    code = """
        import json, os, warnings, torch, flagos
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = flagos.activate("cpu")
        x = torch.ones(3, device=flagos.device()) * 2
        print(json.dumps({"warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
                          "where": [f"{w.filename}:{w.lineno}" for w in caught if w.category is RuntimeWarning],
                          "caches": info["caches"], "sum": x.sum().item(),
                          "env": [os.environ.get(v) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")]}))
    """
    # a folder a parent flagos process set (another chip's) is not kept when this one cannot
    # have its own: the caches go back to PyTorch's defaults
    marked = tmp_path / "sim-x-y"
    marked.mkdir()
    (marked / _caches.MARKER).write_text("{}")
    run = _last_json(run_python(code, env={"FLAGOS_CACHE_DIR": str(not_a_folder),
                                           "TORCHINDUCTOR_CACHE_DIR": str(marked / "inductor")}))
    assert run["sum"] == 6.0
    assert len(run["warnings"]) == 1
    assert run["where"] == ["<string>:5"]  # the program's line that activated flagos
    assert str(not_a_folder) in run["warnings"][0] and "Set FLAGOS_CACHE_DIR to a folder you can write" in run["warnings"][0]
    # the error in words, once: its type and the system's reason, the path already said before it
    assert "(NotADirectoryError: Not a directory); Inductor and Triton keep" in run["warnings"][0]
    assert run["caches"]["folder"] is None and run["caches"]["problem"] == run["warnings"][0]
    assert run["env"] == [None, None]
    assert run["caches"]["inductor_set_by"] == "default"


def test_leaving_native_mode_restores_what_activation_set(tmp_path):
    code = """
        import json, os, flagos
        before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        flagos.activate("cpu", mode="native")
        during = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        flagos.deactivate()
        print(json.dumps([before, during, os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                          os.environ.get("TRITON_CACHE_DIR")]))
    """
    before, during, after, triton = _last_json(run_python(code, env={"FLAGOS_CACHE_DIR": str(tmp_path)}))
    assert during.startswith(str(tmp_path / "cpu-")) and during.endswith("inductor")
    assert after == before  # the test process's own (its activation set it) or unset
    assert triton == os.environ.get("TRITON_CACHE_DIR")


def test_default_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FLAGOS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _caches.root() == str(tmp_path / "flagos")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _caches.root() == str(tmp_path / "home" / ".cache" / "flagos")
    monkeypatch.setenv("FLAGOS_CACHE_DIR", "~/c")
    assert _caches.root() == str(tmp_path / "home" / "c")


def test_folder_names():
    assert _caches.folder_name("cuda", "nvidia", "sm90") == "cuda-nvidia-sm90"
    assert _caches.folder_name("cuda", "amd", "gfx942:sramecc+:xnack-") == "cuda-amd-gfx942_sramecc+_xnack"
    assert _caches.folder_name("sim", "flagos (emulated accelerator)", "sim-abi1.1") == \
        "sim-flagos_emulated_accelerator-sim_abi1.1"
    assert _caches.folder_name("xpu", "intel", "") == "xpu-intel-unknown"
    cpu = flagos.chips.profile("cpu").architecture()
    assert cpu.startswith(os.uname().machine) and cpu.count("-") == 1


def _chip_read_at_initialization(monkeypatch, root, architecture_now=lambda: "sm90"):
    """A cuda-like chip whose architecture is known only once its runtime initializes, no cache
    variable set and FLAGOS_CACHE_DIR at `root`: (the chip, its waiting initialization hooks)."""
    for variable, _ in _caches.VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FLAGOS_CACHE_DIR", str(root))
    waiting = []
    chip = types.SimpleNamespace(name="cuda", vendor="nvidia", architecture=lambda: None,
                                 architecture_now=architecture_now, when_initialized=waiting.append)
    return chip, waiting


def test_a_chip_that_cannot_tell_yet_chooses_its_folder_when_initialized(monkeypatch, tmp_path):
    """The cuda chip's architecture is read when the CUDA runtime initializes (reading it
    earlier would initialize it): the folder is chosen then, before anything compiles."""
    chip, waiting = _chip_read_at_initialization(monkeypatch, tmp_path)
    try:
        caches = _caches.install(types.SimpleNamespace(chip=chip))
        assert caches["folder"] is None and "pending" in caches
        assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
        waiting.pop()()  # the runtime initializes
        assert caches["folder"] == str(tmp_path / "cuda-nvidia-sm90") and "pending" not in caches
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cuda-nvidia-sm90" / "inductor")
    finally:
        _caches.uninstall()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    # a runtime already initialized (the architecture known): chosen at once, nothing waits
    ready = types.SimpleNamespace(**{**vars(chip), "architecture": lambda: "sm90"})
    try:
        caches = _caches.install(types.SimpleNamespace(chip=ready))
        assert caches["folder"] == str(tmp_path / "cuda-nvidia-sm90") and "pending" not in caches
        assert waiting == []
    finally:
        _caches.uninstall()


def test_a_failure_inside_the_runtimes_initialization_never_escapes_it(monkeypatch, tmp_path):
    """The folder is chosen inside the runtime's initialization, where nothing may escape: an
    architecture that cannot be read is "unknown"; a warning made an error (-W error) about an
    unusable folder is kept as the caches' problem."""
    def unreadable():
        raise RuntimeError("the driver is not answering")

    chip, waiting = _chip_read_at_initialization(monkeypatch, tmp_path, unreadable)
    try:
        caches = _caches.install(types.SimpleNamespace(chip=chip))
        waiting.pop()()
        assert caches["folder"] == str(tmp_path / "cuda-nvidia-unknown")
    finally:
        _caches.uninstall()
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("FLAGOS_CACHE_DIR", str(not_a_folder))
    chip.architecture_now = lambda: "sm90"
    try:
        caches = _caches.install(types.SimpleNamespace(chip=chip))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            waiting.pop()()
        assert caches["folder"] is None and "Set FLAGOS_CACHE_DIR to a folder you can write" in caches["problem"]
    finally:
        _caches.uninstall()


def test_info_names_the_caches_in_use():
    caches = flagos.info()["caches"]
    assert set(caches) >= {"root", "folder", "inductor", "triton", "inductor_set_by", "triton_set_by"}


@pytest.fixture
def cache_root(tmp_path):
    for chip, vendor, arch, size in (("cpu", "host", "x86_64-avx2", 100), ("sim", "flagos", "sim-abi1.1", 10),
                                     ("cuda", "nvidia", "sm90", 1000)):
        folder = tmp_path / _caches.folder_name(chip, vendor, arch)
        assert _caches._prepare(str(folder), chip, vendor, arch) is None
        (folder / "inductor").mkdir()
        (folder / "inductor" / "artefact").write_bytes(b"x" * size)
    (tmp_path / "not-flagos").mkdir()  # someone else's: never listed, never removed
    (tmp_path / "not-flagos" / "keep").write_text("mine")
    return tmp_path


def test_cli_lists_the_folders_with_sizes(cache_root):
    proc = run_flagos("cache", "--json", env={"FLAGOS_CACHE_DIR": str(cache_root)})
    assert proc.returncode == 0, proc.stderr
    rows = {r["chip"]: r for r in json.loads(proc.stdout)["folders"]}
    assert sorted(rows) == ["cpu", "cuda", "sim"]
    marker = len((cache_root / rows["cpu"]["folder"] / _caches.MARKER).read_bytes())
    assert rows["cpu"]["bytes"] == 100 + marker and rows["cuda"]["architecture"] == "sm90"
    text = run_flagos("cache", "--chip", "nvidia", env={"FLAGOS_CACHE_DIR": str(cache_root)}).stdout
    assert "cuda-nvidia-sm90" in text and "cpu-host" not in text


def test_cli_clears_one_chip_then_all(cache_root):
    env = {"FLAGOS_CACHE_DIR": str(cache_root)}
    proc = run_flagos("cache", "--clear", "--chip", "sim", env=env)
    assert proc.returncode == 0 and "removed" in proc.stdout and "sim-flagos" in proc.stdout
    assert sorted(p.name for p in cache_root.iterdir()) == ["cpu-host-x86_64_avx2", "cuda-nvidia-sm90", "not-flagos"]
    assert run_flagos("cache", "--clear", env=env).returncode == 0
    assert [p.name for p in cache_root.iterdir()] == ["not-flagos"]
    assert (cache_root / "not-flagos" / "keep").read_text() == "mine"
    proc = run_flagos("cache", env=env)
    assert proc.returncode == 0 and "no flagos cache folders in" in proc.stdout


def test_the_python_call_lists_and_removes_only_when_asked(cache_root, monkeypatch):
    """flagos.tools.cache(): listing is the default; clear=True removes."""
    monkeypatch.setenv("FLAGOS_CACHE_DIR", str(cache_root))
    listed = flagos.tools.cache()
    assert sorted(r["chip"] for r in listed["folders"]) == ["cpu", "cuda", "sim"] and listed["removed"] == []
    assert [r["chip"] for r in flagos.tools.cache(chip="sim")["folders"]] == ["sim"]
    assert len(list(cache_root.iterdir())) == 4  # nothing removed
    gone = flagos.tools.cache(clear=True, chip="sim")
    assert [r["chip"] for r in gone["removed"]] == ["sim"] and gone["folders"] == []
    assert len(list(cache_root.iterdir())) == 3


def test_cli_refuses_an_unknown_chip(cache_root):
    proc = run_flagos("cache", "--clear", "--chip", "tpu", env={"FLAGOS_CACHE_DIR": str(cache_root)})
    assert proc.returncode == 2 and "unknown chip 'tpu'" in proc.stderr and "cuda" in proc.stderr
    assert len(list(cache_root.iterdir())) == 4  # nothing removed


def test_cli_on_a_missing_root(tmp_path):
    proc = run_flagos("cache", env={"FLAGOS_CACHE_DIR": str(tmp_path / "absent")})
    assert proc.returncode == 0 and "no flagos cache folders" in proc.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_leaving_gives_back_what_the_variable_held_just_before_the_last_activation(monkeypatch, tmp_path):
    """Activated twice without leaving (the second time after the variable was removed): leaving
    gives back what it held before the second, not the first."""
    # this process's own activation is left as it is: the test works on fresh bookkeeping
    monkeypatch.setattr(_caches, "_ours", {})
    monkeypatch.setattr(_caches, "_before", {})
    for variable, _ in _caches.VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FLAGOS_CACHE_DIR", str(tmp_path / "cache"))
    other = tmp_path / "other-chip"   # a folder another flagos process made: replaced, not kept
    (other / "inductor").mkdir(parents=True)
    (other / _caches.MARKER).write_text("{}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(other / "inductor"))
    chip = types.SimpleNamespace(name="toy", vendor="v", architecture=lambda: "a1")
    try:
        _caches.install(types.SimpleNamespace(chip=chip))
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "cache"))
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        _caches.install(types.SimpleNamespace(chip=chip))
    finally:
        _caches.uninstall()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_cli_takes_a_chip_only_its_folders_know(cache_root):
    # a folder an adapter chip made that this process has not loaded: listed and cleared by name
    assert _caches._prepare(str(cache_root / "toy-acme-t1"), "toy", "acme", "t1") is None
    env = {"FLAGOS_CACHE_DIR": str(cache_root)}
    proc = run_flagos("cache", "--chip", "toy", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert [r["folder"] for r in json.loads(proc.stdout)["folders"]] == ["toy-acme-t1"]
    proc = run_flagos("cache", "--clear", "--chip", "toy", "--json", env=env)
    result = json.loads(proc.stdout)
    assert [r["folder"] for r in result["removed"]] == ["toy-acme-t1"] and result["folders"] == []
    assert not (cache_root / "toy-acme-t1").exists() and (cache_root / "cuda-nvidia-sm90").exists()


def test_cli_clearing_nothing_says_so(tmp_path):
    proc = run_flagos("cache", "--clear", env={"FLAGOS_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip() == f"nothing to clear in {tmp_path}"


def test_cli_a_folder_that_cannot_be_removed_is_exit_1(cache_root, monkeypatch, capsys):
    def refuse(base=None, chip=None):
        raise PermissionError(13, "Permission denied", str(cache_root / "cpu-host-x86_64_avx2"))
    monkeypatch.setenv("FLAGOS_CACHE_DIR", str(cache_root))
    monkeypatch.setattr(_caches, "clear", refuse)
    assert _cache.run(types.SimpleNamespace(clear=True, chip=None, json=False)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flagos cache: cannot remove {cache_root / 'cpu-host-x86_64_avx2'}: Permission denied")
    assert "remove it by hand" in err


def test_whose_folder_a_variable_names(monkeypatch, tmp_path):
    """A user's folder that happens to be called `inductor` stays the user's (no flagos mark
    beside it); the folder flagos set stays flagos's even after `flagos cache clear` removed it
    and its mark, so activating again makes it anew."""
    for variable, _ in _caches.VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FLAGOS_CACHE_DIR", str(tmp_path / "root"))
    chip = types.SimpleNamespace(name="cuda", vendor="nvidia", architecture=lambda: "sm90")
    mine = tmp_path / "work" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    try:
        caches = _caches.install(types.SimpleNamespace(chip=chip))
        assert (caches["inductor"], caches["inductor_set_by"]) == (str(mine), "user")
        assert caches["triton_set_by"] == "flagos"
    finally:
        _caches.uninstall()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    try:
        first = _caches.install(types.SimpleNamespace(chip=chip))
        assert first["inductor_set_by"] == "flagos"
        assert [row["folder"] for row in _caches.clear()] == ["cuda-nvidia-sm90"]
        again = _caches.install(types.SimpleNamespace(chip=chip))
        assert (again["inductor"], again["inductor_set_by"]) == (first["inductor"], "flagos")
        assert os.path.isfile(os.path.join(again["folder"], _caches.MARKER))
    finally:
        _caches.uninstall()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_inductors_own_default_in_its_variable_is_not_the_users_choice(monkeypatch, tmp_path):
    """Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR when it first asks for
    it: that value is not the user's, and flagos's folder replaces it. The same path in
    TRITON_CACHE_DIR, any other path, or any path before Inductor ran (or where its helper
    fails) is the user's. Activating again uses the folder made the first time."""
    module = "torch._inductor.runtime.cache_dir_utils"
    default = importlib.import_module(module).default_cache_dir()
    monkeypatch.setenv("FLAGOS_CACHE_DIR", str(tmp_path / "root"))
    chip = types.SimpleNamespace(name="cuda", vendor="nvidia", architecture=lambda: "sm90")

    def set_by(inductor, triton):
        for (variable, _), value in zip(_caches.VARIABLES, (inductor, triton)):
            if value is None:
                monkeypatch.delenv(variable, raising=False)
            else:
                monkeypatch.setenv(variable, value)
        try:
            caches = _caches.install(types.SimpleNamespace(chip=chip))
            return caches["inductor_set_by"], caches["triton_set_by"]
        finally:
            _caches.uninstall()

    assert set_by(default, None) == ("flagos", "flagos")
    assert set_by(default, None) == ("flagos", "flagos")  # the folder exists now: used as it is
    assert set_by(None, default) == ("flagos", "user")
    assert set_by(str(tmp_path / "mine"), None) == ("user", "flagos")

    def failing():
        raise AttributeError("default_cache_dir moved")

    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(default_cache_dir=failing))
    assert set_by(default, None) == ("user", "flagos")
    monkeypatch.delitem(sys.modules, module)
    assert set_by(default, None) == ("user", "flagos")


def test_a_deferred_choice_of_an_activation_already_left_does_nothing(monkeypatch, tmp_path):
    chip, waiting = _chip_read_at_initialization(monkeypatch, tmp_path)
    caches = _caches.install(types.SimpleNamespace(chip=chip))
    _caches.uninstall()  # native mode left before the runtime initialized
    waiting.pop()()
    assert caches["folder"] is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert not (tmp_path / "cuda-nvidia-sm90").exists()


def test_a_file_removed_while_sizes_are_counted_counts_nothing(cache_root, monkeypatch):
    """Another process compiling or clearing may remove a file between the folder listing and
    its size: the listing goes on and counts the files still there."""
    real_lstat = os.lstat

    def lstat(path, *args, **kwargs):
        if os.path.basename(path) == "artefact":
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_lstat(path, *args, **kwargs)

    sizes = {row["chip"]: row["bytes"] for row in _caches.folders(str(cache_root))}
    monkeypatch.setattr(os, "lstat", lstat)
    gone = {row["chip"]: row["bytes"] for row in _caches.folders(str(cache_root))}
    monkeypatch.undo()
    marker = os.path.getsize(cache_root / _caches.folder_name("cuda", "nvidia", "sm90") / _caches.MARKER)
    assert sizes["cuda"] == marker + 1000 and gone["cuda"] == marker


def test_the_listing_reads_flagos_cache_dir_when_given_no_folder(cache_root, monkeypatch, tmp_path):
    monkeypatch.setenv("FLAGOS_CACHE_DIR", str(cache_root))
    monkeypatch.chdir(tmp_path / "not-flagos")  # not the working directory
    assert sorted(row["chip"] for row in _caches.folders()) == ["cpu", "cuda", "sim"]
