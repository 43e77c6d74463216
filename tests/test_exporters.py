"""Where metrics exporters announce themselves (report/_exporters.py), which `flagos top` reads."""
import json
import os
import stat
import subprocess
import sys
import tempfile

import pytest

from flagos.report import _exporters


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGOS_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_the_folder_is_the_runtime_dirs_or_a_private_one_under_tmp(runtime_dir, monkeypatch):
    assert _exporters.directory() == str(runtime_dir / "exporters")
    monkeypatch.delenv("FLAGOS_RUNTIME_DIR")
    assert _exporters.directory() == os.path.join(tempfile.gettempdir(), f"flagos-{os.getuid()}", "exporters")


@pytest.mark.parametrize("host, shown", [("", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"),
                                         ("::1", "[::1]"), ("localhost", "localhost")])
def test_the_url_a_scraper_on_this_machine_uses(host, shown):
    assert _exporters.url(host, 9400) == f"http://{shown}:9400/metrics"


def test_an_announcement_is_private_listed_while_alive_and_withdrawn(runtime_dir):
    path = _exporters.announce("0.0.0.0", 9400, "sim")
    assert path == str(runtime_dir / "exporters" / f"{os.getpid()}.json")
    assert stat.S_IMODE(os.stat(runtime_dir / "exporters").st_mode) == 0o700
    assert _exporters.announce("::1", 9401, None) == path  # again: the folder exists, the record replaced
    assert _exporters.running() == [{"pid": os.getpid(), "host": "::1", "port": 9401,
                                     "url": "http://[::1]:9401/metrics", "chip": None}]
    assert not [n for n in os.listdir(runtime_dir / "exporters") if n.endswith(".tmp")]
    _exporters.withdraw(path)
    _exporters.withdraw(path)  # twice: nothing to remove is fine
    assert _exporters.running() == []


def test_nothing_announced_yet_is_no_exporter(runtime_dir):
    assert _exporters.running() == []


def test_records_that_are_not_a_live_exporter_are_skipped_or_removed(runtime_dir):
    folder = runtime_dir / "exporters"
    folder.mkdir()
    ended = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True).stdout)
    mine = {"pid": os.getpid(), "host": "127.0.0.1", "port": 1, "url": "u", "chip": "cpu"}
    (folder / "0.json").write_text("{not json")       # half written by a crashed process: skipped
    (folder / "1.json").mkdir()                        # unreadable: skipped
    (folder / "2.json").write_text(json.dumps({"host": "h"}))  # no pid: no process's, removed
    (folder / "3.json").write_text(json.dumps([1, 2]))           # not a record: removed
    (folder / "4.json").write_text(json.dumps({**mine, "pid": 0}))   # kill(0, 0) is a group: removed
    (folder / "5.json").write_text(json.dumps({**mine, "pid": -7}))  # kill(-7, 0) is a group: removed
    (folder / f"{ended}.json").write_text(json.dumps({**mine, "pid": ended}))  # its process ended
    (folder / "0.json.tmp").write_text(json.dumps(mine))     # not a record's name (sorted before the live one)
    (folder / f"{os.getpid()}.json").write_text(json.dumps(mine))
    assert _exporters.running() == [mine]
    assert sorted(os.listdir(folder)) == sorted(["0.json", "0.json.tmp", "1.json", f"{os.getpid()}.json"])


def test_a_process_of_another_user_is_alive(monkeypatch):
    def refused(pid, sig):
        assert sig == 0  # only asks: never sends a signal
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "kill", refused)
    assert _exporters._alive(1) is True

    def gone(pid, sig):
        raise ProcessLookupError(3, "No such process")
    monkeypatch.setattr(os, "kill", gone)
    assert _exporters._alive(12345) is False


def test_an_exporter_that_is_pid_1_is_listed(runtime_dir):
    """In a container the program is often pid 1, and pid 1 is always alive."""
    folder = runtime_dir / "exporters"
    folder.mkdir()
    init = {"pid": 1, "host": "127.0.0.1", "port": 9491, "url": "u", "chip": "cpu"}
    (folder / "1.json").write_text(json.dumps(init))
    assert _exporters.running() == [init]
