"""The names users type for chips: chip names, vendor and product aliases, and names flagos
cannot run. The one table `activate()`, FLAGOS_DEVICE and FLAGOS_DEVICE_BACKEND read.

Vendors whose PyTorch build answers through the `torch.cuda` API (AMD ROCm, Hygon DCU through
DTK, Iluvatar CoreX, MetaX MACA) are aliases of the cuda chip that also name the vendor: the
cuda chip identifies its vendor with `cuda_vendor()` (pure: it reads strings only) and takes
that vendor's facts from CUDA_VENDORS. Facts not confirmed from public sources are listed in
the vendor's `unverified`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ChipNotFoundError

_ALL = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
        "uint8", "bool")


@dataclass(frozen=True)
class Alias:
    """A name that stands for a chip, and for one vendor of it where the chip is shared."""
    chip: str
    vendor: str | None = None


# name typed -> chip (and vendor, for vendors reached through the torch.cuda API)
ALIASES: dict[str, Alias] = {
    "host": Alias("cpu"),
    "ascend": Alias("npu"), "huawei": Alias("npu"),
    "cambricon": Alias("mlu"),
    "mthreads": Alias("musa"), "moore": Alias("musa"), "moorethreads": Alias("musa"),
    "intel": Alias("xpu"),
    "apple": Alias("mps"),
    "nvidia": Alias("cuda", "nvidia"),
    "amd": Alias("cuda", "amd"), "rocm": Alias("cuda", "amd"),
    "hygon": Alias("cuda", "hygon"), "dcu": Alias("cuda", "hygon"),
    "iluvatar": Alias("cuda", "iluvatar"), "corex": Alias("cuda", "iluvatar"),
    "metax": Alias("cuda", "metax"), "maca": Alias("cuda", "metax"),
}

# names with no PyTorch device flagos can drive: why, and what to do instead
UNSUPPORTED: dict[str, str] = {
    "kunlunxin": (
        "Kunlunxin XPUs reach PyTorch through Kunlunxin's XMLIR packages (collectives: BKCL), "
        "whose device type and API flagos does not model (unverified from public sources); its "
        "'xpu' name is Intel's in PyTorch. Run the script with Kunlunxin's own PyTorch stack, "
        "or write a C-ABI adapter (docs/adapters.md)"),
    "enflame": (
        "Enflame GCUs reach PyTorch through torch_gcu (device 'gcu', collectives ECCL), which "
        "flagos does not model yet (whether torch_gcu owns PyTorch's PrivateUse1 slot is "
        "unverified). Run the script with torch_gcu directly (its transfer_to_gcu maps CUDA "
        "calls), or write a C-ABI adapter (docs/adapters.md)"),
    "rknn": (
        "Rockchip NPUs have no PyTorch device: models are converted offline with Rockchip's "
        "rknn-toolkit2 and run by its runtime. Run PyTorch code on 'cpu' (or 'auto') and "
        "export the model for RKNN separately"),
}
UNSUPPORTED["kunlun"] = UNSUPPORTED["kunlunxin"]
UNSUPPORTED["gcu"] = UNSUPPORTED["enflame"]
UNSUPPORTED["rockchip"] = UNSUPPORTED["rknn"]


@dataclass(frozen=True)
class VendorFacts:
    """What differs between vendors sharing the cuda chip."""
    vendor: str
    label: str
    native_dtypes: tuple[str, ...]
    collective_backend: str
    oom_patterns: tuple[str, ...]
    unverified: tuple[str, ...] = ()   # facts here that no public source confirmed


CUDA_VENDORS: dict[str, VendorFacts] = {
    "nvidia": VendorFacts("nvidia", "NVIDIA", _ALL, "nccl", ("cuda out of memory", "out of memory")),
    # PyTorch's HIP build reuses torch.cuda and the "nccl" backend name (RCCL behind it)
    "amd": VendorFacts("amd", "AMD (ROCm)", _ALL, "nccl", ("hip out of memory", "out of memory")),
    "hygon": VendorFacts("hygon", "Hygon DCU (DTK/ROCm)", _ALL, "nccl",
                         ("hip out of memory", "out of memory"),
                         unverified=("native_dtypes", "collective_backend", "oom_patterns")),
    "iluvatar": VendorFacts("iluvatar", "Iluvatar CoreX", _ALL, "nccl",
                            ("cuda out of memory", "out of memory"),
                            unverified=("native_dtypes", "collective_backend", "oom_patterns")),
    "metax": VendorFacts("metax", "MetaX (MACA)", _ALL, "nccl",
                         ("cuda out of memory", "out of memory"),
                         unverified=("native_dtypes", "collective_backend", "oom_patterns")),
}


def cuda_vendor(device_name: str = "", hip_version: str | None = None,
                torch_version: str = "") -> str:
    """The vendor behind `torch.cuda`, from what PyTorch reports: the device name
    (torch.cuda.get_device_name), torch.version.hip, and torch.__version__ (vendor builds
    tag it: '2.6.0+metax3.2.1.3')."""
    name, build = device_name.lower(), torch_version.lower()
    if "metax" in name or "metax" in build:
        return "metax"
    if "iluvatar" in name or "corex" in build:
        return "iluvatar"
    if hip_version:
        if "dcu" in name or "hygon" in name or "dtk" in build:
            return "hygon"
        return "amd"
    return "nvidia"


def resolve(name: str, known: tuple[str, ...]) -> Alias:
    """The chip (and vendor) a typed name stands for; ChipNotFoundError for a name flagos
    cannot run (saying why and what to use) or does not know (listing the names it knows).
    `known` is the chip names of this process (adapters found on FLAGOS_ADAPTER_PATH included)."""
    key = name.strip().lower()
    if key in known or key in ("", "auto"):
        return Alias(key or "auto")
    if key in ALIASES:
        return ALIASES[key]
    if key in UNSUPPORTED:
        raise ChipNotFoundError(f"chip {name!r} cannot run under flagos: {UNSUPPORTED[key]}.")
    raise ChipNotFoundError(
        f"unknown chip {name!r}; known chips: {', '.join(known)}, or 'auto'; vendor names: "
        f"{', '.join(f'{a}={t.chip}' for a, t in ALIASES.items())}")


def describe(alias: Alias) -> str:
    """'npu', or 'cuda (hygon)' for a vendor of a shared chip."""
    return f"{alias.chip} ({alias.vendor})" if alias.vendor else alias.chip
