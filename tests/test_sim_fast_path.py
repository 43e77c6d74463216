"""The C hot path of C-ABI chips (csrc/adapter_fast.c): the common case of the elementwise
kernel-table ops runs in the router without the Python runner, with the runner's results,
layouts, counters and errors; everything else still goes to the runner.

Each test runs in a fresh process on sim, so these run whatever chip the suite itself uses.
"""
from conftest import device_mode_only, run_python

pytestmark = device_mode_only


def run_sim(code: str, **env):
    return run_python(code, env={"FLAGOS_DEVICE": "sim", "FLAGOS_FALLBACK": "allow",
                                 "FLAGOS_SIM_DTYPES": "float32,float16,bfloat16", **env})


# Counts the ops the Python runner is asked to run (the router calls Runner.__call__ through the
# type, so patching the class sees every call).
SPY = """
        import torch, flagos
        from flagos.runtime import _adapter_ops
        seen = []
        _call = _adapter_ops.Runner.__call__
        def spy(self, func, name, *rest):
            seen.append(name)
            return _call(self, func, name, *rest)
        _adapter_ops.Runner.__call__ = spy
"""


def test_elementwise_ops_run_in_c_with_the_results_of_pytorch():
    proc = run_sim(SPY + """
        torch.manual_seed(0)
        binary = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
        unary = {n: getattr(torch, n) for n in ("neg", "relu", "sigmoid", "tanh", "exp")}
        unary["silu"] = torch.nn.functional.silu
        shapes = [((4, 5), (4, 5)), ((4, 1), (1, 5)), ((3, 4, 5), (5,)), ((), (2, 3)), ((2, 3), ())]
        # the tolerances of tests/test_sim_kernels.py
        tol = {torch.float32: dict(atol=1e-5, rtol=1.3e-6), torch.float16: dict(atol=1e-3, rtol=1e-3),
               torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
        checked = 0
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for sa, sb in shapes:
                a, b = torch.randn(sa, dtype=dtype), torch.rand(sb, dtype=dtype) + 0.5
                fa, fb = a.to("flagos"), b.to("flagos")
                del seen[:]
                results = [(name, op(a, b), op(fa, fb)) for name, op in binary.items()]
                results += [(name, op(a), op(fa)) for name, op in unary.items()]
                assert seen == [], seen  # none of them reached the Python runner
                for name, want, got in results:
                    assert got.shape == want.shape and got.stride() == want.stride(), name
                    assert got.dtype == dtype and got.device == torch.device("flagos:0")
                    torch.testing.assert_close(got.cpu(), want, msg=name, **tol[dtype])
                    checked += 1
        print("CHECKED", checked)
    """)
    assert "CHECKED 150" in proc.stdout


def test_matmul_and_softmax_run_in_c_on_any_strides():
    proc = run_sim(SPY + """
        torch.manual_seed(0)
        F = torch.nn.functional
        tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}
        checked = 0
        for dtype in (torch.float32, torch.float16):
            a, b, bias = torch.randn(5, 7, dtype=dtype), torch.randn(7, 3, dtype=dtype), torch.randn(3, dtype=dtype)
            x, y = torch.randn(2, 3, 4, dtype=dtype), torch.randn(2, 4, 5, dtype=dtype)
            cases = {
                "mm": (torch.mm, (a, b)),
                "mm transposed": (lambda p, q: p @ q.t().contiguous().t(), (a, b)),
                "linear": (lambda p, q, r: F.linear(p, q.t().contiguous(), r), (a, b, bias)),
                "addmm column bias": (torch.addmm, (bias[:1].expand(5).reshape(5, 1).contiguous(), a, b)),
                "bmm": (torch.bmm, (x, y)),
                "softmax last": (lambda p: torch.softmax(p, -1), (a,)),
                "softmax first": (lambda p: torch.softmax(p, 0), (a,)),
                "softmax 3-d": (lambda p: torch.softmax(p, 1), (x,)),
            }
            for name, (op, inputs) in cases.items():
                moved = [t.to("flagos") for t in inputs]
                del seen[:]
                got = op(*moved)
                kernel_ops = [n for n in seen if n in ("aten::mm", "aten::bmm", "aten::addmm", "aten::_softmax")]
                assert kernel_ops == [], (name, seen)  # the views around them may go to the runner
                want = op(*inputs)
                assert got.shape == want.shape and got.stride() == want.stride(), name
                torch.testing.assert_close(got.cpu(), want, msg=name, **tol[dtype])
                checked += 1
        print("CHECKED", checked)
    """)
    assert "CHECKED 16" in proc.stdout


def test_other_cases_still_go_to_the_runner():
    proc = run_sim(SPY + """
        a = torch.randn(4, 4)
        b = torch.randn(4, 4)
        fa, fb = a.to("flagos"), b.to("flagos")
        cases = {
            "transposed": lambda x, y: x.t() + y,            # not contiguous
            "alpha": lambda x, y: torch.add(x, y, alpha=2),  # a keyword
            "scalar": lambda x, y: x + 2,                    # add.Tensor with a host number
            "promotion": lambda x, y: x + y.double(),        # two dtypes
        }
        for name, op in cases.items():
            del seen[:]
            torch.testing.assert_close(op(fa, fb).cpu(), op(a, b), msg=name)
            assert seen, name
        print("OK")
    """)
    assert "OK" in proc.stdout


def test_counters_of_calls_run_in_c():
    proc = run_sim("""
        import torch, flagos
        a = torch.ones(64, device="flagos")
        for _ in range(3):
            a = a + a
        torch.relu(a)
        add = flagos.fallback_report().op("aten::add.Tensor")
        relu = flagos.fallback_report().op("aten::relu")
        print("ADD", add["calls"], add["fallback_ns"], add["bytes_to_host"], add["bytes_to_device"])
        print("RELU", relu["calls"])
        print("VALUE", a[0].item())
    """)
    assert "ADD {'override': 0, 'native': 3, 'fallback': 0} 0 0 0" in proc.stdout
    assert "RELU {'override': 0, 'native': 1, 'fallback': 0}" in proc.stdout
    assert "VALUE 8.0" in proc.stdout


def test_an_allocation_failure_raises_what_the_runner_raises():
    """The third allocation of the program is the result's: the C path (contiguous operands)
    and the runner (a transposed operand) fail it with the same error."""
    code = """
        import torch, flagos
        a = torch.ones(2, 2, device="flagos")
        b = torch.ones(2, 2, device="flagos")
        try:
            a + ({})
            print("RAN")
        except torch.OutOfMemoryError as e:
            print("OOM", e)
        print("AFTER", (a + b).cpu().tolist())
    """
    fast = run_sim(code.format("b"), FLAGOS_SIM_FAIL_ALLOC_AT="3").stdout
    slow = run_sim(code.format("b.t()"), FLAGOS_SIM_FAIL_ALLOC_AT="3").stdout
    assert "injected failure of allocation #3" in fast and "RAN" not in fast
    assert fast == slow
    assert "AFTER [[2.0, 2.0], [2.0, 2.0]]" in fast


def test_out_of_memory_in_c_names_the_request():
    proc = run_sim("""
        import torch, flagos
        a = torch.ones(100_000, device="flagos")     # 400 kB of a 1 MiB pool
        b = torch.ones(100_000, device="flagos")
        try:
            c = a * b                                   # 400 kB more: past the pool
            print("RAN")
        except torch.OutOfMemoryError as e:
            print("OOM", e)
        del b
        print("SUM", (a * 2)[:4].sum().item())
    """, FLAGOS_SIM_MEMORY="1M")
    assert "OOM sim device 0 is out of memory: requested 400000 bytes" in proc.stdout
    assert "RAN" not in proc.stdout and "SUM 8.0" in proc.stdout
