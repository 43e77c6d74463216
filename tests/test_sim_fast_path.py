"""The C hot path of C-ABI chips (csrc/adapter_fast.c): the common case of the kernel-table
ops, of in-place elementwise ops and of views runs in the router without the Python runner,
with PyTorch's results, layouts, aliasing, counters and errors; everything else still goes to
the runner.

Each test runs in a fresh process on sim, so these run whatever chip the suite itself uses.
"""
from conftest import device_mode_only, run_python

pytestmark = device_mode_only


def run_sim(code: str, **env):
    return run_python(code, env={"FLAGOS_DEVICE": "sim", "FLAGOS_FALLBACK": "allow",
                                 "FLAGOS_SIM_DTYPES": "float32,float16,bfloat16", **env})


# fail_allocation(n): sim's nth allocation from now fails (backends/sim/sim.c), as
# FLAGOS_SIM_FAIL_ALLOC_AT's does, so one process checks several failures. oom_text(e): the
# error's text with the program's allocation number as #N.
FAIL_ALLOCATION = """
        import ctypes, re, torch, flagos
        from flagos.core import _state
        _sim = ctypes.CDLL(_state.active().chip.adapter.path)
        _sim.flagos_sim_fail_allocation.argtypes = (ctypes.c_uint64,)
        _sim.flagos_sim_fail_allocation.restype = None
        fail_allocation = _sim.flagos_sim_fail_allocation
        def oom_text(e):
            return re.sub(r"allocation #[0-9]+", "allocation #N", str(e))
"""

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
            "scalar": lambda x, y: x + 2,                    # add.Tensor with a host number
            "promotion": lambda x, y: x + y.double(),        # two dtypes
            "sum dtype": lambda x, y: x.sum(dtype=torch.float64),
            "in-place transposed": lambda x, y: x.clone().t().add_(y),
            "view of a transposed": lambda x, y: x.t().view(4, 4),  # PyTorch's rule for that layout
        }
        for name, op in cases.items():
            del seen[:]
            flagos.reset_report()
            got = op(fa, fb)
            ran = [n for n in seen if n not in ("aten::t", "aten::clone", "aten::empty_like")]
            # the op itself reached the runner, or the host round trip in C (adapter_fallback.c)
            assert ran or flagos.fallback_report().calls("fallback"), name
            torch.testing.assert_close(got.cpu(), op(a, b), msg=name)
        print("OK")
    """)
    assert "OK" in proc.stdout


def test_a_broadcast_over_a_size_1_dim_at_a_stride_of_its_own_goes_to_the_runner():
    """Contiguous operands with torch.empty's strides give a contiguous result in C; an operand
    whose size-1 dim has a stride of its own (contiguous all the same) can give the result
    PyTorch's other strides for that dim when broadcast, so the runner lays that one out."""
    proc = run_sim(SPY + """
        a, b = torch.randn(1, 4), torch.randn(3, 1, 4)
        odd = a.as_strided((1, 4), (1, 1))           # is_contiguous(), but not torch.empty's strides
        fa, fb, fodd = a.to("flagos"), b.to("flagos"), a.to("flagos").as_strided((1, 4), (1, 1))
        for name, (x, y, fx, fy) in {"empty's strides": (a, b, fa, fb), "odd stride": (odd, b, fodd, fb),
                                      "same shapes": (odd, odd, fodd, fodd)}.items():
            del seen[:]
            got, want = fx * fy, x * y
            assert got.stride() == want.stride(), (name, got.stride(), want.stride())
            torch.testing.assert_close(got.cpu(), want)
            print(name, "runner" if "aten::mul.Tensor" in seen else "C")
    """)
    assert "empty's strides C\nodd stride runner\nsame shapes C" in proc.stdout, proc.stdout


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
    """The result's allocation fails: the C path (contiguous operands) and the runner (a
    transposed operand) fail it with the same error, and the process goes on."""
    proc = run_sim(FAIL_ALLOCATION + """
        a = torch.ones(2, 2, device="flagos")
        b = torch.ones(2, 2, device="flagos")
        for other in (b, b.t()):
            fail_allocation(1)                          # the result's
            try:
                a + other
                print("RAN")
            except torch.OutOfMemoryError as e:
                print("OOM", oom_text(e))
            print("AFTER", (a + b).cpu().tolist())
    """)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("OOM")]
    assert "RAN" not in proc.stdout and len(errors) == 2, proc.stdout
    assert "injected failure of allocation #N (flagos_sim_fail_allocation)" in errors[0]
    assert errors[0] == errors[1]  # the same request, the same free memory
    assert proc.stdout.count("AFTER [[2.0, 2.0], [2.0, 2.0]]") == 2


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
    assert "OOM sim device 0 out of memory. Requested 400000 bytes" in proc.stdout
    assert "RAN" not in proc.stdout and "SUM 8.0" in proc.stdout


# ---- in-place ops, views, sum, layer_norm ------------------------------------------------

# PyTorch's result (or the type of its exception) for op on host inputs and on flagos ones;
# `ran` is what reached the runner.
COMPARE = SPY + """
        TOL = {torch.float32: dict(atol=1e-5, rtol=1.3e-6), torch.float16: dict(atol=1e-3, rtol=1e-3),
               torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
        def outcome(op, inputs):
            try:
                return op(*inputs)
            except Exception as e:  # noqa: BLE001 - the type is compared
                return e
        def compare(name, op, inputs, in_c=True, dtype=torch.float32):
            moved = [t.to("flagos") if isinstance(t, torch.Tensor) else t for t in inputs]
            want = outcome(op, [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
            del seen[:]
            got = outcome(op, moved)
            ran = list(seen)
            if isinstance(want, Exception):
                assert type(got) is type(want), (name, want, got)
                return
            assert not isinstance(got, Exception), (name, got)
            wants = want if isinstance(want, tuple) else (want,)
            gots = got if isinstance(got, tuple) else (got,)
            for w, g in zip(wants, gots):
                assert g.shape == w.shape and g.stride() == w.stride(), (name, g.shape, w.shape, g.stride(), w.stride())
                assert g.storage_offset() == w.storage_offset() and g.dtype == w.dtype, name
                torch.testing.assert_close(g.cpu(), w, msg=name, **TOL[dtype])
            if in_c:
                assert ran == [], (name, ran)
            CHECKED.append(name)
        CHECKED = []
"""


def test_in_place_ops_run_in_c_with_pytorch_semantics():
    proc = run_sim(COMPARE + """
        torch.manual_seed(0)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            a, b = torch.randn(4, 5, dtype=dtype), torch.rand(4, 5, dtype=dtype) + 0.5
            row, col = torch.rand(5, dtype=dtype) + 0.5, torch.rand(4, 1, dtype=dtype) + 0.5
            for name in ("add_", "sub_", "mul_", "div_"):
                compare(name, lambda x, y: getattr(x, name)(y), (a, b), dtype=dtype)
                compare(name + " row", lambda x, y: getattr(x, name)(y), (a, row), dtype=dtype)
                compare(name + " column", lambda x, y: getattr(x, name)(y), (a, col), dtype=dtype)
                compare(name + " itself", lambda x: getattr(x, name)(x), (a,), dtype=dtype)
            compare("add_ alpha 1", lambda x, y: x.add_(y, alpha=1), (a, b), dtype=dtype)
            # another alpha goes to the runner: bit for bit what the CPU gives (optimizers)
            compare("add_ alpha", lambda x, y: x.add_(y, alpha=0.5), (a, b), dtype=dtype, in_c=False)
            compare("sub_ alpha", lambda x, y: x.sub_(y, alpha=3), (a, b), dtype=dtype, in_c=False)
            compare("add alpha", lambda x, y: torch.add(x, y, alpha=-2), (a, b), dtype=dtype,
                    in_c=False)
        a, b = torch.randn(4, 5), torch.randn(4, 5)
        # PyTorch's errors, from the runner
        compare("shape mismatch", lambda x, y: x.add_(y[:, :3]), (a, b), in_c=False)
        compare("self would grow", lambda x, y: x[:, :1].add_(y), (a, b), in_c=False)
        compare("partial overlap", lambda x: x[1:].add_(x[:-1]), (a,), in_c=False)
        compare("overlapping row", lambda x: x.add_(x[0]), (a,), in_c=False)
        compare("disjoint rows of one buffer", lambda x: x[:2].add_(x[2:]), (a,))

        # the caller's own object, its version counter, writes visible through the base
        fa, fb = a.to("flagos"), b.to("flagos")
        for x, y in ((a, b), (fa, fb)):
            v0 = x._version
            assert x.mul_(y) is x and x._version == v0 + 1
            row = x[1]
            assert row.add_(y[2]) is row
            assert row._version == x._version == v0 + 2
        del seen[:]
        for x, y in ((a, b), (fa, fb)):
            x[1].add_(1.0 * y[2])
        assert [n for n in seen if n.startswith("aten::add")] == [], seen
        torch.testing.assert_close(fa.cpu(), a, atol=1e-5, rtol=1.3e-6)
        # autograd refuses an in-place op on a leaf that requires grad, as on the host
        leaf = torch.ones(3, device="flagos", requires_grad=True)
        try:
            leaf.add_(leaf.detach())
            print("RAN")
        except RuntimeError as e:
            print("REFUSED", "a leaf Variable that requires grad" in str(e))
        print("CHECKED", len(CHECKED))
        print("ADD_", flagos.fallback_report().op("aten::add_.Tensor")["calls"])
    """)
    assert "CHECKED 61" in proc.stdout, proc.stdout
    assert "REFUSED True" in proc.stdout
    # counted as the chip's own calls (the refused ones raised on the host: not counted), but
    # add_ with alpha 0.5, which the runner takes to the host (one per dtype)
    assert "ADD_ {'override': 0, 'native': 18, 'fallback': 3}" in proc.stdout, proc.stdout


def test_views_run_in_c_and_share_the_buffer():
    proc = run_sim(COMPARE + """
        torch.manual_seed(0)
        a = torch.randn(2, 3, 4)
        cases = {
            "view": lambda x: x.view(-1), "view 2": lambda x: x.view(6, -1), "view 1s": lambda x: x.view(1, 24, 1),
            "reshape": lambda x: x.reshape(4, 6), "flatten": lambda x: x.flatten(1),
            "detach": lambda x: x.detach(), "t": lambda x: x[0].t(), "t 1-d": lambda x: x[0, 0].t(),
            "transpose": lambda x: x.transpose(0, -1), "permute": lambda x: x.permute(2, 0, 1),
            "unsqueeze": lambda x: x.unsqueeze(1), "unsqueeze last": lambda x: x.unsqueeze(-1),
            "expand": lambda x: x[:, :1].expand(2, 5, 4), "expand new dims": lambda x: x.expand(3, 2, 3, 4),
            "expand -1": lambda x: x[:1].expand(-1, 3, -1),
            "slice": lambda x: x[:, 1:], "slice step": lambda x: x[..., ::2], "slice negative": lambda x: x[:, -2:-1],
            "slice past the end": lambda x: x[:, 1:100], "select": lambda x: x[1], "select negative": lambda x: x[:, -1],
            "chain": lambda x: x.transpose(0, 1)[1:, :, 2].unsqueeze(0),
            "narrow": lambda x: x.narrow(2, 1, 2),
            # PyTorch's errors (and its rules for other layouts), from the runner
            "view incompatible": lambda x: x.view(5, -1), "view two -1": lambda x: x.view(-1, -1),
            "view of a transposed": lambda x: x.transpose(0, 1).view(-1),
            "select out of range": lambda x: x[5], "transpose out of range": lambda x: x.transpose(0, 3),
            "permute repeated": lambda x: x.permute(0, 0, 1), "expand mismatch": lambda x: x.expand(2, 3, 5),
            "unsqueeze out of range": lambda x: x.unsqueeze(4), "empty slice": lambda x: x[:, 2:1],
        }
        refused = {"view incompatible", "view two -1", "select out of range", "transpose out of range",
                   "permute repeated", "expand mismatch", "unsqueeze out of range", "empty slice",
                   "view of a transposed"}
        for name, op in cases.items():
            compare(name, op, (a,), in_c=name not in refused)
        for dtype in (torch.float16, torch.int64, torch.bool):  # views are metadata: any dtype
            compare(f"view {dtype}", lambda x: x.view(-1)[2:], ((a * 3).to(dtype),), dtype=torch.float16
                    if dtype == torch.float16 else torch.float32)

        # the view shares the buffer: writes through it are seen by the base and the other way
        fa = a.to("flagos")
        v = fa.view(6, 4)[1:3]
        assert v._base is fa and v._is_view()
        v.mul_(0)
        assert fa.cpu()[0, 1:3].abs().sum().item() == 0 and fa.cpu()[0, 0].abs().sum().item() > 0
        fa.add_(1)
        assert v.cpu().eq(1).all()
        s = fa[1]
        s.fill_(7)
        assert fa.cpu()[1].eq(7).all() and fa.view(-1)[12].item() == 7
        # under inference_mode a view of a normal tensor is a normal tensor, as on the host
        with torch.inference_mode():
            host_v, dev_v = a.view(-1), fa.view(-1)
        print("INFERENCE", host_v.is_inference(), dev_v.is_inference())
        # autograd through the views
        w = torch.randn(2, 3, 4, requires_grad=True)
        fw = w.detach().to("flagos").requires_grad_()
        for x in (w, fw):
            x.view(6, 4).t()[1:, 2].unsqueeze(0).expand(3, -1).sum().backward()
        torch.testing.assert_close(fw.grad.cpu(), w.grad)
        print("CHECKED", len(CHECKED))
    """)
    assert "CHECKED 27" in proc.stdout, proc.stdout
    assert "INFERENCE False False" in proc.stdout


def test_sum_and_layer_norm_run_in_c():
    proc = run_sim(COMPARE + """
        torch.manual_seed(0)
        F = torch.nn.functional
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            a = torch.randn(3, 4, 5, dtype=dtype)
            sums = {
                "sum": lambda x: x.sum(), "sum 0": lambda x: x.sum(0), "sum -1 keepdim": lambda x: x.sum(-1, keepdim=True),
                "sum dims": lambda x: x.sum((0, 2)), "sum dims keepdim": lambda x: x.sum([2, 0], keepdim=True),
                "sum transposed": lambda x: x.transpose(0, 2).sum(1), "sum 0-d": lambda x: x[0, 0, 0].sum(0),
                "sum none": lambda x: torch.sum(x, dim=None),
            }
            for name, op in sums.items():
                compare(f"{name} {dtype}", op, (a,), dtype=dtype)
            compare(f"sum dtype {dtype}", lambda x: x.sum(0, dtype=torch.float32), (a,), in_c=False, dtype=dtype)
            w, b = torch.randn(4, 5, dtype=dtype), torch.randn(4, 5, dtype=dtype)
            norms = {
                "layer_norm": lambda x: F.layer_norm(x, (5,)),
                "layer_norm affine": lambda x, w, b: F.layer_norm(x, (4, 5), w, b),
                "layer_norm weight": lambda x, w: F.layer_norm(x, (4, 5), w),
                "layer_norm bias": lambda x, b: F.layer_norm(x, (5,), None, b[0], eps=1e-3),
                "layer_norm transposed": lambda x, w: F.layer_norm(x.transpose(0, 1), (3, 5), w.t()[:, :3].t()),
                "native_layer_norm": lambda x, w, b: torch.ops.aten.native_layer_norm(x, [4, 5], w, b, 1e-5),
                "native_layer_norm plain": lambda x: torch.ops.aten.native_layer_norm(x, [5], None, None, 1e-5),
            }
            for name, op in norms.items():
                n = op.__code__.co_argcount
                compare(f"{name} {dtype}", op, (a, w, b)[:n], dtype=dtype)
        a = torch.randn(3, 4, 5)
        # PyTorch's errors, from the runner
        compare("sum repeated dim", lambda x: x.sum((0, 0)), (a,), in_c=False)
        compare("sum dim out of range", lambda x: x.sum(3), (a,), in_c=False)
        compare("layer_norm shape", lambda x: F.layer_norm(x, (4,)), (a,), in_c=False)
        compare("layer_norm weight shape", lambda x, w: F.layer_norm(x, (5,), w), (a, torch.randn(4)), in_c=False)
        # autograd through them
        x = torch.randn(3, 5, requires_grad=True)
        fx = x.detach().to("flagos").requires_grad_()
        for t in (x, fx):
            F.layer_norm(t, (5,)).sum(0).sum().backward()
        torch.testing.assert_close(fx.grad.cpu(), x.grad, atol=1e-5, rtol=1e-5)
        print("CHECKED", len(CHECKED))
    """)
    assert "CHECKED 48" in proc.stdout, proc.stdout


def test_allocation_failures_of_the_new_cases():
    """sum's and layer_norm's results fail as the runner's do; an in-place op, which needs no
    device memory of its own, still runs when its scratch buffer cannot be had. One process:
    each failure must leave it working for the next."""
    proc = run_sim(FAIL_ALLOCATION + SPY.replace("import torch, flagos", "") + """
        F = torch.nn.functional
        a = torch.ones(2, 2, device="flagos")
        # the C path, then the runner's (a transposed operand for sum does not change it: any
        # strides run in C; layer_norm's outputs are allocated in the same order by both)
        for case, (fast, slow, nth) in enumerate((("a", "a.t()", 1),
                                                  ("F.layer_norm(a, (2,))", "F.layer_norm(a.t(), (2,))", 2))):
            for code in (fast, slow):
                fail_allocation(nth)
                try:
                    print("RAN", eval(code).sum().item())
                except torch.OutOfMemoryError as e:
                    print("OOM", case, oom_text(e))
                print("AFTER", a.sum().item())
        b = torch.ones(2, 2, device="flagos")
        flagos.reset_report()
        fail_allocation(1)                                # the in-place op's scratch
        a.add_(b)
        calls = flagos.fallback_report().op("aten::add_.Tensor")["calls"]
        print("IN-PLACE", a.cpu().tolist(), calls["native"], calls["fallback"])
        a.add_(b)
        print("AGAIN", a.cpu().tolist())
    """)
    out = proc.stdout
    errors = [line for line in out.splitlines() if line.startswith("OOM")]
    assert "RAN" not in out and len(errors) == 4, out
    for fast, slow in (errors[:2], errors[2:]):
        assert "injected failure of allocation #N (flagos_sim_fail_allocation)" in fast
        assert fast == slow  # the C path fails as the runner does
    assert out.count("AFTER 4.0") == 4
    # the host round trip (csrc/adapter_fallback.c) took it
    assert "IN-PLACE [[2.0, 2.0], [2.0, 2.0]] 0 1" in out
    assert "AGAIN [[3.0, 3.0], [3.0, 3.0]]" in out


def test_the_adapter_counts_kernel_calls_from_both_paths_and_none_for_a_fallback():
    proc = run_sim("""
        import torch, flagos
        from flagos.core import _state
        adapter = _state.active().chip.adapter
        def calls(op):
            return next(c for name, c, _ in adapter.kernel_times() if name == op)
        a, b = torch.randn(4, 4).to("flagos"), torch.randn(4, 4).to("flagos")
        add0, gelu0 = calls("aten::add.Tensor"), calls("aten::gelu")
        a + b                                          # the C hot path
        torch.nn.functional.gelu(a, approximate="tanh")  # the Python runner's kernel call
        assert calls("aten::add.Tensor") == add0 + 1 and calls("aten::gelu") == gelu0 + 1
        flagos.set_route("aten::add.Tensor", "fallback")
        torch.testing.assert_close((a + b).cpu(), a.cpu() + b.cpu())
        assert calls("aten::add.Tensor") == add0 + 1   # the host ran it
        print("COUNTED")
    """)
    assert "COUNTED" in proc.stdout
