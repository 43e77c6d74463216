"""`torch.flagos`, the device module: device indices in every form, the device context, what
PyTorch's seeding asks of it, and the cpu chip's facts as it reports them."""
import os
import platform
import sys
import types

import pytest
import torch
from conftest import CHIP, run_python, runs_once

import flagos
from flagos.runtime import _device_module


def test_every_form_of_a_device_names_its_index():
    current = torch.flagos.current_device()
    index = _device_module._index
    assert index(None) == index("flagos") == index(torch.device("flagos")) == current
    assert index(0) == index("flagos:0") == index(torch.device("flagos", 0)) == 0


@runs_once
def test_forms_without_an_index_follow_the_current_device():
    proc = run_python("""
        import torch, flagos
        flagos.activate("sim")
        from flagos.runtime._device_module import _index
        torch.flagos.set_device(1)
        print(_index(None), _index("flagos"), _index(0), _index("flagos:0"), _index(1))
        with torch.flagos.device("flagos:0"):
            print(torch.flagos.current_device(), torch.empty(8, device="flagos").device)
        print(torch.flagos.current_device())
    """, env={"FLAGOS_SIM_DEVICES": "2"})
    assert proc.stdout.split("\n")[:3] == ["1 1 0 0 1", "0 flagos:0", "1"]


def test_before_activation_there_is_no_device():
    proc = run_python("""
        from flagos.runtime import _device_module
        print(_device_module.is_available(), _device_module.device_count())
    """)
    assert proc.stdout.split() == ["False", "0"]


def test_an_error_inside_the_device_context_propagates():
    before = torch.flagos.current_device()
    with pytest.raises(ValueError, match="inside"):
        with torch.flagos.device(before):
            raise ValueError("inside")
    assert torch.flagos.current_device() == before


def test_torch_manual_seed_seeds_the_device(dev):
    torch.manual_seed(3)
    first = torch.randn(16, device=dev).cpu()
    torch.randn(16, device=dev)
    torch.manual_seed(3)
    assert torch.equal(torch.randn(16, device=dev).cpu(), first)
    assert not torch.flagos._is_in_bad_fork()   # what torch.manual_seed asks before seeding


def test_the_device_modules_seeding_functions_answer_as_cudas(dev):
    """initial_seed, seed, seed_all, get/set_rng_state_all: what torch.cuda has and libraries
    call (through the CUDA redirect too)."""
    torch.flagos.manual_seed(11)
    assert torch.flagos.initial_seed() == 11
    states = torch.flagos.get_rng_state_all()
    assert len(states) == torch.flagos.device_count()
    assert torch.equal(states[dev.index or 0], torch.flagos.get_rng_state(dev))
    first = torch.randn(8, device=dev).cpu()
    torch.flagos.set_rng_state_all(states)
    assert torch.equal(torch.randn(8, device=dev).cpu(), first)
    for reseed in (torch.flagos.seed, torch.flagos.seed_all):
        torch.flagos.manual_seed(11)
        reseed()
        assert torch.flagos.initial_seed() != 11   # a fresh random seed (1 in 2**64 to fail)
        again = torch.flagos.initial_seed()
        torch.flagos.manual_seed(again)
        drawn = torch.randn(4, device=dev).cpu()
        torch.flagos.manual_seed(again)
        assert torch.equal(torch.randn(4, device=dev).cpu(), drawn)


def test_the_mps_chip_seeds_its_one_generator(monkeypatch):
    """torch.mps has no manual_seed_all, seed_all or initial_seed, and PyTorch's torch.manual_seed
    calls the device module's manual_seed_all: the mps chip answers them from its one generator
    (torch.mps stubbed: no Apple GPU here)."""
    generator = torch.Generator()
    stub = types.SimpleNamespace(manual_seed=generator.manual_seed, seed=generator.seed,
                                 _get_default_mps_generator=lambda: generator)
    monkeypatch.setitem(sys.modules, "torch.mps", stub)
    mps = flagos.chips.profile("mps")
    mps.manual_seed_all(21)
    assert mps.initial_seed() == generator.initial_seed() == 21
    mps.seed_all()
    assert mps.initial_seed() == generator.initial_seed() != 21


@pytest.mark.skipif(CHIP != "cpu", reason="the cpu chip's own facts")
def test_the_cpu_chip_reports_the_host():
    assert torch.flagos.device_count() == 1 and torch.flagos.current_device() == 0
    row = next(d for d in flagos.list_devices() if d.chip == "cpu")
    assert row.vendor == (platform.processor() or "host")
    assert row.name == (platform.processor() or platform.machine() or "cpu")
    assert row.total_memory == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free, total = torch.flagos.mem_get_info()
    assert total == row.total_memory and 0 < free <= total
    assert torch.flagos.memory_allocated() == torch.flagos.max_memory_allocated() == 0
    with pytest.raises(ValueError, match="flagos:1 does not exist: chip 'cpu' has 1 device"):
        torch.flagos.set_device(1)
    assert torch.flagos.current_device() == 0
    isa = torch.backends.cpu.get_cpu_capability().lower()
    assert flagos.chips.profile("cpu").architecture() == f"{platform.machine()}-{isa}"


def test_the_cpu_chip_checks_an_index_itself_and_names_an_unknown_isa(monkeypatch):
    # flagos's state refuses flagos:1 before the chip is asked; the chip refuses it on its own too
    cpu = flagos.chips.profile("cpu")
    cpu.set_device(0)
    for index in (1, -1):
        with pytest.raises(ValueError, match=f"the cpu chip has one device; flagos:{index} does not exist"):
            cpu.set_device(index)

    def missing():
        raise AttributeError("module 'torch.backends.cpu' has no attribute 'get_cpu_capability'")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", missing)  # an older PyTorch
    assert cpu.architecture() == f"{platform.machine() or 'unknown'}-unknown"


@runs_once
def test_set_device_makes_the_payload_devices_index_current_where_payloads_live_on_one():
    """On a torch-native chip with device payloads (cuda, npu, ...) `torch.flagos.set_device(i)`
    also makes the payload device i current, so its kernels launch there; a chip whose payloads
    are host tensors (cpu) has no such device to switch. Checked with the chip's `set_device`
    recorded (no GPU here): the profiles' own calls are tested in test_chip_names.py."""
    from flagos.core import _state
    state = _state.active()
    calls = []

    class Recorded:
        def __init__(self, payload_is_host):
            self.payload_is_host = payload_is_host
            self.name = state.chip.name

        def set_device(self, index):
            calls.append((self.payload_is_host, index))

    chip, current = state.chip, state.current
    try:
        for on_host in (False, True):
            state.chip = Recorded(on_host)
            _state.set_current(0)
    finally:
        state.chip = chip
        _state.set_current(current)
    assert calls == [(False, 0)]


def test_the_device_module_describes_the_device_as_torch_cuda_does(dev):
    """Device-agnostic code reads `torch.get_device_module(device)` as it reads torch.cuda:
    the name, the properties (total memory the chip's own), bfloat16 support as the chip runs
    it, no CUDA capability, a memory summary; the CUDA redirect answers with the same."""
    module = torch.get_device_module(dev)
    assert module is torch.flagos
    index = dev.index or 0
    props = module.get_device_properties(dev)
    assert module.get_device_name(dev) == props.name == module.get_device_name() == flagos.info()["devices"][index]
    assert props.total_memory == module.mem_get_info(dev)[1] > 0
    assert (props.major, props.minor) == module.get_device_capability() == (0, 0)
    assert props.multi_processor_count == 0 and props.type == flagos.info()["chip"]   # no figure made up
    assert module.is_bf16_supported() == flagos.supports_dtype(torch.bfloat16)
    held = torch.empty(2**18, device=dev)  # 1 MiB, seen by the summary
    summary = module.memory_summary()
    assert f"flagos:{index}" in summary and "free of" in summary
    assert f"allocated: {module.memory_allocated(dev) / 2**20:,.1f} MiB" in summary   # sim: 1.0 MiB and more
    assert summary.splitlines()[-1].endswith(f" free of {module.mem_get_info(dev)[1] / 2**20:,.1f} MiB")
    del held
    with pytest.raises(ValueError, match="does not exist"):
        module.get_device_properties(module.device_count())
