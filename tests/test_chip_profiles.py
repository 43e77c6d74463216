"""What the chip profiles decide without the hardware: the order `auto` tries chips in, the
mode of chips whose plugin owns PrivateUse1, and the device count of a one-device chip."""
import os

import pytest

from flagos import _activation, chips
from flagos.chips import mps
from flagos.chips.adapter import AdapterChip
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
