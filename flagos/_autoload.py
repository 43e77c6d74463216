"""PyTorch's `torch.backends` entry point: activates flagos at `import torch`.

Runs only when FLAGOS_DEVICE (or FLAGOS_DEVICE_BACKEND) is set; otherwise it
returns at once, so an installed flagos costs `import torch` a few
milliseconds and changes nothing.

A chip that cannot be had (an unknown name, a vendor plugin not installed, an adapter
library that does not load, a bad FLAGOS_MODE) stops the process at `import torch` with exit status 1 and one message
naming the chip, why, and what to do. PyTorch's loader wraps every Exception an entry
point raises in "Failed to load the backend extension" with the error underneath;
SystemExit is not an Exception, so it passes through the loader as the one message.
Running on another device than the one asked for would be worse than stopping.
"""
import os

from .errors import AdapterError, ConfigError


def autoload() -> None:
    variable = next((v for v in ("FLAGOS_DEVICE", "FLAGOS_DEVICE_BACKEND") if os.environ.get(v)), None)
    if variable is None:
        return
    # Imported only here: activation imports all of flagos, which `import torch` pays for
    # only when FLAGOS_DEVICE asks for it.
    from . import _activation

    try:
        _activation.activate_from_env()
    except (ConfigError, AdapterError) as e:
        raise SystemExit(f"flagos: {variable}={os.environ[variable]} at `import torch`: {e}") from None
