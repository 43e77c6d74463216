"""What the chip profiles decide without the hardware: the order `auto` tries chips in, the
mode of chips whose plugin owns PrivateUse1, and the device count of a one-device chip."""
import dataclasses
import os
import sys

import pytest

from flagos import _activation, chips
from flagos.chips import mps
from flagos.chips.adapter import AdapterChip
from flagos.chips.base import TorchChip
from flagos.errors import ConfigError

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
