"""PyTorch's `torch.backends` entry point: activates flagos at `import torch`.

Runs only when FLAGOS_DEVICE (or FLAGOS_DEVICE_BACKEND) is set; otherwise it
returns at once, so an installed flagos costs `import torch` a few
milliseconds and changes nothing.
"""
import os


def autoload() -> None:
    if not (os.environ.get("FLAGOS_DEVICE") or os.environ.get("FLAGOS_DEVICE_BACKEND")):
        return
    # Imported only here: activation imports all of flagos, which `import torch` pays for
    # only when FLAGOS_DEVICE asks for it.
    from . import _activation

    _activation.activate_from_env()
