"""The names users type: vendor and product aliases of chips, names flagos cannot run, the cuda
chip's vendors (identified from what PyTorch reports), and the one message at autoload."""
import dataclasses
import types

import pytest
import torch
from conftest import CHIP, run_python

import flagos
from flagos import _activation, chips
from flagos.chips import names
from flagos.chips.cuda import CudaChip
from flagos.errors import ChipNotFoundError

# the vendor names the FlagOS articles use, with the chip each stands for
TYPED = {"ascend": "npu", "Ascend": "npu", "cambricon": "mlu", "mthreads": "musa", "moore": "musa",
         "hygon": "cuda", "dcu": "cuda", "iluvatar": "cuda", "corex": "cuda", "metax": "cuda",
         "intel": "xpu", "amd": "cuda", "rocm": "cuda", "nvidia": "cuda", "apple": "mps",
         "host": "cpu", " CPU ": "cpu", "SIM": "sim", "auto": "auto"}


@pytest.mark.parametrize("typed, chip", sorted(TYPED.items()))
def test_aliases_resolve_to_known_chips(typed, chip):
    alias = names.resolve(typed, chips.known())
    assert alias.chip == chip
    assert chip == "auto" or chip in chips.known()


def test_every_alias_names_a_chip_and_cuda_vendors_have_facts():
    for typed, alias in names.ALIASES.items():
        assert alias.chip in chips.known(), typed
        assert alias.vendor is None or alias.vendor in names.CUDA_VENDORS, typed
    assert names.resolve("hygon", chips.known()) == names.Alias("cuda", "hygon")
    for vendor, facts in names.CUDA_VENDORS.items():
        assert facts.vendor == vendor and facts.collective_backend and facts.oom_patterns
        assert set(facts.unverified) <= {"native_dtypes", "collective_backend", "oom_patterns"}
    # what public sources did not confirm is said, vendor by vendor
    assert {v for v, f in names.CUDA_VENDORS.items() if f.unverified} == {"hygon", "iluvatar", "metax"}


@pytest.mark.parametrize("typed, why, instead", [
    ("rknn", "no PyTorch device", "rknn-toolkit2"),
    ("Rockchip", "no PyTorch device", "'cpu'"),
    ("kunlunxin", "XMLIR", "C-ABI adapter"),
    ("enflame", "torch_gcu", "transfer_to_gcu"),
    ("gcu", "torch_gcu", "C-ABI adapter"),
])
def test_names_flagos_cannot_run_say_why_and_what_instead(typed, why, instead):
    with pytest.raises(ChipNotFoundError, match="cannot run under flagos") as e:
        flagos.activate(typed)
    assert why in str(e.value) and instead in str(e.value)


def test_unknown_name_lists_chips_and_vendor_names():
    with pytest.raises(ChipNotFoundError) as e:
        flagos.activate("tpu")
    text = str(e.value)
    assert "unknown chip 'tpu'" in text
    for name in chips.known():
        assert name in text
    for alias, target in (("ascend", "npu"), ("cambricon", "mlu"), ("hygon", "cuda"), ("metax", "cuda")):
        assert f"{alias}={target}" in text


def test_unavailable_vendor_names_say_what_to_install():
    with pytest.raises(ChipNotFoundError) as e:
        flagos.activate("ascend")
    text = str(e.value)
    assert "'ascend' (chip npu) is not available" in text
    assert "torch_npu is not installed" in text and "pip install torch-npu" in text
    assert "flagos diagnose" in text and "cpu" in text
    with pytest.raises(ChipNotFoundError, match=r"'hygon' \(chip cuda \(hygon\)\).*Hygon DTK"):
        flagos.activate("hygon")


@pytest.mark.parametrize("device_name, hip, build, vendor", [
    ("NVIDIA A100-SXM4-80GB", None, "2.5.1+cu124", "nvidia"),
    ("NVIDIA GeForce RTX 4090", None, "2.13.0", "nvidia"),
    ("AMD Instinct MI300X", "6.2.41133-dd7f95766", "2.5.1+rocm6.2", "amd"),
    ("AMD Radeon RX 7900 XTX", "6.1.40091", "2.4.0+rocm6.1", "amd"),
    ("DCU K100_AI", "5.7.24164", "2.1.0", "hygon"),
    ("K100_AI", "5.7.24164", "2.1.0+git.abi0.dtk2404", "hygon"),
    ("Hygon Z100L", "5.2.0", "1.13.1", "hygon"),
    ("MetaX C500", None, "2.6.0+metax3.2.1.3", "metax"),
    ("C500", None, "2.6.0+metax3.2.1.3", "metax"),
    ("Iluvatar BI-V150", None, "2.1.1", "iluvatar"),
    ("BI-V100", None, "2.1.1+corex.4.1.2", "iluvatar"),
])
def test_cuda_vendor_from_what_pytorch_reports(device_name, hip, build, vendor):
    assert names.cuda_vendor(device_name, hip, build) == vendor


def test_cuda_chip_carries_its_vendors_facts():
    chip = CudaChip()
    assert chip.vendor == "nvidia"  # no GPU here: NVIDIA's facts until a device answers
    chip._facts = names.CUDA_VENDORS["hygon"]
    assert (chip.vendor, chip.collective_backend) == ("hygon", "nccl")
    assert chip.is_out_of_memory(RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"))
    assert not chip.is_out_of_memory(RuntimeError("HIP error: invalid device function"))


class _FoundCuda(CudaChip):
    """A cuda chip that answers as if an NVIDIA device were here (flagos's interface only)."""

    def __init__(self):
        super().__init__()
        self._facts = names.CUDA_VENDORS["nvidia"]

    def detect(self):
        return True

    def device_name(self, index):
        return ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")[index]  # the first device named


def test_a_vendor_name_must_match_the_vendor_found(monkeypatch):
    found = _FoundCuda()
    monkeypatch.setitem(chips._profiles, "cuda", found)
    assert _activation._pick_chip("nvidia") is found
    assert _activation._pick_chip("cuda") is found
    with pytest.raises(ChipNotFoundError) as e:
        _activation._pick_chip("hygon")
    assert "the cuda devices here are NVIDIA (NVIDIA A100-SXM4-80GB)" in str(e.value)
    assert "'cuda' (or 'nvidia')" in str(e.value)


def test_list_devices_shows_the_vendor():
    rows = {d.chip: d for d in flagos.list_devices(include_unavailable=True)}
    assert rows["cuda"].vendor == "nvidia" and rows["npu"].vendor == "huawei"
    assert rows["sim"].vendor == "flagos (emulated accelerator)"


# ---- at `import torch` (autoload) --------------------------------------------------------

def test_alias_at_autoload_activates_its_chip():
    proc = run_python("""
        import torch, flagos
        print(flagos.info()["chip"])
    """, env={"FLAGOS_DEVICE": "host" if CHIP == "cpu" else CHIP.upper()})
    assert proc.stdout.split() == [CHIP]


@pytest.mark.parametrize("variable", ["FLAGOS_DEVICE", "FLAGOS_DEVICE_BACKEND"])
def test_unavailable_vendor_at_autoload_is_one_clear_message(variable):
    proc = run_python("import torch\nprint('ran on')", env={variable: "ascend"}, check=False)
    assert proc.returncode == 1 and "ran on" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no loader traceback around it
    assert lines[0].startswith(f"flagos: {variable}=ascend at `import torch`: 'ascend' (chip npu)")
    for part in ("torch_npu is not installed", "pip install torch-npu", "flagos diagnose"):
        assert part in lines[0]


@pytest.mark.parametrize("typed, expected", [
    ("tpu", "unknown chip 'tpu'; known chips: npu"),
    ("rknn", "cannot run under flagos: Rockchip NPUs have no PyTorch device"),
])
def test_unknown_and_unsupported_names_at_autoload(typed, expected):
    proc = run_python("import torch", env={"FLAGOS_DEVICE": typed}, check=False)
    assert proc.returncode == 1
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert "Failed to load the backend extension" not in proc.stderr


def test_adapter_library_that_does_not_load_at_autoload_is_one_message(tmp_path):
    (tmp_path / "libflagos_bogus_adapter.so").write_bytes(b"not a shared library")
    proc = run_python("import torch", check=False,
                      env={"FLAGOS_DEVICE": "bogus", "FLAGOS_ADAPTER_PATH": str(tmp_path)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("flagos: FLAGOS_DEVICE=bogus at `import torch`: ")
    assert "libflagos_bogus_adapter.so" in proc.stderr


def test_an_empty_name_means_auto():
    assert names.resolve("", chips.known()) == names.Alias("auto")
    assert names.resolve("  ", chips.known()) == names.Alias("auto")
    assert _activation._pick_chip(" ") is _activation._pick_chip("auto")


def test_auto_takes_the_first_chip_in_its_order_that_is_here(monkeypatch):
    cuda, npu, cpu = chips.profile("cuda"), chips.profile("npu"), chips.profile("cpu")
    monkeypatch.setattr(chips, "auto_order", lambda: ("npu", "cuda", "cpu"))
    here = {"npu": False, "cuda": False, "cpu": True}
    for profile in (cuda, npu, cpu):
        monkeypatch.setattr(profile, "picked_by_auto", lambda p=profile: here[p.name])
    assert _activation._pick_chip("auto") is cpu
    here["cuda"] = True
    assert _activation._pick_chip("auto") is cuda
    here["npu"] = True
    assert _activation._pick_chip("auto") is npu


def test_the_name_tables_cannot_be_changed_through_a_lookup():
    # resolve() hands out the table's own entries: a caller must not be able to rewrite them
    alias = names.resolve("hygon", chips.known())
    with pytest.raises(dataclasses.FrozenInstanceError):
        alias.vendor = "amd"
    with pytest.raises(dataclasses.FrozenInstanceError):
        names.CUDA_VENDORS["hygon"].collective_backend = "gloo"
    assert names.ALIASES["hygon"] == names.Alias("cuda", "hygon")


# ---- the cuda chip reading what PyTorch reports (PyTorch's answers stubbed: no GPU here) ----

def _answering(monkeypatch, names_by_index, hip=None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names_by_index[i])
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)


def test_the_cuda_chip_takes_the_facts_of_the_vendor_found(monkeypatch):
    _answering(monkeypatch, ["AMD Instinct MI300X"], hip="6.2.41133")
    chip = CudaChip()
    assert (chip.vendor, chip.collective_backend) == ("amd", "nccl")
    assert chip.native_dtypes == names.CUDA_VENDORS["amd"].native_dtypes
    assert chip.oom_patterns == ("hip out of memory", "out of memory")
    # read once: the vendor does not change under a running program
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA A100")
    assert chip.vendor == "amd"


def test_the_cuda_chip_without_an_answering_device_has_nvidias_facts_until_one_answers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "MetaX C500")
    chip = CudaChip()
    assert chip.vendor == "nvidia"
    def broken(i):
        raise RuntimeError("CUDA driver initialization failed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    assert chip.vendor == "nvidia"  # a broken runtime is detect()'s to report, not facts()'s
    _answering(monkeypatch, ["MetaX C500", "NVIDIA A100"])  # device 0 names the vendor
    assert chip.vendor == "metax"


def test_the_cuda_architecture_waits_for_the_runtime_and_names_every_device(monkeypatch):
    chip = CudaChip()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert chip.architecture() is None  # reading it would initialize the runtime
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(9, 0), (8, 0), (9, 0)][i])
    assert chip.architecture() == "sm80+sm90"
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    props = [types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"), types.SimpleNamespace(gcnArchName="")]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert chip.architecture_now() == "gfx942:sramecc+:xnack-+unknown"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert chip.architecture_now() == "unknown"
