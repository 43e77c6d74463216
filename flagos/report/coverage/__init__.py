"""What would fall back on a chip that is not here: each op classified against a chip's coverage.

    cov = flagos.report.coverage.for_chip("sim")        # or "cuda", "mps", "cpu"
    cov.classify("aten::cumsum", ["torch.float32"])   # -> ("fallback", "sim has no kernel ...")

Adapter chips (sim, vendor adapters): the kernel table read from the adapter library, applied
the way flagos's adapter runner applies it (allocation, copies and views are the runtime's own;
an op runs on the chip when the runner has a calling convention for it and the library lists
the kernel for the dtype). Torch-native chips: a coverage file shipped in this folder, one per
chip, listing the aten ops that have a kernel for the chip's dispatch key (README.md says where
each file comes from).
"""
from __future__ import annotations

import json
import os

import torch

from ... import _C
from ...chips import adapter as adapter_mod
from ...chips import known, profile
from ...chips.adapter import DTYPE_NAMES, AdapterChip
from ...core import _env, _schema
from ...runtime import _adapter_ops

ROUTES = ("native", "fallback", "unknown")
HERE = os.path.dirname(os.path.abspath(__file__))


class Coverage:
    """One chip's coverage: `classify(op, dtypes)` -> (route, reason), route in ROUTES."""

    chip: str
    kind: str     # "adapter" or "coverage file"
    source: str   # the library or file the answers come from

    def classify(self, op: str, dtypes=()) -> tuple[str, str]:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"chip": self.chip, "kind": self.kind, "source": self.source}


class FileCoverage(Coverage):
    """A torch-native chip: ops with and without a kernel for its dispatch key."""

    kind = "coverage file"

    def __init__(self, chip: str, path: str):
        with open(path) as f:
            data = json.load(f)
        self.chip = chip
        self.source = path
        self.key = data["dispatch_key"]
        self.torch = data.get("torch", "?")
        self.kernel = frozenset(data["kernel"])
        self.no_kernel = frozenset(data["no_kernel"])

    def classify(self, op: str, dtypes=()) -> tuple[str, str]:
        if op in self.kernel:
            return "native", f"{self.key} kernel in PyTorch {self.torch}'s dispatch table"
        if op in self.no_kernel:
            return "fallback", f"no {self.key} kernel in PyTorch {self.torch}'s dispatch table"
        return "unknown", f"not an op of PyTorch {self.torch}'s native_functions.yaml"

    def describe(self) -> dict:
        return {**super().describe(), "dispatch_key": self.key, "torch": self.torch}


class AdapterCoverage(Coverage):
    """A C-ABI chip: the adapter library's kernel table, as the adapter runner uses it."""

    kind = "adapter"

    def __init__(self, chip: str):
        lib = profile(chip).adapter  # AdapterError (no library, bad ABI) says which and why
        self.chip = chip
        self.source = adapter_mod.find_library(chip)
        self.kernels = dict(lib.kernels())  # kernel name -> dtype bit mask
        self.chip_dtypes = lib.props(0)["native_dtypes"]
        self._runtime_ops = frozenset(_adapter_ops.SPECIAL)
        self._builders = _adapter_ops.KERNEL_BUILDERS
        self._torch, self._schema = torch, _schema

    def _flags(self, op: str) -> int:
        ns, _, rest = op.partition("::")
        packet, _, overload = rest.partition(".")
        try:
            func = getattr(getattr(getattr(self._torch.ops, ns), packet), overload or "default")
        except (AttributeError, RuntimeError):
            return 0
        return self._schema.describe(func)[4]

    def _dtype_names(self, mask: int) -> list[str]:
        return [n for i, n in enumerate(DTYPE_NAMES) if mask >> i & 1]

    def classify(self, op: str, dtypes=()) -> tuple[str, str]:
        if op in self._runtime_ops:
            return "native", "allocation or copy, done by the flagos runtime"
        flags = self._flags(op)
        if flags & _C.OP_DECOMPOSES:  # reaches the chip whole only under inference mode
            return "native", "a decomposition: its parts run on the chip, each classified on its own"
        if flags & _C.OP_VIEW:
            return "native", "view: metadata over the same buffer"
        library = os.path.basename(self.source)
        if op not in self._builders:
            if op in self.kernels:
                return "fallback", f"{library} lists a kernel, but flagos's adapter runner does not call it"
            return "fallback", f"no {op} kernel in {library}"
        # binary ops with a host scalar run as the .Scalar kernel
        names = [op] + ([op.replace(".Tensor", ".Scalar")] if op.endswith(".Tensor") else [])
        mask = next((self.kernels[n] for n in names if n in self.kernels), None)
        if mask is None:
            return "fallback", f"no {op} kernel in {library}"
        mask &= self.chip_dtypes
        allowed = self._dtype_names(mask)
        # an op's index inputs (embedding's int64 indices) are outside the kernel's dtype mask
        exempt = {str(d).replace("torch.", "") for d in _adapter_ops.INDEX_INPUTS.get(op, {}).values()}
        seen = [str(d).replace("torch.", "") for d in dtypes]
        refused = [d for d in seen if d not in allowed and d not in exempt]
        if refused:
            return "fallback", f"the {self.chip} kernel takes {', '.join(allowed)}, not {', '.join(refused)}"
        return "native", f"{self.chip} kernel for {', '.join(allowed)}"


def shipped_files() -> dict[str, str]:
    """chip -> path of its coverage file: in the folders of FLAGOS_COVERAGE_PATH (the first
    that has one), else the one shipped in this folder."""
    found = {}
    for folder in [HERE] + [d for d in _env.get("FLAGOS_COVERAGE_PATH").split(os.pathsep) if d][::-1]:
        if os.path.isdir(folder):
            found.update({name[:-5]: os.path.join(folder, name) for name in sorted(os.listdir(folder))
                          if name.endswith(".json")})
    return found


def for_chip(chip: str) -> Coverage:
    """The coverage of a chip by name; ValueError names the chips that have one."""
    name = chip.strip().lower()
    if name in known() and isinstance(profile(name), AdapterChip):
        return AdapterCoverage(name)
    files = shipped_files()
    if name in files:
        return FileCoverage(name, files[name])
    adapters = [n for n in known() if isinstance(profile(n), AdapterChip)]
    raise ValueError(
        f"no coverage known for chip {chip!r}: coverage files ship for {', '.join(files)}, and "
        f"adapter chips ({', '.join(adapters)}) are read from their library (for another adapter, "
        f"put its libflagos_<chip>_adapter.so on FLAGOS_ADAPTER_PATH)")
