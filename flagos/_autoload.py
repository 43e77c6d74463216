"""PyTorch's `torch.backends` entry point: activates flagos at `import torch`.

Runs only when FLAGOS_DEVICE (or FLAGOS_DEVICE_BACKEND) is set; otherwise it
returns at once, so an installed flagos costs `import torch` a few
milliseconds and changes nothing.
"""
import os


def autoload() -> None:
    if not (os.environ.get("FLAGOS_DEVICE") or os.environ.get("FLAGOS_DEVICE_BACKEND")):
        return
    from . import _runtime

    _runtime.activate_from_env()
