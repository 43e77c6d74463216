"""Which line of the program a warning names.

A warning flagos gives while it activates (an unwritable FLAGOS_REPORT, an unusable cache
folder) is about the program's line that activated it: `flagos.activate(...)`, `import torch`
under autoload, or the first CUDA call on the cuda chip whose cache folder is chosen when the
runtime initializes. A fixed `stacklevel` names one of flagos's own lines instead, as the depth
of the call differs between these paths.
"""
from __future__ import annotations

import os
import sys

import torch

# Frames that are not the program's: flagos's and torch's own, and importlib's.
_NOT_THE_PROGRAM = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, "<frozen ")


def _counted(filename: str) -> bool:
    """warnings.warn steps over importlib's bootstrap frames without counting them."""
    return not ("importlib" in filename and "_bootstrap" in filename)


def program_stacklevel() -> int:
    """warnings.warn's stacklevel, for the function that calls this and then warns, of the first
    frame outside flagos, torch and importlib."""
    level, frame = 1, sys._getframe(1)  # level 1: the caller of warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_THE_PROGRAM):
        frame = frame.f_back
        if frame is not None and _counted(frame.f_code.co_filename):
            level += 1
    return level
