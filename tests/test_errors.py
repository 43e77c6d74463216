"""Bad input gets a clear error that names the fix, and loses nothing."""
import ctypes
from types import SimpleNamespace as types_ns

import pytest
import torch
from conftest import CHIP, device_mode_only, run_python, runs_once

import flagos
from flagos import _activation
from flagos.chips import opencl as opencl_chip

pytestmark = device_mode_only


def test_mixed_devices_name_the_argument(dev):
    a = torch.ones(3, device=dev)
    with pytest.raises(flagos.DeviceMismatchError,
                       match=r"aten::add\.Tensor: argument 'other' is a tensor on cpu.*\.to\(flagos\.device\(\)\)"):
        a + torch.ones(3)
    with pytest.raises(flagos.DeviceMismatchError, match=r"argument 'tensors'"):
        torch.cat([a, torch.ones(3)])
    assert isinstance(flagos.DeviceMismatchError("x"), RuntimeError)


def test_zero_dim_cpu_tensors_mix_like_pytorch(dev):
    a = torch.ones(3, device=dev)
    out = a * torch.tensor(2.0)
    assert out.device == dev and out.cpu().tolist() == [2.0, 2.0, 2.0]
    dst = torch.zeros(3, device=dev)
    dst.copy_(torch.arange(3.0))  # copies cross devices
    assert dst.cpu().tolist() == [0.0, 1.0, 2.0]


def test_unknown_chip_lists_the_choices():
    with pytest.raises(flagos.ChipNotFoundError, match=r"unknown chip 'tpu'; known chips: npu, mlu, musa, cuda, xpu, mps, opencl, cpu"):
        flagos.activate("tpu")


def test_absent_chip_says_what_is_available():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(flagos.ChipNotFoundError, match=r"chip 'cuda' is not available.*available here: (opencl, )?cpu"):
        flagos.activate("cuda")


@runs_once
def test_a_chip_that_reports_no_devices_is_refused_and_nothing_is_set_up():
    """A chip that is there but counts no device (a driver that lost its cards) is refused
    before anything is registered; once it counts one again, activation goes through."""
    proc = run_python("""
        import flagos
        from flagos import chips
        cpu = chips.profile("cpu")
        count = cpu.device_count
        cpu.device_count = lambda: 0
        try:
            flagos.activate("cpu")
        except flagos.ChipNotFoundError as e:
            print("refused:", e)
        print("active:", flagos.info()["active"])
        cpu.device_count = count
        print("then:", flagos.activate("cpu")["chip"], flagos.device())
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.stdout.splitlines() == ["refused: chip 'cpu' reports no devices", "active: False",
                                        "then: cpu flagos:0"], proc.stdout + proc.stderr


def test_switching_chip_in_device_mode_is_refused():
    if not torch.cuda.is_available():
        with pytest.raises(flagos.ChipNotFoundError):
            flagos.activate("cuda")
    with pytest.raises(flagos.ConfigError, match="cannot be deactivated"):
        flagos.deactivate()
    other = "sim" if CHIP == "cpu" else "cpu"
    with pytest.raises(flagos.ConfigError, match=f"^flagos is already active on chip '{CHIP}' in device "
                                                 f"mode; .* Start a new process to use '{other}'.$"):
        flagos.activate(other)
    assert flagos.info()["chip"] == CHIP  # nothing was lost


@runs_once
def test_a_route_to_a_kernel_registered_after_activation_does_not_stop_activation():
    """FLAGOS_ROUTE names an override the program registers once flagos is active: activation
    (whose own backward probe multiplies) succeeds, with backward available; the op refuses
    until the kernel is there, then runs it."""
    proc = run_python("""
        import torch, flagos
        flagos.activate("cpu")
        print("BACKWARD", flagos.info()["backward"])
        x = torch.ones(3, device="flagos", requires_grad=True)
        try:
            x * x
        except flagos.ConfigError as e:
            print("BEFORE", e)
        flagos.register_kernel("aten::mul.Tensor", lambda a, b: torch.mul(a, b) + 1)
        (x * x).sum().backward()
        print("AFTER", (x * x).tolist(), x.grad.tolist())
    """, env={"FLAGOS_ROUTE": "aten::mul=override"})
    lines = proc.stdout.splitlines()
    assert lines[0] == "BACKWARD True", proc.stdout + proc.stderr
    assert lines[1].startswith("BEFORE aten::mul.Tensor is routed to 'override' but no kernel is registered")
    # backward's two products (grad * x, one per operand) run the override too: 2 * (1 * 1 + 1)
    assert lines[2] == "AFTER [2.0, 2.0, 2.0] [4.0, 4.0, 4.0]"


@runs_once
def test_native_mode_gives_way_to_another_chip_or_to_device_mode():
    proc = run_python("""
        import torch, flagos
        flagos.activate("cpu", mode="native")
        flagos.activate("sim")
        print(flagos.info()["chip"], flagos.info()["mode"], torch.ones(2, device="flagos").device)
    """)
    assert proc.stdout.strip().endswith("sim device flagos:0"), proc.stdout + proc.stderr


def test_nonexistent_device_index(dev):
    with pytest.raises(RuntimeError, match=r"flagos:3 does not exist"):
        torch.ones(2, device="flagos:3")
    with pytest.raises(ValueError, match=r"flagos:2 does not exist"):
        flagos.device(2)
    # ops on a flagos tensor that name another flagos device (the router reads the index)
    x = torch.ones(2, device=dev)
    count = torch.flagos.device_count()
    for make in (lambda: x.to("flagos:3"), lambda: torch.empty_like(x, device="flagos:3"),
                 lambda: x.new_zeros(2, device=torch.device("flagos", 3))):
        with pytest.raises(RuntimeError, match=rf"flagos:3 does not exist: the active chip has "
                                               rf"{count} device\(s\) \(see flagos.list_devices\(\)\)"):
            make()
    assert (x + 1).cpu().tolist() == [2.0, 2.0]


@runs_once
@pytest.mark.parametrize("var,value,expected", [
    ("FLAGOS_FALLBACK", "maybe", r"FLAGOS_FALLBACK='maybe' is not valid; use one of: allow, warn, error"),
    ("FLAGOS_ROUTE", "aten::mm:fallback", r"FLAGOS_ROUTE entry 'aten::mm:fallback' is not 'op=route'"),
    ("FLAGOS_ROUTE", "aten::mm=gpu", r"route 'gpu' is not valid; use one of: auto, override"),
    ("FLAGOS_LOG_LEVEL", "loud", r"FLAGOS_LOG_LEVEL='loud' is not valid; use one of: debug, info"),
    ("FLAGOS_MODE", "both", r"FLAGOS_MODE='both' is not valid; use one of: device, native"),
    ("FLAGOS_DEVICE", "tpu", r"unknown chip 'tpu'; known chips:"),
    ("FLAGOS_FALLBACK_STAGING", "lots", r"FLAGOS_FALLBACK_STAGING='lots' is not a size; use bytes with an "
                                        r"optional K, M or G suffix, e\.g\. FLAGOS_FALLBACK_STAGING=256M"),
])
def test_bad_environment_values(var, value, expected):
    proc = run_python("""
        import re, sys, torch, flagos
        try:
            flagos.activate(None)
        except flagos.ConfigError as e:
            print("ERR", e)
            # nothing changed in torch: PrivateUse1 is still free
            assert torch._C._get_privateuse1_backend_name() == "privateuseone"
            sys.exit(0)
        sys.exit("no error raised")
    """, env={var: value, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    import re
    assert re.search(expected, proc.stdout), proc.stdout


def test_opencl_detect_says_what_its_adapter_finds(monkeypatch):
    """detect() is True exactly where the adapter library is built and finds a device (whatever
    this machine has: CI builds it and installs PoCL's CPU device), so test_opencl.py's skip,
    which reads detect(), cannot hide a broken one."""
    chip = opencl_chip.OpenCLChip("opencl")
    if opencl_chip.find_library("opencl") is None:
        expected = False
    else:
        try:
            expected = chip.adapter.device_count() > 0
        except (flagos.AdapterError, flagos.DeviceError):
            expected = False
    assert chip.detect() is expected

    class NoDevice(opencl_chip.OpenCLChip):  # the adapter built, no OpenCL device found
        adapter = types_ns(device_count=lambda: 0)

    monkeypatch.setattr(opencl_chip, "find_library", lambda name: "libflagos_opencl_adapter.so")
    assert not NoDevice("opencl").detect()

    class Devices(opencl_chip.OpenCLChip):  # CL_DEVICE_TYPE bits per device: 2 CPU, 4 GPU
        def __init__(self, types):
            super().__init__("opencl")
            self.types = types

        @property
        def adapter(self):
            return types_ns(device_count=lambda: len(self.types))

        def device_type(self, index):
            return self.types[index]

    # auto takes opencl for a GPU among its devices, not for CPUs only (the cpu chip is faster)
    assert Devices([2, 4]).picked_by_auto() and not Devices([2, 2]).picked_by_auto()


def opencl_devices_the_loader_lists():
    """How many OpenCL devices the ICD loader lists over every platform, asked directly (None
    without a loader): a count that does not go through the opencl adapter."""
    try:
        cl = ctypes.CDLL("libOpenCL.so.1")
    except OSError:
        return None
    cl.clGetPlatformIDs.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    cl.clGetDeviceIDs.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p,
                                  ctypes.POINTER(ctypes.c_uint32)]
    n_platforms = ctypes.c_uint32(0)
    if cl.clGetPlatformIDs(0, None, ctypes.byref(n_platforms)) != 0 or n_platforms.value == 0:
        return 0
    platforms = (ctypes.c_void_p * n_platforms.value)()
    if cl.clGetPlatformIDs(n_platforms.value, platforms, None) != 0:
        return 0
    total = 0
    for platform in platforms:
        n = ctypes.c_uint32(0)
        if cl.clGetDeviceIDs(platform, 0xFFFFFFFF, 0, None, ctypes.byref(n)) == 0:  # CL_DEVICE_TYPE_ALL
            total += n.value
    return total


def test_opencl_adapter_finds_a_device_where_the_loader_lists_one(monkeypatch):
    """Where the opencl adapter is built and the ICD loader lists a device (CI installs PoCL's
    CPU device), the adapter finds one: test_opencl.py skips itself where it finds none, and a
    broken device search must not pass for a machine without OpenCL."""
    monkeypatch.delenv("FLAGOS_OPENCL_DEVICES", raising=False)
    listed = opencl_devices_the_loader_lists()
    if opencl_chip.find_library("opencl") is None or not listed:
        pytest.skip(f"the opencl adapter is not built or the loader lists no device ({listed})")
    chip = opencl_chip.OpenCLChip("opencl")
    assert chip.detect() and 1 <= chip.adapter.device_count() <= listed


def test_opencl_adapter_not_built_names_the_packages(monkeypatch):
    """Where setup.py found no OpenCL headers or ICD loader, asking for opencl says what to
    install and how to rebuild (tests/test_opencl.py checks the machine without a device)."""
    monkeypatch.setattr(opencl_chip, "find_library", lambda name: None)
    chip = opencl_chip.OpenCLChip("opencl")
    assert not chip.detect() and not chip.picked_by_auto()
    with pytest.raises(flagos.AdapterError, match=r"the OpenCL adapter was not built .*"
                       r"ocl-icd-opencl-dev opencl-headers.*rebuild flagos"):
        _ = chip.adapter
    assert "ocl-icd-opencl-dev" in chip.why_unavailable()


@runs_once
def test_slot_taken_by_another_plugin():
    proc = run_python("""
        import torch, flagos
        torch.utils.rename_privateuse1_backend("npu")
        try:
            flagos.activate("cpu", mode="device")
        except flagos.ConfigError as e:
            print("ERR", e)
    """)
    assert "already taken by 'npu'" in proc.stdout and "mode='native'" in proc.stdout


def test_wrapped_tensor_without_payload():
    t = torch.Tensor._make_wrapper_subclass(flagos.FlagosTensor, (2,), dtype=torch.float32,
                                            device=flagos.device())
    with pytest.raises(RuntimeError, match="has no payload"):
        t + 1


@runs_once
def test_backward_before_activation_is_explained():
    """PyTorch's autograd engine sizes its device queues at the first backward() of a process;
    one that ran before activation leaves flagos without a queue. Activation says so."""
    proc = run_python("""
        import logging, torch
        torch.ones(2, requires_grad=True).sum().backward()     # plain CPU, before flagos
        import flagos
        flagos.activate("cpu")
        print("BACKWARD", flagos.info()["backward"])
        print("FORWARD", (torch.ones(2, device="flagos") * 3).sum().item())
    """)
    assert "BACKWARD False" in proc.stdout and "FORWARD 6.0" in proc.stdout
    assert "Activate flagos before the first backward()" in proc.stderr
    proc = run_python("""
        import torch, flagos
        flagos.activate("cpu")
        torch.ones(2, requires_grad=True).sum().backward()     # CPU backward after: fine
        x = torch.ones(2, device="flagos", requires_grad=True)
        (x * 3).sum().backward()
        print("BACKWARD", flagos.info()["backward"], x.grad.tolist())
    """)
    assert "BACKWARD True [3.0, 3.0]" in proc.stdout


def test_a_storage_on_flagos_is_refused_and_the_process_goes_on():
    # PyTorch would allocate it through a PrivateUse1 allocator that a device registered from
    # Python lacks, and crash; a fresh process, so a regression fails this test alone.
    proc = run_python(f"""
        import torch, flagos
        flagos.activate({CHIP!r})
        x = torch.arange(6.0, device=flagos.device())
        attempts = {{
            "UntypedStorage": lambda: torch.UntypedStorage(16, device="flagos"),
            "UntypedStorage on flagos:0": lambda: torch.UntypedStorage(16, device="flagos:0"),
            "UntypedStorage of a list": lambda: torch.UntypedStorage([1, 2], device=torch.device("flagos", 0)),
            "TypedStorage": lambda: torch.TypedStorage(4, dtype=torch.float32, device="flagos:0"),
            "storage.to": lambda: torch.UntypedStorage(8).to(device="flagos"),
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
            except RuntimeError as e:
                assert "Make a tensor instead" in str(e) and "tensor.to('flagos')" in str(e), e
            else:
                raise AssertionError(name + " made a storage on flagos")
        # host storages are untouched, and flagos tensors still copy and move
        assert torch.UntypedStorage(4).device.type == "cpu"
        assert torch.UntypedStorage([1, 2, 3], device="cpu").tolist() == [1, 2, 3]
        assert torch.TypedStorage([1.0, 2.0]).tolist() == [1.0, 2.0]
        import copy
        y = copy.deepcopy(x) + 1
        assert y.device == x.device and y.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        print("survived")
    """)
    assert "survived" in proc.stdout


FORKED_CHILD = """
    import os, torch, flagos
    flagos.activate({chip!r})
    x = torch.arange(4.0, device=flagos.device())
    pid = os.fork()
    if pid == 0:  # the child: every use of the chip either works or names the fix at once
        answers = []
        for use in (lambda: x + 1, lambda: torch.ones(2, device="flagos"), flagos.device,
                    lambda: x.cpu()):
            try:
                use()
                answers.append("ran")
            except RuntimeError as e:
                answers.append("refused" if "'spawn' method" in str(e) else repr(e))
        print(torch.flagos._is_in_bad_fork(), *answers, flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    print("parent", (x + 1).cpu().tolist(), torch.flagos._is_in_bad_fork())
"""


@runs_once
@pytest.mark.parametrize("chip", ["opencl", "sim"])
def test_a_forked_child_uses_the_chip_only_where_its_driver_survives_fork(chip):
    """OpenCL drivers run threads that a fork leaves in the parent: in a forked child (a
    DataLoader worker) the chip is refused with the fix, as CUDA is, instead of waiting
    forever; sim, a plain library, keeps working there. The parent goes on either way."""
    if chip == "opencl" and not flagos.chips.profile("opencl").detect():
        pytest.skip("no opencl chip here: " + flagos.chips.profile("opencl").why_unavailable())
    lines = run_python(FORKED_CHILD.format(chip=chip)).stdout.splitlines()
    expected = ("True refused refused refused refused" if chip == "opencl"
                else "False ran ran ran ran")
    assert lines[-2:] == [expected, "parent [1.0, 2.0, 3.0, 4.0] False"]


def test_the_fork_hook_is_registered_once_per_process(monkeypatch):
    """os.register_at_fork cannot be undone: activating again (native mode comes and goes)
    must not pile up hooks that each run in every forked child."""
    registered = []
    monkeypatch.setattr(_activation.os, "register_at_fork", lambda **hooks: registered.append(hooks))
    monkeypatch.setattr(_activation, "_fork_hook_registered", False)
    for _ in range(3):
        _activation._refuse_in_forked_children()
    assert registered == [{"after_in_child": _activation._in_forked_child}]


def test_the_routers_downcast_switch_refuses_half_a_policy():
    """_C.set_downcast takes the whole policy or None: given only some of its five values it
    raises and keeps the policy it had, never a policy with no message to warn with."""
    with pytest.raises(TypeError, match=r"set_downcast\(from_dtype, to_dtype, device_type, warning, message\)"):
        flagos._C.set_downcast(torch.bfloat16)
    with pytest.raises(TypeError, match="set_downcast"):
        flagos._C.set_downcast(torch.bfloat16, torch.float32, "flagos", UserWarning)


def test_the_routers_entry_points_refuse_a_call_not_of_their_form(dev):
    """PyTorch calls the factory entry point with the op and its arguments, and the dispatch
    entry with four: anything else is a TypeError naming the form, not a crash. The op alone is
    of the form: what fails then is the op (PyTorch checks arguments before they reach flagos,
    so only a direct call can do this)."""
    with pytest.raises(TypeError, match=r"dispatch_factory\(op, \*args, \*\*kwargs\)"):
        flagos._C.dispatch_factory()
    with pytest.raises(Exception) as op_error:  # the op's own error (which one depends on the chip)
        flagos._C.dispatch_factory(torch.ops.aten.empty.memory_format)
    assert "dispatch_factory(op" not in str(op_error.value)
    made = flagos._C.dispatch_factory(torch.ops.aten.empty.memory_format, [2, 3])
    assert (made.device, made.shape) == (dev, (2, 3))
    for args in [(), (torch.ops.aten.add.Tensor, (), [1], {}), (torch.ops.aten.add.Tensor, (), (), [])]:
        with pytest.raises(TypeError, match=r"dispatch_native\(func, types, args: tuple, kwargs: dict\)"):
            flagos._C.dispatch_native(*args)


def test_moving_meta_tensors_gives_pytorchs_error_naming_to_empty(dev):
    """A model made on the meta device and moved with .to(): PyTorch's NotImplementedError,
    which Module.to() completes with the fix (to_empty), as when moving it to the CPU; the
    same for one tensor and for a copy into a flagos tensor."""
    def errors(device):
        out = []
        for move in (lambda: torch.nn.Linear(2, 2, device="meta").to(device),
                     lambda: torch.empty(3, device="meta").to(device),
                     lambda: torch.empty(3, device=device).copy_(torch.empty(3, device="meta"))):
            with pytest.raises(NotImplementedError) as info:
                move()
            out.append(str(info.value))
        return out

    got = errors(dev)
    assert got == errors("cpu") and "to_empty()" in got[0]
    assert torch.nn.Linear(2, 2, device="meta").to_empty(device=dev).weight.device == dev
