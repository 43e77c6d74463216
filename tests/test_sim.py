"""The emulated accelerator: its memory pool, out-of-memory, failures, devices and dtypes.

Each test runs in a fresh process on sim, so these run whatever chip the suite itself uses.
"""
from conftest import device_mode_only, run_python

pytestmark = device_mode_only


def run_sim(code: str, **env):
    return run_python(code, env={"FLAGOS_DEVICE": "sim", "FLAGOS_FALLBACK": "allow", **env})


def test_memory_stats_follow_live_tensors_exactly():
    proc = run_sim("""
        import gc, torch, flagos
        m = torch.flagos
        base = m.memory_allocated()
        a = torch.empty(1000, device="flagos")                       # 4000 bytes
        b = torch.zeros(10, 10, dtype=torch.float16, device="flagos")  # 200 bytes
        assert m.memory_allocated() == base + 4200, m.memory_allocated()
        v = a[10:20]                                                 # a view: no new memory
        assert m.memory_allocated() == base + 4200
        c = a * 2                                                    # sim kernel: one new buffer
        assert m.memory_allocated() == base + 8200
        assert m.max_memory_allocated() >= base + 8200
        del a, v, c, b
        gc.collect()
        assert m.memory_allocated() == base
        m.reset_peak_memory_stats()
        assert m.max_memory_allocated() == base
        assert m.memory_reserved() == m.memory_allocated()
        free, total = m.mem_get_info()
        assert total == 64 * 2**20 and free == total - base
        m.empty_cache()
        m.synchronize()
        print("OK")
    """, FLAGOS_SIM_MEMORY="64M")
    assert "OK" in proc.stdout


def test_out_of_memory_names_the_chip_and_the_process_keeps_working():
    proc = run_sim("""
        import gc, torch, flagos
        m = torch.flagos
        keep = torch.ones(1024, device="flagos")
        before = m.memory_allocated()
        try:
            big = torch.empty(2**20, device="flagos")                # 4 MiB > 1 MiB pool
        except torch.OutOfMemoryError as e:
            print("OOM", e)
        assert m.memory_allocated() == before
        # the process keeps working, and memory comes back when tensors go
        xs = [torch.ones(1024, device="flagos") for _ in range(10)]
        assert m.memory_allocated() == before + 10 * 4096
        del xs
        gc.collect()
        assert m.memory_allocated() == before
        print("SUM", (keep * 2).sum().item())
    """, FLAGOS_SIM_MEMORY="1M")
    out = proc.stdout
    assert "OOM sim device 0 out of memory. Requested 4194304 bytes" in out
    assert "bytes free of 1048576" in out and "SIM_ERROR_OUT_OF_MEMORY (code 2)" in out
    assert "SUM 2048.0" in out


def test_injected_allocation_failure():
    proc = run_sim("""
        import torch, flagos
        ok = [torch.empty(4, device="flagos") for _ in range(2)]
        try:
            torch.empty(4, device="flagos")
        except torch.OutOfMemoryError as e:
            print("OOM", e)
        print("AFTER", torch.ones(3, device="flagos").sum().item())
    """, FLAGOS_SIM_FAIL_ALLOC_AT="3")
    assert "injected failure of allocation #3" in proc.stdout and "AFTER 3.0" in proc.stdout


def test_injected_failure_counts_the_programs_allocations_only():
    """activate() allocates for its own checks (the autograd probe); N=1 is still the
    program's first allocation, which fails, and the process keeps working."""
    proc = run_python("""
        import gc, torch, flagos
        flagos.activate("sim")
        m = torch.flagos
        before = m.memory_allocated()
        try:
            torch.ones(4, device="flagos")
            print("FIRST ALLOCATION RAN")
        except torch.OutOfMemoryError as e:
            print("OOM", e)
        assert m.memory_allocated() == before
        x = torch.arange(4.0).to("flagos")
        print("AFTER", (x * 2).cpu().tolist(), m.memory_allocated() - before)
    """, env={"FLAGOS_SIM_FAIL_ALLOC_AT": "1"})
    assert "FIRST ALLOCATION RAN" not in proc.stdout
    assert "OOM sim device 0 out of memory." in proc.stdout
    assert "injected failure of allocation #1 (FLAGOS_SIM_FAIL_ALLOC_AT)" in proc.stdout
    assert "AFTER [0.0, 2.0, 4.0, 6.0] 16" in proc.stdout  # x lives on; x * 2 came and went


def test_sticky_device_failure_spares_other_devices():
    proc = run_sim("""
        import torch, flagos
        for attempt in range(2):
            try:
                torch.ones(2, device="flagos:1")
            except flagos.DeviceError as e:
                assert isinstance(e, RuntimeError)
                print("ERR", e.chip, e.code, e.code_name, "|", e.hint, "|", e)
        print("DEV0", (torch.ones(2, device="flagos:0") + 1).cpu().tolist())
    """, FLAGOS_SIM_FAIL_DEVICE="1")
    lines = [l for l in proc.stdout.splitlines() if l.startswith("ERR")]
    assert len(lines) == 2  # every later call fails too
    assert lines[0].startswith("ERR sim 6 SIM_ERROR_DEVICE_LOST | the device is in a failed state")
    assert "sim device 1: alloc failed" in lines[0]
    assert "DEV0 [2.0, 2.0]" in proc.stdout


def test_visible_devices_pick_and_order_the_machines_devices():
    """FLAGOS_VISIBLE_DEVICES=2,0: the process's flagos:0 is sim device 2, and the failed device
    named by its machine index is the process's flagos:1."""
    proc = run_sim("""
        import torch, flagos
        print("NAMES", flagos.info()["devices"])
        print("DEV0", (torch.ones(2, device="flagos:0") + 1).cpu().tolist())
        try:
            torch.ones(2, device="flagos:1")
        except flagos.DeviceError as e:
            print("ERR", e)
    """, FLAGOS_SIM_DEVICES="3", FLAGOS_VISIBLE_DEVICES="2,0", FLAGOS_SIM_FAIL_DEVICE="0")
    assert "NAMES ['flagos sim device 2', 'flagos sim device 0']" in proc.stdout
    assert "DEV0 [2.0, 2.0]" in proc.stdout
    assert "ERR sim device 1: alloc failed (SIM_ERROR_DEVICE_LOST" in proc.stdout


def test_copies_between_devices():
    proc = run_sim("""
        import torch, flagos
        x = torch.randn(4, 5)
        a = x.to("flagos:0")
        b = a.to("flagos:1")
        assert b.device == torch.device("flagos", 1)
        c = (b * 2).to("flagos:0")
        torch.testing.assert_close(c.cpu(), x * 2)
        t = a.t().to("flagos:1")                 # a strided view crosses devices too
        torch.testing.assert_close(t.cpu(), x.t())
        assert torch.flagos.memory_allocated(1) > 0
        try:
            a + b
        except flagos.DeviceMismatchError as e:
            print("MIX", e)
        print("OK")
    """)
    assert "OK" in proc.stdout
    assert "MIX aten::add.Tensor: its tensors are on flagos:0, flagos:1" in proc.stdout


def test_bfloat16_is_not_native_unless_declared():
    code = """
        import torch, flagos
        a = torch.randn(8, dtype=torch.bfloat16)
        with flagos.track() as r:
            out = (a.to("flagos") * 3).cpu()
        torch.testing.assert_close(out, a * 3)
        print("ROUTE", "native" if r.op("aten::mul.Tensor")["calls"]["native"] else "fallback")
    """
    assert "ROUTE fallback" in run_sim(code).stdout
    assert "ROUTE native" in run_sim(code, FLAGOS_SIM_DTYPES="float32,bfloat16").stdout


BAD_SIM_VALUES = {
    "FLAGOS_SIM_MEMORY": ["lots", " -1", "-1", "+5", " 512M", "512M ", "1.5G", "0x10", "1T",
                          "99999999999999999999", "17179869184G"],
    "FLAGOS_SIM_DEVICES": [" 2", "+2", "-1", "2 ", "0", "17", "two"],
    "FLAGOS_SIM_FAIL_ALLOC_AT": [" 1", "+1", "-1", "0", "1e3"],
    "FLAGOS_SIM_FAIL_DEVICE": [" 0", "+0", "-0", "-1", "2"],  # 2 devices: indices 0 and 1
    "FLAGOS_VISIBLE_DEVICES": ["2", "0,0", "1,", ",1", " 1", "one"],
}


def test_bad_sim_configuration_is_a_clear_error():
    """Sizes and counts with spaces, signs or anything but digits (and a suffix for sizes) are
    refused, naming the variable, the value as given and a valid example; a good value then
    works in the same process."""
    proc = run_python(f"""
        import os, torch, flagos
        for var, values in {BAD_SIM_VALUES!r}.items():
            for value in values:
                os.environ[var] = value
                try:
                    flagos.activate("sim")
                    print("ACCEPTED", var, repr(value))
                except flagos.errors.AdapterError as e:
                    print("ERR", e)
                del os.environ[var]
        os.environ["FLAGOS_SIM_MEMORY"] = "64m"
        flagos.activate("sim")
        print("TOTAL", torch.flagos.mem_get_info()[1])
    """)
    assert "ACCEPTED" not in proc.stdout, proc.stdout
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERR")]
    assert len(errors) == sum(map(len, BAD_SIM_VALUES.values()))
    lines = iter(errors)
    for var, values in BAD_SIM_VALUES.items():
        for value in values:
            line = next(lines)
            assert f"{var}={value!r} is not" in line and f"e.g. {var}=" in line, (var, value, line)
    assert "use bytes with an optional K, M or G suffix" in errors[0]
    # the valid range said as it is: two devices by default
    fail_device = [line for line in errors if "FLAGOS_SIM_FAIL_DEVICE=" in line]
    assert all("use a device index from 0 to 1, e.g. FLAGOS_SIM_FAIL_DEVICE=1" in line
               for line in fail_device), fail_device
    assert "TOTAL 67108864" in proc.stdout


def test_sim_kernels_match_cpu_and_run_natively():
    proc = run_sim("""
        import torch, flagos
        import torch.nn.functional as F
        torch.manual_seed(0)
        TOL = {torch.float32: dict(atol=1e-5, rtol=1.3e-6), torch.float16: dict(atol=1e-3, rtol=1e-3)}
        cases = {
            "aten::add.Tensor": lambda a, b, c: a + b * 1,
            "aten::sub.Tensor": lambda a, b, c: torch.sub(a, c, alpha=2),      # c broadcasts
            "aten::mul.Tensor": lambda a, b, c: a * c,
            "aten::div.Tensor": lambda a, b, c: a / (b.abs() + 1),
            "aten::add.Scalar": lambda a, b, c: torch.ops.aten.add.Scalar(a, 2.5, alpha=2),
            "aten::mul.Scalar": lambda a, b, c: torch.ops.aten.mul.Scalar(a, -3.0),
            "aten::neg": lambda a, b, c: -a,
            "aten::relu": lambda a, b, c: F.relu(a.t()),                      # strided input
            "aten::silu": lambda a, b, c: F.silu(a),
            "aten::sigmoid": lambda a, b, c: torch.sigmoid(a),
            "aten::tanh": lambda a, b, c: torch.tanh(a),
            "aten::exp": lambda a, b, c: torch.exp(a),
            "aten::gelu": lambda a, b, c: F.gelu(a, approximate="tanh"),
            "aten::mm": lambda a, b, c: a @ b.t(),
            "aten::bmm": lambda a, b, c: torch.bmm(a.view(2, 3, 8), b.view(2, 8, 3)),
            "aten::addmm": lambda a, b, c: torch.addmm(c[0, :6], a, b.t(), beta=0.5, alpha=2),
            "aten::sum.dim_IntList": lambda a, b, c: a.sum(dim=1, keepdim=False),
            "aten::mean.dim": lambda a, b, c: a.mean(dim=(0, 1), keepdim=True),
            "aten::_softmax": lambda a, b, c: torch.softmax(a, dim=0),
            "aten::native_layer_norm": lambda a, b, c: F.layer_norm(a, (8,), b[0], c[0]),
        }
        for dtype in (torch.float32, torch.float16):
            a, b, c = torch.randn(6, 8), torch.randn(6, 8), torch.randn(1, 8)
            a, b, c = (t.to(dtype) for t in (a, b, c))
            d = flagos.device()
            for op, fn in cases.items():
                ref = fn(a.float(), b.float(), c.float())
                with flagos.track() as r:
                    out = fn(a.to(d), b.to(d), c.to(d)).cpu()
                row = r.op(op)
                assert row and row["calls"]["native"] >= 1 and row["calls"]["fallback"] == 0, (op, dtype, row)
                torch.testing.assert_close(out.float(), ref, **TOL[dtype]), (op, dtype)
        print("OK")
    """)
    assert "OK" in proc.stdout


def test_fallback_warning_comes_before_the_op_runs():
    proc = run_python("""
        import warnings, torch, flagos
        flagos.activate("sim")
        x = torch.ones(3, device="flagos")
        with warnings.catch_warnings():
            warnings.simplefilter("error", flagos.FallbackWarning)
            try:
                x.cumsum_(0)            # no sim kernel: it would fall back
            except flagos.FallbackWarning as e:
                print("WARNED", e)
        print("UNCHANGED", x.cpu().tolist(), flagos.fallback_report().calls("fallback"))
        x.cumsum_(0)                    # warned once already: now it runs
        print("RAN", x.cpu().tolist())
    """, env={"FLAGOS_FALLBACK": "warn"})
    assert "WARNED aten::cumsum_ falls back to the CPU" in proc.stdout
    assert "UNCHANGED [1.0, 1.0, 1.0] 0" in proc.stdout and "RAN [1.0, 2.0, 3.0]" in proc.stdout


def test_empty_strided_takes_and_refuses_the_layouts_cpu_does():
    """sim's empty_strided checks a layout as PyTorch's own kernel does: the same layouts made
    (empty ones included), the same errors (strides of another length, a negative size, a size
    that overflows; compared with CPU's in the same process), and the process goes on."""
    proc = run_sim("""
        import torch
        for shape, stride in [((2, 3), (1,)), ((2, -3), (3, 1)), ((2, 0), (1, 1)), ((0,), (1,)),
                              ((2 ** 62, 4), (4, 1))]:
            outcomes = []
            for device in ("cpu", "flagos"):
                try:
                    t = torch.empty_strided(shape, stride, device=device)
                    outcomes.append(("made", tuple(t.shape), t.stride()))
                except RuntimeError as e:
                    outcomes.append(("refused", str(e).splitlines()[0]))
            print("OUTCOMES", outcomes)
        print("SUM", torch.ones(3, device="flagos").sum().item())
    """)
    outcomes = [eval(line.removeprefix("OUTCOMES ")) for line in proc.stdout.splitlines()
                if line.startswith("OUTCOMES")]
    assert [cpu[0] for cpu, _ in outcomes] == ["refused", "refused", "made", "made", "refused"]
    for cpu, on_flagos in outcomes:
        assert on_flagos == cpu
    assert "SUM 3.0" in proc.stdout
