"""One cache folder per chip: where Inductor and Triton keep what they compile.

Inductor and Triton keep compiled code on disk (`TORCHINDUCTOR_CACHE_DIR`, by default
`<tmp>/torchinductor_<user>`; `TRITON_CACHE_DIR`, by default `~/.triton/cache`), shared by every
process of the user whatever device it compiled for. Activation points both at a folder of
its own chip instead:

    FLAGOS_CACHE_DIR/<chip>-<vendor>-<architecture>/inductor     TORCHINDUCTOR_CACHE_DIR
    FLAGOS_CACHE_DIR/<chip>-<vendor>-<architecture>/triton       TRITON_CACHE_DIR

`FLAGOS_CACHE_DIR` defaults to `$XDG_CACHE_HOME/flagos`, else `~/.cache/flagos`. The
architecture is the chip profile's (`architecture()`: "sm90" on an NVIDIA H100, "x86_64-avx2"
for the cpu chip, "sim-abi1.2" for an adapter), "unknown" where the profile knows nothing.
Two processes on different chips (or on GPUs of different architectures) thus never read
each other's artefacts. Inside one folder, Inductor's own keys (with flagos's pass id,
integrations/_compile.py) keep graphs of different shapes, dtypes and flagos versions apart.

A variable the user set is left alone (their folder is used as they asked). Both are read by
Inductor and Triton when they compile, not at import, so setting them at activation takes
effect even where torch._inductor was imported first. A folder that cannot be created or
written gives a RuntimeWarning naming the fix, and the caches stay where PyTorch puts them:
the process keeps working.

Each folder holds `flagos-cache.json` (chip, vendor, architecture), the mark `flagos cache`
looks for: it lists and clears only folders that carry it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
import warnings

from ..core import _env
from ..core._callers import program_stacklevel

MARKER = "flagos-cache.json"
VARIABLES = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))

_lock = threading.Lock()
_ours: dict[str, str] = {}   # the variables activation set, and to what
_before: dict[str, str | None] = {}  # and what they were before
_generation = 0              # bumped by uninstall: a deferred install of an older activation is void


# ---- where ------------------------------------------------------------------

def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flagos")


def root() -> str:
    """FLAGOS_CACHE_DIR (`~` expanded, made absolute), or the default."""
    value = _env.get("FLAGOS_CACHE_DIR")
    return os.path.abspath(os.path.expanduser(value)) if value else default_root()


def _part(text: str) -> str:
    """A piece of a folder name: lower case, runs of anything but [a-z0-9.+] as one '_'."""
    return re.sub(r"[^a-z0-9.+]+", "_", str(text).lower()).strip("_") or "unknown"


def folder_name(chip: str, vendor: str, architecture: str) -> str:
    return "-".join(_part(p) for p in (chip, vendor, architecture))


# ---- activation ----------------------------------------------------------------

def install(state) -> dict:
    """Point Inductor's and Triton's caches at the chip's folder; what `info()` shows as
    "caches". On the cuda chip before the CUDA runtime is initialized the architecture is not
    known yet (reading it would initialize it): the folder is chosen when it is, before
    anything can compile on it."""
    chip = state.chip
    caches = {"root": root(), "folder": None, "inductor": None, "triton": None}
    architecture = chip.architecture()
    if architecture is None and hasattr(chip, "when_initialized"):
        caches["pending"] = "chosen when the chip's runtime is initialized"
        generation = _generation

        def later():  # inside the runtime's initialization: nothing may escape
            if generation != _generation:
                return
            caches.pop("pending", None)
            try:
                found = chip.architecture_now()
            except Exception:  # the runtime's own failure is its initialization's to report
                found = "unknown"
            try:
                _apply(caches, chip, found)
            except Exception as e:  # a warning made an error (-W error): say it, go on
                caches["problem"] = str(e)
        chip.when_initialized(later)
        return caches
    _apply(caches, chip, architecture or "unknown")
    return caches


def _apply(caches: dict, chip, architecture: str) -> None:
    folder = os.path.join(caches["root"], folder_name(chip.name, chip.vendor, architecture))
    with _lock:
        users = {variable for variable, sub in VARIABLES if _users(variable, sub)}
        if len(users) == len(VARIABLES):  # nothing goes in the chip's folder: do not make it
            folder = problem = None
        else:
            problem = _prepare(folder, chip.name, chip.vendor, architecture)
        for variable, sub in VARIABLES:
            current = os.environ.get(variable)
            if variable in users:
                caches[sub] = current   # the user's choice
                caches[f"{sub}_set_by"] = "user"
            elif problem is None:
                path = os.path.join(folder, sub)
                if current != _ours.get(variable):  # what it held just before flagos set it now
                    _before[variable] = current
                os.environ[variable] = _ours[variable] = path
                caches[sub] = path
                caches[f"{sub}_set_by"] = "flagos"
            else:  # PyTorch's / Triton's default (not another chip's folder a parent set)
                if current is not None:
                    del os.environ[variable]
                _ours.pop(variable, None)
                caches[sub] = None
                caches[f"{sub}_set_by"] = "default"
    if problem is None:
        caches["folder"] = folder
    else:  # outside the lock: a warning turned into an error must not leave it held
        caches["problem"] = problem
        warnings.warn(problem, RuntimeWarning, stacklevel=program_stacklevel())


def _users(variable: str, sub: str) -> bool:
    """Whether the variable holds a folder the user chose."""
    current = os.environ.get(variable)
    return current is not None and not _flagos_made(variable, current, sub) and \
        not _inductor_default(variable, current)


def _flagos_made(variable: str, value: str, sub: str) -> bool:
    """A value flagos set: in this process, or in the parent whose environment this process
    inherited (a program on another chip that started this one must not lend it its folder)."""
    if value == _ours.get(variable):
        return True
    return os.path.basename(value) == sub and os.path.isfile(os.path.join(os.path.dirname(value), MARKER))


def _inductor_default(variable: str, value: str) -> bool:
    """Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR the first time it asks
    for it: a value that is that default was not the user's choice."""
    if variable != "TORCHINDUCTOR_CACHE_DIR":
        return False
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if utils is None:  # Inductor never ran here: the value is the user's
        return False
    try:
        return os.path.abspath(value) == os.path.abspath(utils.default_cache_dir())
    except Exception:  # a PyTorch whose helper differs: keep the value
        return False


def _prepare(folder: str, chip: str, vendor: str, architecture: str) -> str | None:
    """Create the folder and its mark; the problem in words when that fails."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".flagos-cache-", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump({"chip": chip, "vendor": vendor, "architecture": architecture}, f)
        os.replace(tmp, os.path.join(folder, MARKER))
    except OSError as e:
        return (f"flagos cannot use the cache folder {folder} ({type(e).__name__}: "
                f"{e.strerror or e}); Inductor and Triton keep their default cache folders. Set "
                f"FLAGOS_CACHE_DIR to a folder you can write (or TORCHINDUCTOR_CACHE_DIR and "
                f"TRITON_CACHE_DIR yourself)")
    return None


def uninstall() -> None:
    """Native mode left: the variables activation set go back to what they were (those
    changed since stay as they are)."""
    global _generation
    with _lock:
        _generation += 1
        for variable, value in list(_ours.items()):
            if os.environ.get(variable) == value:
                previous = _before.get(variable)
                if previous is None:
                    del os.environ[variable]
                else:
                    os.environ[variable] = previous
        _ours.clear()
        _before.clear()


# ---- `flagos cache` -----------------------------------------------------------------

def _size(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:  # removed while walking
                pass
    return total


def folders(base: str | None = None) -> list[dict]:
    """The chip folders under FLAGOS_CACHE_DIR (those with the mark), with their sizes."""
    base = base or root()
    rows = []
    try:
        entries = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError):
        return rows
    for entry in entries:
        path = os.path.join(base, entry)
        try:
            with open(os.path.join(path, MARKER)) as f:
                mark = json.load(f)
        except (OSError, ValueError):
            continue  # not a flagos folder
        rows.append({"folder": entry, "path": path, "chip": mark.get("chip", ""),
                     "vendor": mark.get("vendor", ""), "architecture": mark.get("architecture", ""),
                     "bytes": _size(path)})
    return rows


def clear(base: str | None = None, chip: str | None = None) -> list[dict]:
    """Remove the chip folders (of one chip if given); the rows removed."""
    removed = []
    for row in folders(base):
        if chip is None or row["chip"] == chip:
            shutil.rmtree(row["path"])
            removed.append(row)
    return removed
