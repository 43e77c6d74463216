"""Where running flagos metrics exporters announce themselves, so `flagos top` finds them.

An exporter started in a process writes `<dir>/<pid>.json` ({"pid", "host", "port", "url",
"chip"}) and removes it at exit; `running()` lists the files whose process is still alive.
The folder is `FLAGOS_RUNTIME_DIR`, else `<tmp>/flagos-<uid>`.
"""
from __future__ import annotations

import atexit
import json
import os
import tempfile


def directory() -> str:
    base = os.environ.get("FLAGOS_RUNTIME_DIR") or os.path.join(
        tempfile.gettempdir(), f"flagos-{os.getuid()}")
    return os.path.join(base, "exporters")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def url(host: str, port: int) -> str:
    """Where a scraper on this machine reaches an exporter bound to host:port."""
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/metrics"


def announce(host: str, port: int, chip: str | None) -> str:
    """Record this process's exporter; the record goes away when the process exits (or at
    `withdraw(path)`). Returns the record's path."""
    folder = directory()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, f"{os.getpid()}.json")
    record = {"pid": os.getpid(), "host": host, "port": port, "url": url(host, port), "chip": chip}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    atexit.register(withdraw, path)
    return path


def withdraw(path: str) -> None:
    """Remove an announcement (the exporter stopped)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def running() -> list[dict]:
    """Exporters of live processes, oldest pid first; stale records are removed."""
    folder = directory()
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        pid = record.get("pid") if isinstance(record, dict) else None
        # a record without a pid is no process's: kill(-1 or 0, 0) would ask about many
        if isinstance(pid, int) and pid > 0 and _alive(pid):
            found.append(record)
        else:
            withdraw(path)
    return sorted(found, key=lambda r: r["pid"])
