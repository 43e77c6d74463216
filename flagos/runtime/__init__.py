"""The device runtime: the flagos tensor, its registration with PyTorch (device guard, hooks,
generators, streams, pinned memory, autocast), the adapter ops of C-ABI chips and native mode."""
