"""sim gives the numbers, layouts and errors plain PyTorch gives on the CPU.

Each test runs in a fresh process on sim (whatever chip the suite itself uses) and compares
with the same code on plain CPU tensors.
"""
import textwrap

import pytest
from conftest import device_mode_only, run_python

pytestmark = device_mode_only

PRELUDE = """
import torch, flagos
flagos.activate("sim")
d = flagos.device()

def error(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None
"""


# The round trip has two implementations: the router's C one (csrc/adapter_fallback.c) and the
# Python runner's (runtime/_adapter_ops.py), which takes the calls the C one leaves; with no C
# fast path configured (as tests/conftest.py's FLAGOS_TEST_RUNNER_ONLY does) every call is the
# runner's. The tests of the round trip run on both.
RUNNER_ONLY = """
from flagos.runtime import _adapter_ops
_init = _adapter_ops.Runner.__init__
def _runner_only(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.c_fast = None
_adapter_ops.Runner.__init__ = _runner_only
"""
PATHS = pytest.mark.parametrize("path", ["c", "runner"])


def run_sim(code: str, path: str = "c", **env):
    prelude = PRELUDE.replace("import torch, flagos\n", "import torch, flagos\n" + RUNNER_ONLY) \
        if path == "runner" else PRELUDE
    proc = run_python(prelude + textwrap.dedent(code), env={"FLAGOS_FALLBACK": "allow", **env})
    assert "OK" in proc.stdout, proc.stdout + proc.stderr
    return proc


@PATHS
def test_host_round_trip_over_views_of_one_buffer_in_other_dtypes(path):
    run_sim(path=path, code="""
        torch.manual_seed(0)

        def run(buf):
            h = buf.view(torch.float16)        # one buffer, read as halves and as floats
            a = torch.addcmul(buf[1:5], h[1:5], buf[1:5])   # float16 view starts at byte 2
            b = torch.add(buf[1:3], h[3:5])                 # float32 view at byte 4
            c = torch.addcmul(h[2:6].view(torch.float32), buf[3:5], h[11:13])
            buf[6:8].addcmul_(h[21:23], buf[9:11])           # written back in place
            return a, b, c, buf

        host = torch.randn(16)
        for got, want in zip(run(host.to(d)), run(host.clone())):
            torch.testing.assert_close(got.cpu(), want, equal_nan=True)
        print("OK")
    """)


def test_sizes_and_strides_are_checked_before_reaching_the_adapter():
    run_sim("""
        import gc

        def same(fn, *args):
            want = error(lambda: fn("cpu", *args))
            got = error(lambda: fn(d, *args))
            assert want is not None and got == want, (got, want)

        same(lambda dev: torch.empty(2**62 + 4, device=dev))
        same(lambda dev: torch.empty(2**40, 2**40, device=dev))
        same(lambda dev: torch.empty(-1, device=dev))
        same(lambda dev: torch.zeros(2, -3, device=dev))
        same(lambda dev: torch.empty_strided((2,), (-1,), device=dev))
        same(lambda dev: torch.empty_strided((2**62,), (4,), device=dev))
        same(lambda dev: torch.zeros(4, device=dev).as_strided((4,), (2,)))
        same(lambda dev: torch.zeros(4, device=dev).as_strided((4,), (1,), 1))
        same(lambda dev: torch.zeros(4, device=dev)[1:].as_strided((2, 2), (2, 1), 1))
        same(lambda dev: torch.zeros(2, 4, device=dev).as_strided_((4, 4), (4, 1)))
        gc.collect()
        assert torch.flagos.memory_allocated() == 0   # nothing is left of the refused calls
        # a view that does fit still works, through the same checks
        x = torch.arange(8.0, device=d).as_strided((3, 2), (2, 1), 1)
        torch.testing.assert_close(x.cpu(), torch.arange(8.0).as_strided((3, 2), (2, 1), 1))
        print("OK")
    """)


def test_storage_less_tensors_are_materialized_not_read():
    run_sim("""
        torch.testing.assert_close(torch._efficientzerotensor(3, device=d).cpu(), torch.zeros(3))
        torch.testing.assert_close(torch._efficientzerotensor(2, 3).to(d).cpu(), torch.zeros(2, 3))
        a = torch.ones(3, device=d)
        a.copy_(torch._efficientzerotensor(3))
        torch.testing.assert_close(a.cpu(), torch.zeros(3))

        x0 = torch.randn(3).requires_grad_()
        x = x0.detach().to(d).requires_grad_()
        torch.sgn(x).sum().backward()               # sgn's gradient is an efficient zero tensor
        torch.sgn(x0).sum().backward()
        torch.testing.assert_close(x.grad.cpu(), x0.grad)
        z = torch.empty(0, 3, device=d)
        torch.testing.assert_close(z.sum(0).cpu(), torch.empty(0, 3).sum(0))
        print("OK")
    """)


@PATHS
def test_conjugate_and_negative_views_are_honoured(path):
    run_sim(path=path, code="""
        z = torch.tensor([[1 + 2j, 3 - 4j], [0.5 - 1j, 2 + 0.25j]])
        x = torch.randn(3, 4)
        cases = {
            "conj().cpu()": lambda z, x: z.conj(),
            "resolve_conj": lambda z, x: z.conj().resolve_conj(),
            "mH @ z": lambda z, x: z.mH @ z,
            "conj * z": lambda z, x: z.conj() * z,
            "conj().imag": lambda z, x: z.conj().imag,
            "conj view item": lambda z, x: torch.tensor(z.conj().t()[0, 1].item()),
            "conj clone": lambda z, x: z.conj().clone(),
            "conj detach": lambda z, x: z.conj().detach(),
            "conj _unsafe_view": lambda z, x: torch.ops.aten._unsafe_view(z.conj(), (4,)),
            "neg view": lambda z, x: torch._neg_view(x),
            "neg view + 1": lambda z, x: torch._neg_view(x) + 1,
            "neg view mm": lambda z, x: torch._neg_view(x) @ x.t(),
            "neg view t": lambda z, x: torch._neg_view(x).t().contiguous(),
            "resolve_neg": lambda z, x: torch._neg_view(x).resolve_neg(),
            "copy_ of a neg view": lambda z, x: torch.empty_like(x).copy_(torch._neg_view(x)),
            "copy_ of a conj view": lambda z, x: torch.empty_like(z).copy_(z.conj()),
        }
        for name, fn in cases.items():
            want = fn(z, x)
            got = fn(z.to(d), x.to(d)).cpu()
            torch.testing.assert_close(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg(),
                                       msg=name)

        def copy_into_conj(dev):
            a = torch.zeros(2, 2, dtype=torch.complex64, device=dev)
            a.t().conj().copy_(z.to(dev))          # strided destination with the bit
            b = torch.zeros(2, 2, dtype=torch.complex64, device=dev)
            b.conj().copy_(z.to(dev))              # contiguous destination with the bit
            return a.cpu(), b.cpu()

        for got, want in zip(copy_into_conj(d), copy_into_conj("cpu")):
            torch.testing.assert_close(got, want)
        in_place = {
            "fill_": lambda t: t.conj().fill_(1 + 1j),
            "zero_": lambda t: t.conj().zero_(),
            "mul_": lambda t: t.conj().mul_(2j),
            "neg view fill_": lambda t: torch._neg_view(t.real).fill_(3.0),
        }
        for name, fn in in_place.items():
            a, b = z.clone(), z.to(d)
            fn(a)
            fn(b)
            torch.testing.assert_close(b.cpu(), a, msg=name)
        print("OK")
    """)


def test_cpu_of_a_tensor_made_in_inference_mode():
    run_sim("""
        with torch.inference_mode():
            y = torch.arange(6.0, device=d).view(2, 3) * 2
        want = torch.arange(6.0).view(2, 3) * 2
        torch.testing.assert_close(y.cpu(), want)
        torch.testing.assert_close(y.to(torch.float64).cpu(), want.double())
        torch.testing.assert_close(y.to("cpu", torch.float16), want.half())
        torch.testing.assert_close(y.t().cpu(), want.t())
        torch.testing.assert_close(y.to(d).cpu(), want)
        print("OK")
    """)


def test_layouts_and_result_strides_match_cpu():
    run_sim("""
        import torch.nn.functional as F
        cl = torch.channels_last
        torch.manual_seed(0)
        x = torch.randn(2, 3, 4, 5)
        bias = torch.randn(1, 3, 1, 1)
        cases = {
            "to channels_last": lambda x, b, dev: x.to(memory_format=cl),
            "to float64 channels_last": lambda x, b, dev: x.to(torch.float64, memory_format=cl),
            "contiguous channels_last": lambda x, b, dev: x.contiguous(memory_format=cl),
            "empty channels_last": lambda x, b, dev: torch.empty(2, 3, 4, 5, memory_format=cl, device=dev),
            "empty_like preserves": lambda x, b, dev: torch.empty_like(x.contiguous(memory_format=cl)),
            "empty_like of a permuted view": lambda x, b, dev: torch.empty_like(x.transpose(1, 3)),
            "empty_like channels_last": lambda x, b, dev: torch.empty_like(x, memory_format=cl),
            "new_empty_strided": lambda x, b, dev: x.new_empty_strided((3, 4), (1, 3)),
            "new_empty_strided with gaps": lambda x, b, dev: x.new_empty_strided((3, 4), (9, 2)),
            "new_empty_strided overlapping": lambda x, b, dev: x.new_empty_strided((3, 4), (0, 1)),
            "a result with gaps, filled": lambda x, b, dev: x.new_empty_strided((3, 4), (9, 2)).fill_(2.5),
            "a result with gaps, added to": lambda x, b, dev: x.new_zeros((3, 4)).new_empty_strided(
                (2, 3), (7, 3)).fill_(1.5).add_(x[0, 0, :2, :3]),
            "clone of a permuted view": lambda x, b, dev: x.transpose(1, 3).clone(),
            "half of a permuted view": lambda x, b, dev: x.transpose(1, 2).half(),
            "to cpu channels_last": lambda x, b, dev: x.to("cpu", memory_format=cl),
            "relu (kernel)": lambda x, b, dev: F.relu(x.contiguous(memory_format=cl)),
            "add (kernel)": lambda x, b, dev: x.contiguous(memory_format=cl) + x.contiguous(memory_format=cl),
            "add bias (kernel)": lambda x, b, dev: x.contiguous(memory_format=cl) + b,
            "mul permuted (kernel)": lambda x, b, dev: x.transpose(0, 1) * 2,
            "mul mixed layouts (kernel)": lambda x, b, dev: x.contiguous(memory_format=cl) * x,
            "gelu half (kernel)": lambda x, b, dev: F.gelu(x.half().contiguous(memory_format=cl)),
            "abs (fallback)": lambda x, b, dev: x.contiguous(memory_format=cl).abs(),
            "conv2d (fallback)": lambda x, b, dev: F.conv2d(x.contiguous(memory_format=cl),
                                                            torch.ones(4, 3, 3, 3, device=dev)),
        }
        for name, fn in cases.items():
            want = fn(x, bias, "cpu")
            with flagos.track() as r:
                got = fn(x.to(d), bias.to(d), d)
            assert got.stride() == want.stride(), (name, got.stride(), want.stride())
            if "empty" not in name:
                torch.testing.assert_close(got.cpu(), want, msg=name)
            if "(kernel)" in name:
                assert r.calls("fallback") == 0, (name, r.to_dict())
        print("OK")
    """)


def test_sparse_tensors_get_a_clear_error():
    run_sim("""
        s = torch.eye(3).to_sparse()
        attempts = {
            "to": lambda: s.to(d),
            "to_sparse": lambda: torch.eye(3, device=d).to_sparse(),
            "to_sparse_csr": lambda: torch.eye(3, device=d).to_sparse_csr(),
            "copy_": lambda: torch.zeros(3, 3, device=d).copy_(s),
            "sparse_coo_tensor": lambda: torch.sparse_coo_tensor(
                torch.tensor([[0], [1]], device=d), torch.tensor([1.0], device=d), (2, 2)),
        }
        for name, fn in attempts.items():
            kind, message = error(fn)
            assert kind == "RuntimeError", (name, kind, message)
            assert "sparse tensors are not supported on flagos" in message and ".to_dense()" in message, (name, message)
        torch.testing.assert_close(s.to_dense().to(d).cpu(), torch.eye(3))   # the way out works
        print("OK")
    """)


@PATHS
def test_empty_views_in_a_fallback_touch_no_bytes(path):
    """An empty tensor's offset may lie past its 0-byte buffer; the host round trip must not
    read there (combinations' backward with an empty gradient did)."""
    run_sim(path=path, code="""
        x = torch.ones(1, device=d, requires_grad=True)
        out = torch.combinations(x, r=2)                       # shape (0, 2)
        (g,) = torch.autograd.grad(out, x, torch.randn(0, 2).to(d))
        assert g.cpu().tolist() == [0.0], g
        e = torch.empty(0, device=d)
        assert torch.cat([e, torch.ones(2, device=d)]).cpu().tolist() == [1.0, 1.0]
        print("OK")
    """)


@PATHS
def test_a_round_trip_moves_each_buffers_region_once(path):
    """The bytes a fallback moves are the region its views of a buffer cover, once: an empty
    view adds none, two views add the bytes between the first and the last, a buffer two
    written arguments view goes back once, and an empty written argument moves nothing."""
    run_sim(path=path, code="""
        x = torch.arange(8.0).to(d)
        for op in ("aten::cat", "aten::add_.Tensor", "aten::aminmax.out"):
            flagos.set_route(op, "fallback")
        cases = {
            "an empty view first": (lambda: torch.cat([x[6:6], x[1:3]]), "aten::cat", [1.0, 2.0], 8, 8),
            "an empty view after": (lambda: torch.cat([x[1:3], x[6:6]]), "aten::cat", [1.0, 2.0], 8, 8),
            "two views": (lambda: torch.cat([x[1:3], x[4:5]]), "aten::cat", [1.0, 2.0, 4.0], 16, 12),
        }
        for name, (call, op, want, to_host, to_device) in cases.items():
            with flagos.track() as report:
                got = call()
            row = report.op(op)
            assert got.cpu().tolist() == want, (name, got)
            assert (row["bytes_to_host"], row["bytes_to_device"]) == (to_host, to_device), (name, row)
        both = torch.zeros(2).to(d)
        with flagos.track() as report:
            torch.aminmax(x, out=(both[0], both[1]))     # two written views of one buffer
        assert both.cpu().tolist() == [0.0, 7.0]
        row = report.op("aten::aminmax.out")
        assert (row["bytes_to_host"], row["bytes_to_device"]) == (32 + 8, 8), row
        empty = torch.empty(0).to(d)
        with flagos.track() as report:
            assert empty.add_(1) is empty
        row = report.op("aten::add_.Tensor")
        assert (row["bytes_to_host"], row["bytes_to_device"]) == (0, 0), row
        with flagos.track() as report:
            x[2:4].add_(1)                                # a written view 8 bytes into its buffer
        row = report.op("aten::add_.Tensor")
        assert x.cpu().tolist() == [0.0, 1.0, 3.0, 4.0, 4.0, 5.0, 6.0, 7.0]
        assert (row["bytes_to_host"], row["bytes_to_device"]) == (8, 8), row
        with flagos.track() as report:                    # views move nothing and take no time
            x.detach(), torch.ops.aten.alias(x), x[1:3], x.view(2, 4)
        rows = report.to_dict()["ops"]
        assert rows and all(r["bytes_to_host"] == r["bytes_to_device"] == 0 and r["fallback_ns"] == 0
                            for r in rows), rows
        print("OK")
    """)


@PATHS
def test_ops_on_the_chips_kernels_move_no_bytes(path):
    """A call sim's kernels run (through the C fast path, or the runner's when it has none)
    counts as native and moves nothing between host and chip."""
    run_sim(path=path, code="""
        torch.manual_seed(0)
        x, y = torch.randn(4, 8).to(d), torch.randn(8, 3).to(d)
        with flagos.track() as report:
            x + x, x * 2, x.sum(1), x @ y, torch.softmax(x, 1), torch.relu(x)
            x.detach(), torch.ops.aten.alias(x)  # views: new wrappers, no kernel, no bytes
        rows = report.to_dict()["ops"]
        assert len(rows) == 8, rows
        for r in rows:
            assert r["calls"] == {"override": 0, "native": 1, "fallback": 0}, r
            assert r["bytes_to_host"] == r["bytes_to_device"] == r["fallback_ns"] == 0, r
        flagos.register_kernel("aten::sigmoid", lambda t: (t.neg().exp() + 1).reciprocal(), chip="sim")
        with flagos.track() as report:
            torch.sigmoid(x)                   # an override kernel: its own ops are counted apart
        r = report.op("aten::sigmoid")
        assert r["calls"] == {"override": 1, "native": 0, "fallback": 0}, r
        assert r["bytes_to_host"] == r["bytes_to_device"] == r["fallback_ns"] == 0, r
        print("OK")
    """)


@PATHS
def test_results_that_are_views_of_a_host_input_keep_their_values_and_layout(path):
    """unsafe_split and unsafe_chunk return views their schema does not mark: through the host
    round trip they are views of the host copy, at offsets past its start, uploaded as they are
    laid out (RNN code on the CPU uses them)."""
    run_sim(path=path, code="""
        x = torch.arange(12.0).reshape(6, 2)
        cases = {
            "unsafe_split": lambda t: torch.unsafe_split(t, 2),
            "unsafe_chunk": lambda t: torch.unsafe_chunk(t, 3, 1),
            "unsafe_split_with_sizes": lambda t: torch.ops.aten.unsafe_split_with_sizes(t.t(), [1, 2, 3], 1),
        }
        for name, op in cases.items():
            got, want = op(x.to(d)), op(x)
            assert [g.stride() for g in got] == [w.stride() for w in want], name
            assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), name
        print("OK")
    """)


@PATHS
def test_view_ops_take_keyword_arguments(path):
    """A view op called with its keyword-only arguments (torch.ops, as compilers and libraries
    call it) gets them as given: its layout is worked out on meta stand-ins, kwargs included."""
    run_sim(path=path, code="""
        x = torch.arange(8.0).reshape(2, 4)
        cases = {
            "expand, implicit": lambda t: torch.ops.aten.expand.default(t[:1], [3, 4], implicit=True),
            "as_strided_, storage_offset": lambda t: t.clone().as_strided_((2, 2), (1, 2), storage_offset=1),
        }
        for name, op in cases.items():
            got, want = op(x.to(d)), op(x)
            assert (got.shape, got.stride()) == (want.shape, want.stride()), name
            assert torch.equal(got.cpu(), want), name
        print("OK")
    """)


@PATHS
def test_a_fallbacks_counted_time_lies_within_the_call(path):
    """The host round trip's time is counted on its calls (the C round trip's or the runner's),
    and lies inside the call's own time on the host clock."""
    run_sim(path=path, code="""
        import time
        x = torch.randn(32, 32).to(d)
        flagos.set_route("aten::mm", "fallback")
        with flagos.track() as report:
            t0 = time.perf_counter_ns()
            x @ x
            outside = time.perf_counter_ns() - t0
        row = report.op("aten::mm")
        assert row["calls"]["fallback"] == 1 and 0 < row["fallback_ns"] <= outside, (row, outside)
        print("OK")
    """)


def test_set_to_memory_a_c_abi_chip_cannot_view_is_refused_with_the_way_out():
    """A host tensor or storage, another buffer's storage, a layout past the end of the buffer
    (the CPU would grow its storage): each refused with the message naming what to do, the
    tensor left as it was."""
    run_sim("""
        x = torch.arange(12.).to(d)
        other = torch.zeros(4).to(d)
        cases = {
            "a host tensor": (lambda: x.set_(torch.arange(3.)), 'to a storage on different device "cpu"'),
            "a host storage": (lambda: x.set_(torch.arange(3.).untyped_storage()), "own storage only"),
            "another buffer's storage": (lambda: x.set_(other.untyped_storage(), 0, (2,), (1,)),
                                         "use t.set_(other) or other.as_strided"),
            "past the buffer": (lambda: x.set_(x.untyped_storage(), 10, (3, 3), (3, 1)),
                                "cannot grow a buffer in place"),
        }
        for name, (call, words) in cases.items():
            message = error(call)
            assert message is not None and message[0] == "RuntimeError" and words in message[1], (name, message)
            assert (x.shape, x.stride(), x.storage_offset()) == ((12,), (1,), 0), name
        assert x.cpu().tolist() == list(range(12))
        print("OK")
    """)


@PATHS
def test_an_out_argument_resized_by_a_fallback_op_takes_the_cpus_shape(path):
    """out= of an op sim has no kernel for, resized by the op (grown, shrunk, re-laid), in a
    dtype the C round trip takes (float32) and one only the Python runner takes (complex64):
    the caller's own tensor comes back with the CPU's shape, strides and values."""
    run_sim(path=path, code="""
        for dtype in (torch.float32, torch.complex64):
            x = (torch.arange(6.) + 1j * torch.arange(6.)).to(dtype).reshape(2, 3)
            for start in [(6,), (4, 3), (3, 2), (2, 3), (8, 8)]:
                o_cpu = torch.zeros(start, dtype=dtype)
                o_dev = o_cpu.to(d)
                torch.cumsum(x, 1, out=o_cpu)
                got = torch.cumsum(x.to(d), 1, out=o_dev)
                assert got is o_dev, (dtype, start)
                assert (o_dev.shape, o_dev.stride()) == (o_cpu.shape, o_cpu.stride()), (dtype, start, o_dev.shape)
                assert torch.equal(o_dev.cpu(), o_cpu), (dtype, start)
        print("OK")
    """)


def test_unsafe_view_shares_the_tensors_memory_as_on_cpu():
    """aten::_unsafe_view (matmul and einsum reshape their results with it) is a view: the result
    shares the tensor's memory, on the chip as on CPU, for a contiguous tensor and for a strided
    one whose sizes allow it; sizes that no view of its strides can have get CPU's error."""
    run_sim('''
        errors = []
        for device in ("cpu", d):
            x = torch.arange(6.0).reshape(2, 3).to(device)
            y = torch.ops.aten._unsafe_view(x, (3, 2))
            t = torch.ops.aten._unsafe_view(x.t(), (3, 2))   # transposed: the same sizes are a view
            x.add_(1)
            assert y.cpu().flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], device
            assert t.stride() == (1, 3) and t.cpu().tolist() == [[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]], device
            errors.append(error(lambda: torch.ops.aten._unsafe_view(x.t(), (6,))))
        assert errors[0] == errors[1] and "view size is not compatible" in errors[0][1], errors
        print("OK")
    ''')


def test_result_layouts_with_an_expanded_operand_are_the_cpus_in_every_dtype():
    """An elementwise op over an expanded operand and a transposed one: PyTorch's meta kernel
    lays a float16 or bfloat16 result out otherwise than the CPU does; sim gives the CPU's
    layout in every dtype, whichever dtype met the layout first in the process."""
    run_sim('''
        def operands(dtype, device):
            a = torch.arange(8.).to(dtype).reshape(1, 8).to(device).expand(6, 8)
            b = torch.arange(48.).to(dtype).reshape(8, 6).to(device).t()
            return a, b

        for dtype in (torch.float16, torch.float32, torch.bfloat16, torch.float16):
            for op in (lambda x, y: torch.add(x, y, alpha=2), torch.mul, torch.maximum):
                want = op(*operands(dtype, "cpu"))
                got = op(*operands(dtype, d))
                assert got.stride() == want.stride(), (dtype, got.stride(), want.stride())
                assert torch.equal(got.cpu(), want), dtype
        print("OK")
    ''')


def test_detach_in_place_under_inference_mode_moves_nothing():
    """detach_ reaches the chip under inference mode; it changes autograd state only: the same
    tensor back, no host round trip, as on CPU."""
    run_sim("""
        x = torch.arange(6.0)
        with torch.inference_mode():
            fx = x.to(d)
            with flagos.track() as report:
                same = fx.detach_()
            ref = x.clone().detach_()
        assert same is fx and torch.equal(same.cpu(), ref)
        assert report.calls("fallback") == 0, report
        print("OK")
    """)
