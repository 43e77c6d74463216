"""Run one tool function with flagos active on a chosen chip, in a child process when needed.

PyTorch has one PrivateUse1 slot per process and flagos's device registration cannot be undone,
so a tool that measures several chips runs each one in its own fresh interpreter. The chip
`torch-cpu` is plain PyTorch on the CPU without flagos: the native reference.

A target is "module:function"; it is called as `function(chip=NAME, **kwargs)` and returns
something JSON can carry. The child reads its request from a JSON file and writes the result
(or the error) to another, so a model that prints cannot corrupt the answer.
"""
from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback

import torch

import flagos

from .. import chips
from ..chips import names
from ..core import _state

REFERENCE = "torch-cpu"
# The chip is the child's own (FLAGOS_DEVICE); one shared FLAGOS_REPORT path would be
# overwritten by every child in turn. Every other FLAGOS_* setting (routes, mode) applies.
_CHILD_DROPS = ("FLAGOS_DEVICE", "FLAGOS_DEVICE_BACKEND", "FLAGOS_REPORT")


class ChildError(RuntimeError):
    """A chip's run failed; the message names the chip and the original error."""

    def __init__(self, chip: str, message: str):
        super().__init__(f"chip {chip}: {message}")
        self.chip = chip


def _active():
    return _state.active_or_none()


def runs_here(chip: str) -> bool:
    """Whether `chip` can run in this process without changing it: plain torch while flagos is
    not intercepting CPU ops (native mode does), or the chip flagos is already active on."""
    state = _active()
    if chip == REFERENCE:
        return state is None or state.mode == "device"
    return state is not None and chip in (state.chip.name, "auto")


def device_for(chip: str) -> torch.device:
    """The device a run on `chip` puts its model on (inside the process running it)."""
    if chip == REFERENCE:
        return torch.device("cpu")
    return flagos.device()


def chip_name(chip: str) -> str:
    """The chip's real name ("auto" resolved), inside the process running it."""
    if chip == REFERENCE:
        return REFERENCE
    return _active().chip.name


# The chip's own functions rather than torch.flagos, which exists in device mode only.

def synchronize(chip: str) -> None:
    if chip != REFERENCE:
        state = _active()
        state.chip.synchronize(state.current)


def reset_peak_memory(chip: str) -> None:
    if chip != REFERENCE:
        state = _active()
        state.chip.reset_peak_memory_stats(state.current)


def peak_memory(chip: str) -> int | None:
    """Peak bytes allocated on the chip's current device; None for plain torch and for chips
    whose memory is the host's (cpu), which track none (rather than a misleading 0)."""
    state = _active() if chip != REFERENCE else None
    if state is None or state.chip.payload_is_host:
        return None
    return int(state.chip.max_memory_allocated(state.current))


def mode(chip: str) -> str | None:
    """"device" or "native" for a flagos chip, None for plain torch."""
    return None if chip == REFERENCE else _active().mode


def check_chip(chip: str) -> str:
    """`chip` normalized, or ValueError naming the choices (cheap: initializes no chip)."""
    name = chip.strip().lower()
    if name in (REFERENCE, "auto") or name in chips.known():
        return name
    if name in names.ALIASES:  # a vendor name: "ascend" is npu
        return names.ALIASES[name].chip
    raise ValueError(f"unknown chip {chip!r}; use {REFERENCE} (plain PyTorch on the CPU), auto, "
                     f"or one of: {', '.join(chips.known())}")


def _resolve(target: str):
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def call(chip: str, target: str, **kwargs):
    """`target(chip=chip, **kwargs)` with flagos active on `chip`: here when `runs_here(chip)`,
    else in a child process. Raises ChildError when the run fails."""
    if runs_here(chip):
        try:
            return _resolve(target)(chip=chip, **kwargs)
        except Exception as e:  # one chip's failure is reported, not fatal to the tool
            raise ChildError(chip, f"{type(e).__name__}: {e}") from e
    return _call_in_child(chip, target, kwargs)


def _child_env(chip: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CHILD_DROPS}
    if chip != REFERENCE:
        env["FLAGOS_DEVICE"] = chip
    env.setdefault("FLAGOS_FALLBACK", "allow")  # the tools report fallbacks themselves
    # the child imports this same flagos, wherever it was imported from
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def _fileno(stream):
    try:
        return stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _call_in_child(chip: str, target: str, kwargs: dict):
    with tempfile.TemporaryDirectory(prefix="flagos-child-") as tmp:
        request, result = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(request, "w") as f:
            json.dump({"chip": chip, "target": target, "kwargs": kwargs}, f)
        # The child's stderr (progress bars, warnings) and stdout (whatever a model prints) go
        # to our stderr, live when it is a real file; our stdout stays for the tool's output.
        err_fd = _fileno(sys.stderr)
        proc = subprocess.run(
            [sys.executable, "-m", "flagos.tools._childrun", request, result],
            env=_child_env(chip), stdin=subprocess.DEVNULL,
            stdout=err_fd if err_fd is not None else subprocess.PIPE,
            stderr=err_fd if err_fd is not None else subprocess.STDOUT, text=True)
        if err_fd is None and proc.stdout:
            sys.stderr.write(proc.stdout)
        if os.path.exists(result):
            with open(result) as f:
                answer = json.load(f)
            if "error" in answer:
                raise ChildError(chip, answer["error"])
            return answer["value"]
        raise ChildError(chip, f"the child process exited with code {proc.returncode} "
                               f"before answering (its messages are above)")


def _child_main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        request = json.load(f)
    chip = request["chip"]
    try:
        if chip != REFERENCE:
            flagos.activate(chip)
        answer = {"value": _resolve(request["target"])(chip=chip, **request["kwargs"])}
    except BaseException as e:  # the parent reports it; the traceback helps with model bugs
        traceback.print_exc(file=sys.stderr)
        answer = {"error": f"{type(e).__name__}: {e}"}
    with open(result_path, "w") as f:
        json.dump(answer, f)
    return 0 if "value" in answer else 1


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], sys.argv[2]))
