"""What the chip profiles decide without the hardware: the order `auto` tries chips in, the
mode of chips whose plugin owns PrivateUse1, and the device count of a one-device chip."""
import copy
import dataclasses
import io
import os
import sys
import types

import pytest
import torch
from conftest import assert_close, device_mode_only

import flagos
from flagos import _activation, chips
from flagos.chips import base, mps
from flagos.chips.adapter import AdapterChip
from flagos.chips.base import TorchChip
from flagos.errors import ConfigError
from flagos.runtime import _payload_rules, _sequences

VENDOR_PLUGINS = {"npu": ("torch_npu", "hccl"), "mlu": ("torch_mlu", "cncl"), "musa": ("torch_musa", "mccl")}


def test_auto_tries_vendor_plugins_then_found_adapters_then_pytorchs_devices(tmp_path, monkeypatch):
    (tmp_path / "libflagos_toy_adapter.so").write_bytes(b"")  # found by name; not loaded here
    monkeypatch.setenv("FLAGOS_ADAPTER_PATH", str(tmp_path))
    order = chips.auto_order()
    assert order[:3] == ("npu", "mlu", "musa")
    assert order[3] == "toy"
    assert order.index("cuda") > 3 and order[-1] == "cpu"
    assert "sim" not in order, "the emulated chip is never picked by auto"
    assert chips.known() == order + ("sim",)
    toy = chips.profile("toy")   # no profile module of its own: an adapter chip of that name
    assert isinstance(toy, AdapterChip) and toy.name == "toy"
    monkeypatch.setenv("FLAGOS_ADAPTER_PATH", os.pathsep.join([str(tmp_path), str(tmp_path)]))
    assert chips.auto_order().count("toy") == 1


@pytest.mark.parametrize("chip", sorted(VENDOR_PLUGINS))
def test_a_vendor_plugin_owns_privateuse1_so_its_chip_runs_in_native_mode(chip):
    profile = chips.profile(chip)
    plugin, backend = VENDOR_PLUGINS[chip]
    assert (profile.plugin, profile.collective_backend, profile.torch_type) == (plugin, backend, chip)
    assert _activation._pick_mode(profile, None) == "native"
    with pytest.raises(ConfigError, match=f"{plugin}.*owns PyTorch's PrivateUse1.*mode='native'"):
        _activation._pick_mode(profile, "device")
    row = next(r for r in _activation.list_devices(include_unavailable=True) if r.chip == chip)
    assert (row.mode, row.available, row.collective_backend) == ("native", False, backend)


def test_pytorchs_own_devices_run_in_device_mode():
    for chip in ("cuda", "xpu", "mps", "cpu"):
        assert _activation._pick_mode(chips.profile(chip), None) == "device", chip


def test_mps_has_one_device_when_present_and_none_otherwise(monkeypatch):
    monkeypatch.setattr(mps.CHIP, "detect", lambda: True)
    assert mps.CHIP.device_count() == 1
    monkeypatch.setattr(mps.CHIP, "detect", lambda: False)
    assert mps.CHIP.device_count() == 0


def test_detect_imports_the_vendor_plugin_and_says_why_a_chip_is_missing(tmp_path, monkeypatch):
    """A vendor plugin registers its device module with torch when imported (as torch_npu
    does), so detect() imports it first; why_unavailable() tells a missing plugin from a
    broken one, with the broken one's own error."""
    (tmp_path / "flagos_fake_plugin.py").write_text(
        "import sys, types\n"
        "mod = types.ModuleType('torch.flagosfake')\n"
        "mod.is_available = lambda: True\n"
        "mod.device_count = lambda: 2\n"
        "sys.modules['torch.flagosfake'] = mod\n")
    (tmp_path / "flagos_broken_plugin.py").write_text("raise RuntimeError('driver 9.1, needs 9.2')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def chip(plugin):
        return TorchChip(name="fake", torch_type="flagosfake", vendor="Fake", collective_backend="gloo",
                         plugin=plugin)
    try:
        assert chip("flagos_fake_plugin").detect() and chip("flagos_fake_plugin").device_count() == 2
    finally:
        for name in ("flagos_fake_plugin", "torch.flagosfake"):
            sys.modules.pop(name, None)
    broken = chip("flagos_broken_plugin")
    assert not broken.detect()
    assert broken.why_unavailable() == ("flagos_broken_plugin is installed but fails to import "
                                        "(RuntimeError: driver 9.1, needs 9.2)")
    assert chip("flagos_no_such_plugin").why_unavailable() == "flagos_no_such_plugin is not installed"
    assert not chip("flagos_no_such_plugin").detect()


def test_device_rows_are_values():
    """`flagos.list_devices()` rows can be kept in sets and dict keys, and nobody edits one
    behind the report's back."""
    row = _activation.list_devices(include_unavailable=True)[0]
    assert {row, dataclasses.replace(row)} == {row}
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.index = 7


class VendorModule:
    """A vendor's `torch.<type>` module as a torch-native chip profile reads it (the torch.cuda
    API that torch_npu, torch_mlu and torch_musa mirror), recording what it was asked."""

    def __init__(self, **answers):
        self.calls = []
        for name, answer in answers.items():
            setattr(self, name, self._recording(name, answer))

    def _recording(self, name, answer):
        def call(*args):
            self.calls.append((name, *args))
            if isinstance(answer, BaseException):
                raise answer
            return answer(*args) if callable(answer) else answer
        return call


def vendor_chip(monkeypatch, module) -> TorchChip:
    monkeypatch.setitem(sys.modules, "torch.flagosfake", module)
    return TorchChip(name="fake", torch_type="flagosfake", vendor="Fake", collective_backend="gloo")


def test_a_torch_native_profile_reads_the_vendor_module(monkeypatch):
    """Names, memory, compute capabilities, seeds and out-of-memory errors of a torch-native chip
    come from its vendor module, with the stated answer where the module lacks a function."""
    props = type("Props", (), {"total_memory": 80 << 30})
    mod = VendorModule(device_count=2, get_device_name=lambda i: f"Fake X{i}",
                       get_device_properties=lambda i: props, memory_allocated=lambda i: 10 + i,
                       max_memory_allocated=lambda i: 20 + i, memory_reserved=lambda i: 30 + i,
                       reset_peak_memory_stats=None, empty_cache=None, mem_get_info=(5.0, 9.0),
                       get_device_capability=lambda i: (8 + i, 0), manual_seed=None,
                       manual_seed_all=None, get_rng_state=lambda i: torch.tensor([i]),
                       set_rng_state=None, set_device=None, synchronize=None)
    chip = vendor_chip(monkeypatch, mod)
    assert chip.device_count() == 2 and chip.device_name(1) == "Fake X1"
    assert chip.total_memory(0) == 80 << 30
    assert (chip.memory_allocated(1), chip.max_memory_allocated(1), chip.memory_reserved(1)) == (11, 21, 31)
    assert chip.mem_get_info(0) == (5, 9) and all(type(x) is int for x in chip.mem_get_info(0))
    assert chip.architecture() == "sm80+sm90"
    chip.reset_peak_memory_stats(1)
    chip.empty_cache()
    chip.manual_seed(3)
    chip.manual_seed_all(4)
    chip.set_rng_state(torch.tensor([7]), 1)
    chip.set_device(1)
    chip.synchronize(0)
    assert chip.get_rng_state(1).tolist() == [1]
    asked = [c for c in mod.calls if c[0] not in ("device_count", "get_device_capability")]
    assert [c[:2] for c in asked[-8:]] == [
        ("reset_peak_memory_stats", 1), ("empty_cache",), ("manual_seed", 3), ("manual_seed_all", 4),
        ("set_rng_state", asked[-4][1]), ("set_device", 1), ("synchronize", 0), ("get_rng_state", 1)]
    assert asked[-4][2] == 1  # the state went to the device it names
    assert not chip.payload_is_host
    assert chip.is_out_of_memory(torch.OutOfMemoryError("x"))
    assert chip.is_out_of_memory(RuntimeError("FAKE: Out Of Memory on device 0"))
    assert not chip.is_out_of_memory(RuntimeError("device-side assert"))


def test_a_vendor_module_without_the_optional_functions(monkeypatch):
    """Without get_device_name the name is the device's; without get_device_properties the
    total memory comes from mem_get_info; missing memory counters read 0; without compute
    capabilities, or with ones that do not answer like torch.cuda's, the architecture is
    "unknown"; a capability that is not a pair is kept as its text."""
    mod = VendorModule(device_count=1, mem_get_info=(1, 64), get_device_properties=AttributeError("no"))
    chip = vendor_chip(monkeypatch, mod)
    assert chip.device_name(0) == "flagosfake:0"
    assert chip.total_memory(0) == 64
    assert (chip.memory_allocated(0), chip.max_memory_allocated(0), chip.memory_reserved(0)) == (0, 0, 0)
    chip.reset_peak_memory_stats(0)
    chip.empty_cache()  # nothing to call: no error
    assert chip.architecture() == "unknown"
    mod.get_device_capability = mod._recording("get_device_capability", RuntimeError("not like cuda"))
    assert chip.architecture() == "unknown"
    mod.get_device_capability = mod._recording("get_device_capability", "gfx90a")
    assert chip.architecture() == "gfx90a"
    mod.get_device_capability = mod._recording("get_device_capability", (9, 4, 2))
    assert chip.architecture() == "(9, 4, 2)"  # only a (major, minor) pair is an sm name
    mod.device_count = mod._recording("device_count", 0)
    assert chip.architecture() == "unknown"


def test_host_memory_reads_the_kernels_figures(monkeypatch):
    """(free, total) bytes of the host: /proc/meminfo's MemAvailable (MemFree on kernels without
    it) and MemTotal, in bytes; the page counts of sysconf where /proc cannot be read."""
    free, total = base.host_memory()
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # the same figure
    assert 0 < free <= total
    meminfo = "MemTotal:       16384 kB\nMemFree:         4096 kB\nBuffers:          512 kB\n"
    monkeypatch.setattr(base, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert base.host_memory() == (4096 * 1024, 16384 * 1024)
    meminfo = "MemTotal:       16384 kB\n"  # nothing said about free memory: none counted
    assert base.host_memory() == (0, 16384 * 1024)
    meminfo = "MemFree:         4096 kB\n"  # nor about the total
    assert base.host_memory() == (4096 * 1024, 0)

    def unreadable(path):
        raise PermissionError(path)
    monkeypatch.setattr(base, "open", unreadable, raising=False)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert base.host_memory() == (pages, pages)
    monkeypatch.setattr(base, "os", types.SimpleNamespace())  # no sysconf either: nothing known
    assert base.host_memory() == (0, 0)


def test_payload_rules_apply_to_chips_whose_payloads_are_not_host_tensors():
    assert _payload_rules.needed(chips.profile("cuda")) and _payload_rules.needed(chips.profile("npu"))
    assert not _payload_rules.needed(chips.profile("cpu"))
    assert not _payload_rules.needed(chips.profile("sim")), "adapter chips have kernels of their own"


@device_mode_only
def test_channels_last_group_norm_through_the_payload_rules_matches_cpu():
    """The cuda chip's group-norm kernels, run here on CPU payloads: a channels_last input (as a
    UNet's attention hands on) gives plain PyTorch's values and gradients."""
    for op, fn in _payload_rules.KERNELS.items():
        flagos.register_kernel(op, fn, chip="cpu")
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(4, 8)
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last).requires_grad_()
    grad = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    norm(x).backward(grad)
    routed_norm = copy.deepcopy(norm).to(flagos.device())
    routed_x = x.detach().to(flagos.device()).requires_grad_()
    assert routed_x.is_contiguous(memory_format=torch.channels_last)
    out = routed_norm(routed_x)
    out.backward(grad.to(flagos.device()))
    calls = flagos.fallback_report().op("aten::native_group_norm")["calls"]
    assert calls["override"] == 1 and calls["native"] == 0
    assert flagos.fallback_report().op("aten::native_group_norm_backward")["calls"]["override"] == 1
    assert_close(out, norm(x))
    assert_close(routed_x.grad, x.grad)
    assert_close(routed_norm.weight.grad, norm.weight.grad)
    assert_close(routed_norm.bias.grad, norm.bias.grad)


def test_payload_rules_hand_the_kernels_contiguous_payloads(monkeypatch):
    seen = []

    class Op:
        def __init__(self, op):
            self.op = op

        def default(self, *args):
            seen.append([a.is_contiguous() for a in args if isinstance(a, torch.Tensor)])
            return self.op.default(*args)

    monkeypatch.setattr(_payload_rules, "_aten", types.SimpleNamespace(
        native_group_norm=Op(torch.ops.aten.native_group_norm),
        native_group_norm_backward=Op(torch.ops.aten.native_group_norm_backward)))
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    weight, bias = torch.ones(8), torch.zeros(8)
    out, mean, rstd = _payload_rules.group_norm(x, weight, bias, 2, 8, 25, 4, 1e-5)
    grad = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    grads = _payload_rules.group_norm_backward(grad, x, mean, rstd, weight, 2, 8, 25, 4, [True, True, True])
    assert seen == [[True] * 3, [True] * 5]
    assert_close(out, torch.ops.aten.native_group_norm(x, weight, bias, 2, 8, 25, 4, 1e-5)[0])
    assert_close(grads[0], torch.ops.aten.native_group_norm_backward(
        grad, x, mean, rstd, weight, 2, 8, 25, 4, [True, True, True])[0])


@device_mode_only
def test_fused_cells_register_where_the_payload_device_has_none():
    """The host's and a C-ABI chip's fallback have no fused LSTM/GRU cell; CUDA has its own."""
    assert _sequences.needed(chips.profile("cpu")) and not _sequences.needed(chips.profile("cuda"))
    assert _sequences.needed(chips.profile("sim"))


def test_payload_rules_register_for_the_chips_that_need_them():
    overrides = flagos.core._routes._overrides
    _payload_rules.register(chips.profile("cpu"))  # host payloads: the zero-tensor rule only
    assert {op for op, chip in overrides if chip == "cpu"} >= set(_payload_rules.PAYLOAD_KERNELS)
    assert not any(chip == "cpu" and op in _payload_rules.KERNELS for op, chip in overrides)
    _payload_rules.register(chips.profile("cuda"))
    assert {op for op, chip in overrides if chip == "cuda"} == set(_payload_rules.KERNELS) | set(
        _payload_rules.PAYLOAD_KERNELS)
