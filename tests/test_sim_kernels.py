"""Every kernel in sim's table against plain PyTorch on CPU, in every dtype the table claims.

Each case runs one op on sim and on the CPU (in float64, rounded to the case's dtype: the
FlagGems way) and checks two things: the values, with FlagGems' per-dtype tolerances, and
that the op really ran on sim's kernel (the report counts a native call and no fallback), so
a kernel that silently falls back cannot pass. Inputs come contiguous, transposed, at a
storage offset, expanded (stride 0), broadcast, 0-dim and empty, and with extreme values:
large logits, infinities, NaN, fp16/bf16 rounding ties and denormals.

On the cpu chip this file runs itself again in a pytest process on sim, with bfloat16
declared native (FLAGOS_SIM_DTYPES), so `pytest tests` covers sim's kernels too; the same
cases run on the opencl chip from tests/test_opencl.py (dtypes its device lacks skipped).
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import CHIP, device_mode_only, run_pytest

import flagos

pytestmark = device_mode_only

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_BITS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # FLAGOS_DTYPE_BIT order
TOL = {torch.float32: dict(atol=1e-5, rtol=1.3e-6), torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
ALL_DTYPES = "float32,float16,bfloat16"
# The C-ABI chips whose kernel tables these cases cover.
KERNEL_CHIPS = ("sim", "opencl")
on_sim = pytest.mark.skipif(CHIP not in KERNEL_CHIPS,
                            reason="adapter kernels: runs on sim (see the test below) and opencl")


def run_this_file_on_sim(**env):
    """This file in a pytest process on sim, bfloat16 declared native; every case must pass."""
    proc = run_pytest([__file__], env={"FLAGOS_TEST_CHIP": "sim", "FLAGOS_SIM_DTYPES": ALL_DTYPES, **env})
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    # everything ran (bf16 included) but the two tests that start such runs
    assert re.fullmatch(r"\d+ passed, 2 skipped in .*", summary), summary


@pytest.mark.skipif(CHIP != "cpu", reason="started from the cpu run")
def test_sim_kernels_in_a_sim_process():
    run_this_file_on_sim()


@pytest.mark.skipif(CHIP != "cpu", reason="started from the cpu run")
def test_sim_kernels_through_the_python_runner_alone():
    """The same cases with the router's C fast path off (FLAGOS_TEST_RUNNER_ONLY, see
    tests/conftest.py): every op goes through the Python runner, whose kernel-table rules and
    round trip otherwise see only what the C path leaves to them (empty and 0-dim tensors,
    unusual arguments). Results, layouts and routes must be the same."""
    run_this_file_on_sim(FLAGOS_TEST_RUNNER_ONLY="1")


# ---- running one case ------------------------------------------------------------------

def arg(base, view=None):
    """An input: a CPU tensor and the view taken of it on both sides (after moving the
    contiguous base to the device, so the device tensor has the view's strides and offset)."""
    return base, view or (lambda t: t)


def _native_dtype(dtype):
    if dtype not in DTYPE_BITS:
        return
    if str(dtype).split(".")[1] not in flagos.info()["native_dtypes"]:
        pytest.skip(f"{dtype} is not native on this {CHIP} device"
                    + (" (FLAGOS_SIM_DTYPES)" if CHIP == "sim" else ""))


def run_case(op, fn, args, dtype, route="native", exact=False, outputs=None):
    """fn on sim vs on CPU. op: the router's name of the op fn calls (the report's row).
    exact: compare bit for bit with PyTorch's own CPU arithmetic in `dtype` instead of a
    float64 reference (rounding checks)."""
    _native_dtype(dtype)
    dev = flagos.device()
    host = [view(base.to(dtype)) for base, view in args]
    on_dev = [view(base.to(dtype).to(dev)) for base, view in args]
    try:  # the CPU's own result from the same views: its layout is the one to match
        same = fn(*host)
    except RuntimeError:  # an aten op that takes contiguous CPU inputs only (native_group_norm)
        same = None
    ref = same if exact else fn(*[t.double() for t in host])
    flagos.reset_report()
    with flagos.track() as report:
        out = fn(*on_dev)
    refs = ref if isinstance(ref, tuple) else (ref,)
    layouts = same if isinstance(same, tuple) else (same,) * len(refs)
    outs = out if isinstance(out, tuple) else (out,)
    row = report.op(op)
    assert row is not None, f"{op} did not reach the router:\n{report}"
    if route == "native":
        assert row["calls"]["native"] >= 1 and report.calls("fallback") == 0, str(report)
    else:
        assert row["calls"]["fallback"] >= 1, str(report)
    for i, (o, r, lay) in enumerate(zip(outs, refs, layouts)):
        if outputs is not None and i not in outputs:
            continue
        assert isinstance(o, flagos.FlagosTensor) and o.device == dev and o.dtype == dtype
        # laid out as PyTorch lays out the same op's result on the CPU (a slice in, ...)
        if lay is not None:
            assert (o.shape, o.stride()) == (lay.shape, lay.stride()), (o.stride(), lay.stride())
        got = o.cpu()
        if exact:
            assert got.shape == r.shape and torch.equal(got.view(torch.int16), r.view(torch.int16)), \
                (got, r)
        else:
            torch.testing.assert_close(got, r.to(dtype), equal_nan=True, **TOL[dtype])


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


# Layouts of a 2-d [6, 8] operand: (base shape, view)
LAYOUTS = {
    "contiguous": ((6, 8), None),
    "transposed": ((8, 6), lambda t: t.t()),
    "offset": ((7, 11), lambda t: t[1:, 2:10]),           # storage offset 13, row stride 11
    "expanded": ((1, 8), lambda t: t.expand(6, 8)),       # stride 0 along dim 0
}


def layout_arg(name, seed=0, scale=1.0, positive=False):
    shape, view = LAYOUTS[name]
    base = randn(*shape, scale=scale, seed=seed)
    return arg(base.abs() + 0.5 if positive else base, view)


# ---- the table is covered ------------------------------------------------------------

# kernel name -> the case functions below that exercise it
COVERED = {
    "aten::add.Tensor", "aten::sub.Tensor", "aten::mul.Tensor", "aten::div.Tensor",
    "aten::add.Scalar", "aten::sub.Scalar", "aten::mul.Scalar", "aten::div.Scalar",
    "aten::neg", "aten::relu", "aten::silu", "aten::sigmoid", "aten::tanh", "aten::exp",
    "aten::gelu", "aten::mm", "aten::bmm", "aten::addmm", "aten::sum.dim_IntList",
    "aten::mean.dim", "aten::_softmax", "aten::_safe_softmax", "aten::native_layer_norm", "aten::convolution",
    "aten::native_group_norm", "aten::upsample_nearest2d", "aten::embedding", "aten::cat",
}


# The dtypes each chip's table claims: those of DTYPES are tested here; opencl's float64
# kernels are tested in tests/test_opencl.py.
CLAIMED = {"sim": {"float32", "float16", "bfloat16"}, "opencl": {"float32", "float16", "float64"}}


@on_sim
def test_every_kernel_and_dtype_of_the_table_is_covered():
    table = dict(flagos.chips.profile(CHIP).adapter.kernels())
    assert set(table) == COVERED, "kernels without a test here: " + ", ".join(sorted(set(table) - COVERED))
    names = flagos.chips.adapter.DTYPE_NAMES
    for op, mask in table.items():
        claimed = {name for bit, name in enumerate(names) if mask >> bit & 1}
        assert claimed == CLAIMED[CHIP], (op, claimed)


# ---- elementwise ------------------------------------------------------------------------

BINARY = {
    # router op, kernel, fn
    "add": ("aten::add.Tensor", lambda a, b: torch.add(a, b, alpha=2)),
    "sub": ("aten::sub.Tensor", lambda a, b: torch.sub(a, b, alpha=3)),
    "mul": ("aten::mul.Tensor", lambda a, b: a * b),
    "div": ("aten::div.Tensor", lambda a, b: a / b),
}


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", BINARY)
def test_binary_tensor_layouts(name, layout, dtype):
    op, fn = BINARY[name]
    run_case(op, fn, [layout_arg(layout, seed=1), layout_arg("transposed", seed=2, positive=True)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", [((6, 8), (8,)), ((6, 1), (1, 8)), ((8,), (6, 8)), ((6, 8), ()),
                                    ((), ()), ((0, 8), (8,)), ((2, 1, 4), (3, 1)),
                                    ((2, 3, 4, 8), (8,)), ((4, 1), (2, 3, 1, 5))], ids=str)
@pytest.mark.parametrize("name", BINARY)
def test_binary_tensor_broadcasting(name, shapes, dtype):
    op, fn = BINARY[name]
    a, b = randn(*shapes[0], seed=3), randn(*shapes[1], seed=4).abs() + 0.5
    run_case(op, fn, [arg(a), arg(b)], dtype)


SCALAR = {
    # id: (router op, fn); Python numbers and 0-dim CPU tensors reach sim's .Scalar kernels
    "add.Scalar": ("aten::add.Scalar", lambda a: torch.ops.aten.add.Scalar(a, 2.5, alpha=2)),
    "add.Scalar alpha 1": ("aten::add.Scalar", lambda a: torch.ops.aten.add.Scalar(a, 2.5)),
    "add number": ("aten::add.Tensor", lambda a: a + 1.25),
    "sub.Scalar": ("aten::sub.Scalar", lambda a: torch.ops.aten.sub.Scalar(a, 2.5, alpha=2)),
    "sub.Scalar alpha 1": ("aten::sub.Scalar", lambda a: torch.ops.aten.sub.Scalar(a, 2.5)),
    "sub number": ("aten::sub.Tensor", lambda a: a - 1.75),
    "sub 0-dim cpu": ("aten::sub.Tensor", lambda a: a - torch.tensor(0.5, dtype=a.dtype)),
    "rsub number": ("aten::sub.Tensor", lambda a: torch.sub(a, 3.0, alpha=-1)),
    "mul.Scalar": ("aten::mul.Scalar", lambda a: torch.ops.aten.mul.Scalar(a, -3.0)),
    "mul number": ("aten::mul.Tensor", lambda a: a * 0.3),
    "div.Scalar": ("aten::div.Scalar", lambda a: torch.ops.aten.div.Scalar(a, 4.0)),
    "div number": ("aten::div.Tensor", lambda a: a / 3.0),
}


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SCALAR)
def test_binary_scalar(name, layout, dtype):
    op, fn = SCALAR[name]
    run_case(op, fn, [layout_arg(layout, seed=5)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (5,), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("name", ["add.Scalar", "sub.Scalar", "mul.Scalar", "div.Scalar"])
def test_scalar_kernels_on_0dim_and_empty(name, shape, dtype):
    op, fn = SCALAR[name]
    run_case(op, fn, [arg(randn(*shape, seed=6))], dtype)


UNARY = {
    "neg": ("aten::neg", lambda x: -x),
    "relu": ("aten::relu", torch.relu),
    "silu": ("aten::silu", F.silu),
    "sigmoid": ("aten::sigmoid", torch.sigmoid),
    "tanh": ("aten::tanh", torch.tanh),
    "exp": ("aten::exp", torch.exp),
    "gelu": ("aten::gelu", F.gelu),
    "gelu_tanh": ("aten::gelu", lambda x: F.gelu(x, approximate="tanh")),
}


# Views with gaps between their elements (not dense), some along a dim of size 2: PyTorch lays
# the result of an elementwise op on them out contiguously in the views' dim order.
GAPPED = {
    "every other row": ((4, 6), lambda t: t[::2]),                     # [2, 6], strides (12, 1)
    "every other row, transposed": ((4, 6), lambda t: t[::2].t()),     # [6, 2], strides (1, 12)
    "every third column": ((2, 2, 6), lambda t: t[:, :, ::3]),         # [2, 2, 2], strides (12, 6, 3)
}


@on_sim
@pytest.mark.parametrize("gap", GAPPED)
@pytest.mark.parametrize("name", ["mul", "exp"])
def test_elementwise_results_of_gapped_views_are_laid_out_as_on_cpu(name, gap):
    shape, view = GAPPED[gap]
    op, fn = BINARY[name] if name in BINARY else UNARY[name]
    inputs = [arg(randn(*shape, seed=70), view)]
    if name in BINARY:
        inputs.append(arg(randn(*shape, seed=71), view))
    run_case(op, fn, inputs, torch.float32)


# Views with size-1 dims, whose strides PyTorch leaves free: TensorIterator gives the result's
# size-1 dims strides of its own when the operands are broadcast or one is a Python number (it
# sorts the dims by the operands' strides), and keeps the operands' layout when they are alike
# (a channels_last order with size-1 dims is channels_last).
SIZE_ONE = {
    "size-1 dim at a stride of its own": lambda t: t.as_strided((4, 1, 5), (1, 7, 4)),
    "contiguous, size-1 dim at stride 1": lambda t: t.as_strided((1, 4), (1, 1)),
    "1x1 feature map, channels_last": lambda t: t.as_strided((2, 3, 1, 1), (3, 1, 3, 3)),
    "channels_last order, size-1 dims": lambda t: t.as_strided((1, 2, 1, 2), (1, 1, 1, 2)),
    "column, transposed": lambda t: t.as_strided((3, 1), (1, 3)),
}
SIZE_ONE_CALLS = {
    "neg": ("aten::neg", lambda a, b: -a),
    "a * a": ("aten::mul.Tensor", lambda a, b: a * a),
    "plus 1": ("aten::add.Tensor", lambda a, b: a + 1),
    "2.5 times": ("aten::mul.Tensor", lambda a, b: 2.5 * a),
    "broadcast": ("aten::sub.Tensor", lambda a, b: a - b),
}


@on_sim
@pytest.mark.parametrize("call", SIZE_ONE_CALLS)
@pytest.mark.parametrize("view", SIZE_ONE)
def test_elementwise_results_of_views_with_size_1_dims_are_laid_out_as_on_cpu(view, call):
    op, fn = SIZE_ONE_CALLS[call]
    a = arg(randn(64, seed=72), SIZE_ONE[view])
    last = SIZE_ONE[view](torch.empty(64)).shape[-1]
    run_case(op, fn, [a, arg(randn(last, seed=73))], torch.float32)


@on_sim
@pytest.mark.parametrize("view", SIZE_ONE)
def test_a_fallbacks_result_keeps_the_cpus_strides_of_size_1_dims(view):
    """A result the host computed (here remainder, which sim has no kernel for) keeps the CPU
    result's layout, the free strides of its size-1 dims included."""
    run_case("aten::remainder.Scalar", lambda a: torch.remainder(a, 0.75),
             [arg(randn(64, seed=74), SIZE_ONE[view])], torch.float32, route="fallback")


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", UNARY)
def test_unary_layouts(name, layout, dtype):
    op, fn = UNARY[name]
    run_case(op, fn, [layout_arg(layout, seed=7, scale=2.0)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)], ids=str)
@pytest.mark.parametrize("name", UNARY)
def test_unary_0dim_and_empty(name, shape, dtype):
    op, fn = UNARY[name]
    run_case(op, fn, [arg(randn(*shape, seed=8))], dtype)


EXTREMES = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 30.0, -30.0, 88.0, -88.0, 1e4, -1e4,
                         math.inf, -math.inf, math.nan])


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", UNARY)
def test_unary_extreme_values(name, dtype):
    op, fn = UNARY[name]
    run_case(op, fn, [arg(EXTREMES)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", BINARY)
def test_binary_extreme_values(name, dtype):
    op, fn = BINARY[name]
    a = torch.tensor([1.0, 0.0, -1.0, math.inf, -math.inf, math.nan, 6e4, -6e4, 1.0, 0.0])
    b = torch.tensor([0.0, 0.0, 0.0, 1.0, math.inf, 1.0, 6e4, 6e4, math.inf, -1.0])
    run_case(op, fn, [arg(a), arg(b)], dtype)


# ---- rounding to the output dtype ------------------------------------------------------------

@on_sim
def test_float16_results_round_to_nearest_even():
    # a + b is exact in float32; storing it as float16 has to round it, ties to even:
    # 1025.5 lies halfway between 1025 and 1026 -> 1026 (truncation gives 1025); 1024.5 -> 1024;
    # 1025.75 -> 1026; 65520 is halfway between 65504 and 2^16 -> inf; 65519 -> 65504;
    # 2051 is halfway between 2050 and 2052 (float16 steps by 2 there) -> 2052.
    a = torch.tensor([1025.0, 1024.0, 1025.0, -1025.0, 65504.0, 65504.0, 2050.0, 1.0])
    b = torch.tensor([0.5, 0.5, 0.75, -0.5, 16.0, 15.0, 1.0, 3 * 2.0 ** -11])
    run_case("aten::add.Tensor", torch.add, [arg(a), arg(b)], torch.float16, exact=True)
    out = (a.half().to(flagos.device()) + b.half().to(flagos.device())).cpu()
    assert out.tolist() == [1026.0, 1024.0, 1026.0, -1026.0, math.inf, 65504.0, 2052.0,
                            1.0 + 2.0 ** -9]


@on_sim
def test_float16_subnormal_results_round_to_nearest_even():
    # 3 * 2^-24 (a subnormal) times 0.5 is 1.5 units of 2^-24: a tie, rounded to 2 units;
    # 2^-14 * 2^-3 is an exact subnormal; 2^-25 (half the smallest) rounds to 0 (even).
    a = torch.tensor([3 * 2.0 ** -24, 2.0 ** -14, 2.0 ** -24, 5 * 2.0 ** -24, -3 * 2.0 ** -24])
    b = torch.tensor([0.5, 0.125, 0.5, 0.5, 0.5])
    run_case("aten::mul.Tensor", torch.mul, [arg(a), arg(b)], torch.float16, exact=True)
    out = (a.half().to(flagos.device()) * b.half().to(flagos.device())).cpu().float()
    assert out.tolist() == [2 * 2.0 ** -24, 2.0 ** -17, 0.0, 2 * 2.0 ** -24, -2 * 2.0 ** -24]


@on_sim
def test_bfloat16_results_round_to_nearest_even():
    # bf16 has 8 significant bits: between 256 and 512 its values are 2 apart.
    # 257 -> 256 (tie, even), 259 -> 260 (tie, even), 258.5 -> 258, 1e-39 + 0 stays a denormal.
    a = torch.tensor([256.0, 258.0, 258.0, -258.0, 1e-39, 3.0e38])
    b = torch.tensor([1.0, 1.0, 0.5, -1.0, 0.0, 3.0e38])
    run_case("aten::add.Tensor", torch.add, [arg(a), arg(b)], torch.bfloat16, exact=True)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_denormal_inputs_and_results(dtype):
    tiny = {torch.float32: 1e-40, torch.float16: 2.0 ** -20, torch.bfloat16: 1e-39}[dtype]
    a = torch.tensor([tiny, -tiny, 3 * tiny, tiny, 0.0])
    b = torch.tensor([1.0, 2.0, 0.5, -tiny, tiny])
    run_case("aten::mul.Tensor", torch.mul, [arg(a), arg(b)], dtype, exact=True)
    run_case("aten::add.Tensor", torch.add, [arg(a), arg(b)], dtype, exact=True)


# ---- matrix products ----------------------------------------------------------------------

MAT_LAYOUTS = {  # [M, K] = [6, 8] operands; [K, N] = [8, 5] ones are built by their transposes
    "contiguous": lambda shape: ((shape), None),
    "transposed": lambda shape: ((shape[1], shape[0]), lambda t: t.t()),
    "offset": lambda shape: ((shape[0] + 2, shape[1] + 3), lambda t: t[2:, 1:1 + shape[1]]),
}


def mat_arg(shape, layout, seed):
    base_shape, view = MAT_LAYOUTS[layout](shape)
    return arg(randn(*base_shape, seed=seed), view)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("la", MAT_LAYOUTS)
@pytest.mark.parametrize("lb", MAT_LAYOUTS)
def test_mm(la, lb, dtype):
    run_case("aten::mm", torch.mm, [mat_arg((6, 8), la, 10), mat_arg((8, 5), lb, 11)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", [((0, 8), (8, 5)), ((6, 0), (0, 5)), ((6, 8), (8, 0)),
                                    ((1, 1), (1, 1)), ((20, 70), (70, 67)), ((130, 70), (70, 67))],
                         ids=str)
def test_mm_shapes(shapes, dtype):
    # 130 x 70 @ 70 x 67 crosses the kernel's 64 x 64 x 64 blocks in every direction, with
    # whole blocks of rows; 20 x 70 @ 70 x 67 a partial one
    run_case("aten::mm", torch.mm, [arg(randn(*shapes[0], seed=12)), arg(randn(*shapes[1], seed=13))],
             dtype)


BMM_LAYOUTS = {
    "contiguous": ((2, 6, 8), None),
    "transposed": ((2, 8, 6), lambda t: t.transpose(1, 2)),
    "batch offset": ((3, 6, 8), lambda t: t[1:]),
    "expanded batch": ((1, 6, 8), lambda t: t.expand(2, 6, 8)),
}


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", BMM_LAYOUTS)
def test_bmm(layout, dtype):
    shape, view = BMM_LAYOUTS[layout]
    b = arg(randn(2, 5, 8, seed=15), lambda t: t.transpose(1, 2))  # [2, 8, 5], transposed
    run_case("aten::bmm", torch.bmm, [arg(randn(*shape, seed=14), view), b], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("self_shape", [(5,), (1, 5), (6, 1), (6, 5)], ids=str)
@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0.0, 1.5)])
def test_addmm(self_shape, beta, alpha, dtype):
    run_case("aten::addmm", lambda s, a, b: torch.addmm(s, a, b, beta=beta, alpha=alpha),
             [arg(randn(*self_shape, seed=16)), mat_arg((6, 8), "transposed", 17),
              mat_arg((8, 5), "offset", 18)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_addmm_beta_zero_ignores_nan_in_self(dtype):
    run_case("aten::addmm", lambda s, a, b: torch.addmm(s, a, b, beta=0.0),
             [arg(torch.full((6, 5), math.nan)), arg(randn(6, 8, seed=19)), arg(randn(8, 5, seed=20))],
             dtype)


# ---- reductions -------------------------------------------------------------------------------

REDUCTIONS = {
    "sum": ("aten::sum.dim_IntList", torch.sum),
    "mean": ("aten::mean.dim", torch.mean),
}
DIMS = [(1, False), (0, True), (-1, False), ((0, 1), False), ((0, 1), True), ((1, 0), False),
        ([], False)]


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset", "expanded"])
@pytest.mark.parametrize("dim,keepdim", DIMS, ids=str)
@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions(name, dim, keepdim, layout, dtype):
    op, fn = REDUCTIONS[name]
    run_case(op, lambda x: fn(x, dim=dim, keepdim=keepdim), [layout_arg(layout, seed=21)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim", [((2, 3, 4), (0, 2)), ((2, 3, 4), (1,)), ((2, 3, 4), (-2, -1)),
                                       ((), 0), ((0, 4), 0), ((0, 4), 1), ((3, 0), 1)], ids=str)
@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions_shapes(name, shape, dim, dtype):
    # mean divides by the number of reduced elements (4 for dim 1 of [3, 4]), never by numel;
    # the mean of nothing is NaN, the sum of nothing 0
    op, fn = REDUCTIONS[name]
    run_case(op, lambda x: fn(x, dim=dim), [arg(randn(*shape, seed=22))], dtype)


@on_sim
def test_mean_divides_by_the_reduced_count():
    x = torch.arange(12.0).view(3, 4).to(flagos.device())
    with flagos.track() as r:
        out = x.mean(dim=1).cpu()
    assert out.tolist() == [1.5, 5.5, 9.5]  # (0+1+2+3)/4, ...
    assert r.op("aten::mean.dim")["calls"]["native"] == 1


# ---- softmax --------------------------------------------------------------------------------

@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset", "expanded"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax(dim, layout, dtype):
    run_case("aten::_softmax", lambda x: torch.softmax(x, dim), [layout_arg(layout, seed=23, scale=3.0)],
             dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_large_logits(dtype):
    # exp(1000) overflows even in double: only subtracting the row's max keeps these finite
    x = torch.tensor([[1000.0, 999.0, -1000.0, 0.0], [5e3, 5e3, 5e3, 5e3],
                      [-math.inf, 0.0, 1.0, -math.inf], [-5e3, -5e3 - 1, -5e3 - 2, -5e3]])
    run_case("aten::_softmax", lambda t: torch.softmax(t, -1), [arg(x)], dtype)
    out = torch.softmax(x.to(dtype).to(flagos.device()), -1).cpu().float()
    assert torch.isfinite(out).all() and out.sum(-1).sub(1).abs().max() < TOL[dtype]["rtol"] * 4


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_rows_of_nan_and_minus_inf(dtype):
    x = torch.tensor([[-math.inf, -math.inf, -math.inf], [1.0, math.nan, 2.0], [0.0, 1.0, 2.0]])
    run_case("aten::_softmax", lambda t: torch.softmax(t, 1), [arg(x)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim", [((0, 5), 1), ((4, 0), 1), ((4, 0), 0), ((2, 3, 4), 1)], ids=str)
def test_softmax_shapes(shape, dim, dtype):
    run_case("aten::_softmax", lambda t: torch.softmax(t, dim), [arg(randn(*shape, seed=24))], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset"])
@pytest.mark.parametrize("dim", [0, -1, -2])  # -2: the lowest dim PyTorch wraps, on sim's kernel too
def test_safe_softmax(dim, layout, dtype):
    run_case("aten::_safe_softmax", lambda x: torch.ops.aten._safe_softmax(x, dim),
             [layout_arg(layout, seed=25, scale=3.0)], dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_safe_softmax_gives_zeros_for_a_row_of_minus_inf_only(dtype):
    # attention's fully masked rows: _softmax gives NaN there, _safe_softmax zeros
    x = torch.tensor([[-math.inf, -math.inf, -math.inf], [1.0, math.nan, 2.0], [0.0, -math.inf, 2.0],
                      [-math.inf, -math.inf, 5.0]])
    run_case("aten::_safe_softmax", lambda t: torch.ops.aten._safe_softmax(t, 1), [arg(x)], dtype)
    out = torch.ops.aten._safe_softmax(x.to(dtype).to(flagos.device()), 1).cpu()
    assert torch.equal(out[0], torch.zeros(3, dtype=dtype)) and out[1].isnan().all()


@on_sim
def test_masked_attention_with_a_fully_masked_row_matches_cpu():
    # scaled_dot_product_attention's math path calls _safe_softmax: a query that may attend
    # to nothing gets zeros, on the chip's kernel as on CPU
    q, k, v = (randn(1, 2, 4, 8, seed=s) for s in (26, 27, 28))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    mask[2] = False
    dev = flagos.device()
    flagos.reset_report()
    with flagos.track() as report:
        out = F.scaled_dot_product_attention(q.to(dev), k.to(dev), v.to(dev), attn_mask=mask.to(dev))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    row = report.op("aten::_safe_softmax")
    assert row is not None and row["calls"]["native"] == 1 and row["calls"]["fallback"] == 0, str(report)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.cpu()[0, :, 2], torch.zeros(2, 8))


@on_sim
def test_softmax_of_a_0dim_tensor_takes_the_fallback():
    # flagos hands sim no 0-d softmax (a design choice of the runner): correct, and counted
    run_case("aten::_softmax", lambda t: torch.softmax(t, 0), [arg(torch.tensor(3.0))],
             torch.float32, route="fallback")


# ---- layer norm -------------------------------------------------------------------------------

@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset"])
def test_layer_norm(layout, affine, dtype):
    weight = arg(randn(8, seed=26)) if affine != "none" else None
    bias = arg(randn(8, seed=27)) if affine == "both" else None
    args = [layout_arg(layout, seed=25, scale=3.0)] + [a for a in (weight, bias) if a]

    def fn(x, *wb):
        w = wb[0] if wb else None
        b = wb[1] if len(wb) > 1 else None
        return torch.ops.aten.native_layer_norm(x, [8], w, b, 1e-5)  # out, mean, rstd
    run_case("aten::native_layer_norm", fn, args, dtype)


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_over_two_dims_and_large_eps(dtype):
    run_case("aten::native_layer_norm",
             lambda x, w, b: F.layer_norm(x, (3, 4), w, b, eps=0.5),
             [arg(randn(2, 3, 4, seed=28, scale=0.5)), arg(randn(3, 4, seed=29)),
              arg(randn(3, 4, seed=30))], dtype)


# ---- convolution ------------------------------------------------------------------------------

CONV_CASES = {
    # id: (input shape, weight shape, bias, stride, padding, dilation, groups)
    "3x3 pad 1": ((2, 4, 9, 7), (6, 4, 3, 3), True, 1, 1, 1, 1),
    "no bias": ((1, 3, 8, 8), (5, 3, 3, 3), False, 1, 1, 1, 1),
    "stride 2": ((2, 4, 9, 8), (6, 4, 3, 3), True, 2, 1, 1, 1),
    "1x1": ((1, 8, 5, 6), (4, 8, 1, 1), True, 1, 0, 1, 1),
    "dilated, rect": ((1, 3, 10, 9), (4, 3, 3, 2), True, (2, 1), (2, 0), (2, 3), 1),
    "groups 2": ((2, 4, 6, 6), (6, 2, 3, 3), True, 1, 1, 1, 2),
    "depthwise": ((1, 4, 7, 7), (4, 1, 3, 3), False, (1, 2), 1, 1, 4),
    # more output channels than opencl's tile of 8, and not a multiple of it, per group
    "20 out, groups 2": ((1, 4, 6, 5), (20, 2, 3, 3), True, 1, 1, 1, 2),
    "one output": ((1, 3, 3, 3), (1, 3, 3, 3), True, 1, 0, 1, 1),  # a window the input's size
    "1x1 depthwise": ((1, 4, 5, 5), (4, 1, 1, 1), True, 1, 0, 1, 4),  # one tap per output
}
CONV_VIEWS = {
    "contiguous": None,
    "offset": "offset",        # input sliced out of a larger tensor: storage offset, row strides
    "transposed": "transposed",  # input with H and W swapped in memory
}


def conv_input(shape, view, seed):
    if view == "offset":
        n, c, h, w = shape
        return arg(randn(n, c + 1, h + 2, w + 3, seed=seed), lambda t: t[:, 1:, 1:h + 1, 2:w + 2])
    if view == "transposed":
        n, c, h, w = shape
        return arg(randn(n, c, w, h, seed=seed), lambda t: t.transpose(2, 3))
    return arg(randn(*shape, seed=seed))


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("view", CONV_VIEWS)
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d(case, view, dtype):
    shape, wshape, bias, stride, padding, dilation, groups = CONV_CASES[case]
    args = [conv_input(shape, CONV_VIEWS[view], 40), arg(randn(*wshape, seed=41, scale=0.3))]
    if bias:
        args.append(arg(randn(wshape[0], seed=42)))

    def fn(x, w, b=None):
        return F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    run_case("aten::convolution", fn, args, dtype)


@on_sim
def test_conv2d_declined_cases_take_the_fallback():
    # transposed convolution and 1-d convolution are outside the convention: CPU's results
    run_case("aten::convolution", lambda x, w: F.conv_transpose2d(x, w, stride=2),
             [arg(randn(1, 4, 5, 5, seed=43)), arg(randn(4, 3, 3, 3, seed=44))], torch.float32,
             route="fallback")
    run_case("aten::convolution", lambda x, w: F.conv1d(x, w, padding=1),
             [arg(randn(2, 3, 9, seed=45)), arg(randn(4, 3, 3, seed=46))], torch.float32,
             route="fallback")


@on_sim
def test_conv2d_shape_errors_are_pytorchs():
    dev = flagos.device()
    x, w = randn(1, 4, 6, 6, seed=49), randn(3, 2, 3, 3, seed=50)  # 4 channels, weight wants 2
    with pytest.raises(RuntimeError) as cpu:
        F.conv2d(x, w)
    with pytest.raises(RuntimeError) as chip:
        F.conv2d(x.to(dev), w.to(dev))
    assert str(chip.value) == str(cpu.value)


@on_sim
@pytest.mark.parametrize("fn,shapes", [
    (torch.mm, ((3, 4), (5, 4))),                    # inner dims differ
    (torch.bmm, ((2, 3, 4), (2, 5, 4))),             # inner dims differ, the last ones equal
    (torch.bmm, ((2, 3, 4), (3, 4, 5))),             # batches differ
    (torch.bmm, ((2, 3, 4), (3, 4, 2))),             # batches differ, one's batch the other's last dim
    (torch.bmm, ((3, 4), (3, 4, 5))),                # a 2-d operand
    (torch.bmm, ((2, 3, 4), (2, 4))),                # a 2-d second operand whose sizes fit
    (lambda s, a, b: torch.addmm(s, a, b), ((3, 5), (3, 4), (5, 5))),
], ids=["mm", "bmm inner", "bmm batch", "bmm batch last", "bmm 2-d", "bmm 2-d second", "addmm"])
def test_matmul_shape_errors_are_pytorchs(fn, shapes):
    """A product sim's kernel cannot take is refused with PyTorch's own error, not the
    adapter's: the kernel-table rules hand such calls to the host, which raises it."""
    dev = flagos.device()
    args = [randn(*shape, seed=60 + i) for i, shape in enumerate(shapes)]
    with pytest.raises(RuntimeError) as cpu:
        fn(*args)
    with pytest.raises(RuntimeError) as chip:
        fn(*[t.to(dev) for t in args])
    assert type(chip.value) is type(cpu.value) and str(chip.value) == str(cpu.value)


@on_sim
@pytest.mark.parametrize("fn", [torch.softmax, torch.ops.aten._safe_softmax], ids=["softmax", "_safe_softmax"])
@pytest.mark.parametrize("dim", [2, -3, 5])
def test_a_softmax_dim_out_of_range_is_pytorchs_error(fn, dim):
    dev = flagos.device()
    x = randn(3, 4, seed=61)
    with pytest.raises(IndexError) as cpu:
        fn(x, dim)
    with pytest.raises(IndexError) as chip:
        fn(x.to(dev), dim)
    assert str(chip.value) == str(cpu.value)


@on_sim
@pytest.mark.parametrize("shape, normalized", [((3, 4), (5,)), ((2, 3, 4), (2, 4)), ((3, 4), (4,))],
                         ids=["last dim differs", "leading dim differs", "fits"])
def test_layer_norm_runs_on_sim_when_its_shape_fits_and_fails_as_pytorch_when_not(shape, normalized):
    dev = flagos.device()
    x = randn(*shape, seed=62)
    if shape[-len(normalized):] == normalized:
        flagos.reset_report()
        torch.testing.assert_close(F.layer_norm(x.to(dev), normalized).cpu(), F.layer_norm(x, normalized))
        assert flagos.fallback_report().op("aten::native_layer_norm")["calls"] == {"native": 1, "override": 0, "fallback": 0}
        return
    with pytest.raises(RuntimeError) as cpu:
        F.layer_norm(x, normalized)
    with pytest.raises(RuntimeError) as chip:
        F.layer_norm(x.to(dev), normalized)
    assert str(chip.value) == str(cpu.value)


@on_sim
@pytest.mark.parametrize("call", [lambda t: torch.ops.aten._safe_softmax(t, 1, torch.float64),
                                  lambda t: torch.ops.aten._safe_softmax(t, 1, dtype=torch.float64)],
                         ids=["positional", "keyword"])
def test_safe_softmax_to_another_dtype_matches_cpu(call):
    """_safe_softmax's dtype may come positionally or by keyword; either way the result has it."""
    x = randn(3, 4, seed=68)
    got, want = call(x.to(flagos.device())), call(x)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), want)


@on_sim
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "weight and bias"])
def test_layer_norm_of_an_empty_batch_runs_on_sims_kernel(affine):
    """An empty input is the Python runner's (the router's C path leaves empty tensors to it):
    its kernel-table rule takes layer_norm with or without weight and bias, as the C path's
    does for the rest, and the result is CPU's."""
    dev = flagos.device()
    x = randn(0, 4, seed=65)
    params = (randn(4, seed=66), randn(4, seed=67)) if affine else (None, None)
    flagos.reset_report()
    got = F.layer_norm(x.to(dev), (4,), *[p if p is None else p.to(dev) for p in params])
    assert got.device == dev and got.shape == (0, 4)
    torch.testing.assert_close(got.cpu(), F.layer_norm(x, (4,), *params))
    assert flagos.fallback_report().op("aten::native_layer_norm")["calls"] == {"native": 1, "override": 0, "fallback": 0}


@on_sim
def test_rules_of_the_runner_for_what_the_routers_c_path_leaves_to_it():
    """Empty inputs and unusual arguments reach the Python runner's kernel-table rules: a bmm of
    an empty batch has CPU's shape; a weight of the wrong shape for an empty layer_norm, and a
    convolution of stride 0, get PyTorch's errors, not the kernel's."""
    dev = flagos.device()
    a, b = randn(0, 3, 4, seed=69), randn(0, 4, 5, seed=70)
    got = torch.bmm(a.to(dev), b.to(dev))
    assert got.shape == (0, 3, 5) and got.device == dev
    calls = [lambda x, w: F.layer_norm(x, (4,), w), lambda x, w: F.conv2d(x, w, stride=0)]
    inputs = [(randn(0, 4, seed=71), randn(5, seed=72)), (randn(1, 2, 5, 5, seed=73), randn(3, 2, 3, 3, seed=74))]
    for call, args in zip(calls, inputs):
        with pytest.raises(RuntimeError) as cpu:
            call(*args)
        with pytest.raises(RuntimeError) as chip:
            call(*[t.to(dev) for t in args])
        assert str(chip.value) == str(cpu.value)


@on_sim
def test_convolution_with_one_element_parameter_lists_matches_cpu():
    """aten.convolution takes stride, padding and dilation of one element for every spatial dim
    (PyTorch expands them); sim's rule leaves such calls to the host, which does the same."""
    dev = flagos.device()
    x, w = randn(1, 2, 5, 5, seed=63), randn(3, 2, 3, 3, seed=64)
    args = (None, [2], [1], [1], False, [0], 1)
    got = torch.ops.aten.convolution(x.to(dev), w.to(dev), *args)
    torch.testing.assert_close(got.cpu(), torch.ops.aten.convolution(x, w, *args))


@on_sim
@pytest.mark.parametrize("index_dims, route", [(7, "native"), (8, "fallback")])
def test_embedding_of_indices_up_to_seven_dims_runs_on_sim_and_eight_on_the_host(index_dims, route):
    """The output has one dim more than the indices, and a kernel takes at most 8."""
    dev = flagos.device()
    weight = randn(10, 3, seed=65)
    indices = torch.randint(0, 10, (2,) * index_dims, generator=torch.Generator().manual_seed(66))
    flagos.reset_report()
    got = F.embedding(indices.to(dev), weight.to(dev))
    assert torch.equal(got.cpu(), F.embedding(indices, weight))
    assert flagos.fallback_report().op("aten::embedding")["calls"][route] == 1


# ---- group norm ---------------------------------------------------------------------------------

GROUP_NORM_VIEWS = {
    "contiguous": ((2, 6, 5, 4), None),
    "offset": ((2, 7, 6, 4), lambda t: t[:, 1:, 1:]),        # rows of the spatial dims merge
    "3-d": ((3, 4, 10), None),
    "channel stride": ((2, 12, 5, 4), lambda t: t[:, ::2]),
}


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("view", GROUP_NORM_VIEWS)
def test_group_norm(view, affine, dtype):
    shape, fn_view = GROUP_NORM_VIEWS[view]
    c = {"contiguous": 6, "offset": 6, "3-d": 4, "channel stride": 6}[view]
    args = [arg(randn(*shape, seed=51, scale=2.0) + 0.5, fn_view)]
    if affine:
        args += [arg(randn(c, seed=52)), arg(randn(c, seed=53))]
    groups = 2

    def fn(x, w=None, b=None):
        n = x.shape[0]
        return torch.ops.aten.native_group_norm(x, w, b, n, c, x[0, 0].numel(), groups, 1e-5)
    run_case("aten::native_group_norm", fn, args, dtype)


@on_sim
def test_group_norm_functional_and_declined_layouts():
    # F.group_norm as torch.nn.GroupNorm calls it
    run_case("aten::native_group_norm", lambda t, w, b: F.group_norm(t, 4, w, b, eps=1e-6),
             [arg(randn(2, 8, 6, 6, seed=55)), arg(randn(8, seed=54)), arg(randn(8, seed=58))],
             torch.float32)
    # spatial dims that do not merge into one stride (F.group_norm copies them first): the
    # fallback, which answers as PyTorch's CPU kernel does (2.13 refuses them with its own
    # error, 2.11 takes them)
    x = randn(2, 4, 6, 5, seed=56).transpose(2, 3)

    def outcome(t):
        try:
            return torch.ops.aten.native_group_norm(t, None, None, 2, 4, 30, 2, 1e-5), None
        except RuntimeError as e:
            return None, str(e)

    (cpu, cpu_error), (chip, chip_error) = outcome(x), outcome(x.to(flagos.device()))
    assert chip_error == cpu_error
    for got, want in zip(chip or (), cpu or ()):
        torch.testing.assert_close(got.cpu(), want)


# ---- nearest upsampling --------------------------------------------------------------------------

UPSAMPLE_CASES = {
    # id: F.interpolate keyword arguments
    "scale 2 (Upsample2D)": dict(scale_factor=2.0, mode="nearest"),
    "scale 3": dict(scale_factor=3.0, mode="nearest"),
    "scale 1.5": dict(scale_factor=1.5, mode="nearest"),
    "size": dict(size=(7, 10), mode="nearest"),
    "shrink": dict(size=(3, 2), mode="nearest"),
}


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("view", ["contiguous", "offset"])
@pytest.mark.parametrize("case", UPSAMPLE_CASES)
def test_upsample_nearest2d(case, view, dtype):
    kwargs = UPSAMPLE_CASES[case]
    x = (arg(randn(2, 3, 5, 4, seed=60)) if view == "contiguous"
         else arg(randn(2, 4, 6, 6, seed=60), lambda t: t[:, 1:, 1:, 2:]))
    run_case("aten::upsample_nearest2d", lambda t: F.interpolate(t, **kwargs), [x], dtype, exact=True)


# ---- embedding -------------------------------------------------------------------------------------

@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_shape", [(5,), (2, 7), (), (0, 3), "expanded", "transposed"], ids=str)
@pytest.mark.parametrize("view", ["contiguous", "transposed", "offset"])
def test_embedding(view, index_shape, dtype):
    weight = {"contiguous": arg(randn(11, 6, seed=61)),
              "transposed": arg(randn(6, 11, seed=61), lambda t: t.t()),
              "offset": arg(randn(13, 8, seed=61), lambda t: t[2:, 1:7])}[view]
    g = torch.Generator().manual_seed(62)
    # strided indices: BERT's token_type_ids are a buffer expanded over the batch
    index_view = {"expanded": ((1, 7), lambda t: t.expand(3, 7)),
                  "transposed": ((7, 4), lambda t: t[1:].t())}.get(index_shape)
    base_indices = torch.randint(0, 11, index_view[0] if index_view else index_shape, generator=g)
    take = index_view[1] if index_view else (lambda t: t)
    indices = take(base_indices)
    dev = flagos.device()
    _native_dtype(dtype)
    base, fn = weight
    w_cpu, w_dev = fn(base.to(dtype)), fn(base.to(dtype).to(dev))
    with flagos.track() as report:
        out = F.embedding(take(base_indices.to(dev)), w_dev)
    assert report.op("aten::embedding")["calls"]["native"] == 1 and report.calls("fallback") == 0, \
        str(report)
    assert out.dtype == dtype and torch.equal(out.cpu(), F.embedding(indices, w_cpu))


@on_sim
@pytest.mark.parametrize("bad", [11, -1, 10**12])
def test_embedding_index_out_of_range_is_pytorchs_error(bad):
    dev = flagos.device()
    weight, indices = randn(11, 4, seed=63), torch.tensor([0, 3, bad, 2])
    with pytest.raises(IndexError) as cpu:
        F.embedding(indices, weight)
    # the kernel declines (it reads no row for a bad index) and the fallback raises
    with pytest.raises(IndexError) as chip:
        F.embedding(indices.to(dev), weight.to(dev))
    assert str(chip.value) == str(cpu.value)
    # the chip still works after it
    good = torch.tensor([[1, 2], [10, 0]])
    assert torch.equal(F.embedding(good.to(dev), weight.to(dev)).cpu(), F.embedding(good, weight))


@on_sim
def test_embedding_with_int32_indices_takes_the_fallback():
    indices = torch.tensor([1, 0, 4], dtype=torch.int32)
    run_case("aten::embedding", lambda w: F.embedding(indices.to(w.device), w),
             [arg(randn(5, 3, seed=64))], torch.float32, route="fallback")


# ---- concatenation ----------------------------------------------------------------------------------

CAT_CASES = {
    # id: (list of (base shape, view), dim)
    "dim 1, UNet skip": ([((1, 4, 5, 6), None), ((1, 3, 5, 6), None)], 1),
    "last dim, sin/cos": ([((6, 4), None), ((6, 5), None)], -1),
    "strided and offset": ([((8, 6), lambda t: t.t()), ((9, 9), lambda t: t[2:, 1:])], 0),
    "an empty one, three": ([((2, 0, 3), None), ((2, 4, 3), None), ((2, 1, 3), None)], 1),
    "one tensor": ([((3, 5), lambda t: t[:, 1:])], 1),
    "expanded": ([((1, 5), lambda t: t.expand(4, 5)), ((2, 5), None)], 0),
}


@on_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CAT_CASES)
def test_cat(case, dtype):
    parts, dim = CAT_CASES[case]
    args = [arg(randn(*shape, seed=70 + i), view) for i, (shape, view) in enumerate(parts)]
    run_case("aten::cat", lambda *ts: torch.cat(ts, dim), args, dtype, exact=True)


@on_sim
def test_cat_declined_cases_give_cpus_result_or_error():
    dev = flagos.device()
    # nine tensors (more than the convention takes), mixed dtypes: the fallback, CPU's result
    run_case("aten::cat", lambda *ts: torch.cat(ts, 0), [arg(randn(2, 3, seed=80 + i)) for i in range(9)],
             torch.float32, route="fallback")
    a, b = randn(2, 3, seed=90), randn(2, 3, seed=91).double()
    assert torch.equal(torch.cat([a.to(dev), b.to(dev)]).cpu(), torch.cat([a, b]))
    # shapes that do not fit: PyTorch's error
    with pytest.raises(RuntimeError) as cpu:
        torch.cat([a, randn(2, 4, seed=92)], 0)
    with pytest.raises(RuntimeError) as chip:
        torch.cat([a.to(dev), randn(2, 4, seed=92).to(dev)], 0)
    assert str(chip.value) == str(cpu.value)


def _channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


@on_sim
def test_conv2d_channels_last_takes_the_fallback():
    # PyTorch lays the result out channels_last; flagos leaves such calls to the CPU
    for x, w in ((arg(randn(2, 4, 6, 5, seed=47), _channels_last), arg(randn(3, 4, 3, 3, seed=48))),
                 (arg(randn(2, 4, 6, 5, seed=47)), arg(randn(3, 4, 3, 3, seed=48), _channels_last))):
        run_case("aten::convolution", lambda a, b: F.conv2d(a, b, padding=1), [x, w], torch.float32,
                 route="fallback")


@on_sim
@pytest.mark.parametrize("name", ["group_norm", "upsample", "cat", "cat mixed"])
def test_channels_last_results_as_pytorch_lays_them_out(name):
    # the UNet's attention blocks hand channels_last tensors to the up path's group norms,
    # Upsample2D and skip cats: the results keep PyTorch's layout
    a, b = randn(1, 4, 5, 6, seed=95), randn(2, 3, 5, 6, seed=94)
    fn, args = {
        "group_norm": (lambda x, w, c: F.group_norm(x, 2, w, c),
                       [arg(randn(2, 4, 6, 5, seed=57), _channels_last), arg(randn(4, seed=58)),
                        arg(randn(4, seed=59))]),
        "upsample": (lambda x: F.interpolate(x, scale_factor=2.0, mode="nearest"),
                     [arg(randn(2, 4, 5, 6, seed=93), _channels_last)]),
        "cat": (lambda x, y: torch.cat([x, y], 1),
                [arg(a.expand(2, 4, 5, 6).clone(), _channels_last), arg(b, _channels_last)]),
        "cat mixed": (lambda x, y: torch.cat([x, y], 1),   # one contiguous: a contiguous result
                      [arg(a.expand(2, 4, 5, 6).clone(), _channels_last), arg(b)]),
    }[name]
    op = {"group_norm": "aten::native_group_norm",
          "upsample": "aten::upsample_nearest2d", "cat": "aten::cat"}[name.split()[0]]
    run_case(op, fn, args, torch.float32)
    dev = flagos.device()
    ref = fn(*[view(base) for base, view in args])
    out = fn(*[view(base.to(dev)) for base, view in args])
    assert out.stride() == ref.stride(), (out.stride(), ref.stride())
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])


# ---- unusual arguments: the kernel-table rules decline, the host answers ---------------

A = torch.ops.aten
# Calls a kernel-table op with an argument its convention cannot take (a shape PyTorch refuses,
# a dim named twice, a dtype, an empty or 0-dim tensor, a parameter of the wrong size): each
# must give what the CPU gives, its result (values, shape, dtype, strides) or its error (type
# and message), whichever path of the router's C code or the Python runner decides it.
UNUSUAL = {
    "add, shapes that do not broadcast": (lambda a, b: a + b, [(3, 4), (5, 4)]),
    "add, a complex number": (lambda a: a + 1j, [(3, 4)]),
    "mul, a complex number": (lambda a: a * (2 + 0.5j), [(3, 4)]),
    "add, a complex number and alpha": (lambda a: torch.add(a, 1j, alpha=2), [(3, 4)]),
    "sub, a bool": (lambda a: a - True, [(3, 4)]),
    "sub, a 0-dim bool host tensor": (lambda a: a - torch.tensor(True), [(3, 4)]),
    "add, a bool": (lambda a: a + True, [(3, 4)]),
    "mul, a bool": (lambda a: torch.mul(a, False), [(3, 4)]),
    "mul, a 0-dim host tensor": (lambda a: a * torch.tensor(2.5), [(3, 4)]),
    "div, a 0-dim integer host tensor": (lambda a: a / torch.tensor(4), [(3, 4)]),
    "add, an empty one that does not broadcast": (lambda a, b: a + b, [(0, 4), (5, 4)]),
    "add, empty broadcast": (lambda a, b: a + b, [(0, 4), (1, 4)]),
    "sub, empty, alpha 3": (lambda a, b: torch.sub(a, b, alpha=3), [(0, 4), (0, 4)]),
    "add.Scalar, empty, alpha 3": (lambda a: A.add.Scalar(a, 2, 3), [(0, 4)]),
    "gelu tanh, empty": (lambda a: F.gelu(a, approximate="tanh"), [(0, 4)]),
    "mm, empty": (lambda a, b: a @ b, [(0, 3), (3, 4)]),
    "bmm, empty batch, inner dims differ": (torch.bmm, [(0, 3, 4), (0, 5, 4)]),
    "addmm, a bias that does not broadcast": (torch.addmm, [(4, 3), (3, 4), (4, 5)]),
    "addmm, empty, bias that does not broadcast": (torch.addmm, [(4, 3), (0, 4), (4, 5)]),
    "addmm, inner dim 0": (lambda s, a, b: torch.addmm(s, a, b, beta=2, alpha=3), [(3, 5), (3, 0), (0, 5)]),
    "sum, to float64": (lambda a: a.sum(1, dtype=torch.float64), [(3, 4)]),
    "sum, empty, to float64": (lambda a: a.sum(1, dtype=torch.float64), [(0, 4)]),
    "mean, to float64": (lambda a: a.mean(1, dtype=torch.float64), [(3, 4)]),
    "sum, dim out of range": (lambda a: a.sum(5), [(3, 4)]),
    "sum, empty, dim out of range": (lambda a: a.sum(5), [(0, 4)]),
    "sum, a dim named twice": (lambda a: a.sum((1, -1)), [(3, 4)]),
    "sum, empty, a dim named twice": (lambda a: a.sum((1, -1)), [(0, 4)]),
    "sum, 0-dim, dims 0 and -1": (lambda a: a.sum((0, -1)), [()]),
    "mean, 0-dim, dims 0 and -1": (lambda a: a.mean((0, -1)), [()]),
    "sum, 0-dim, dim 1": (lambda a: a.sum((1,)), [()]),
    "sum, 0-dim, keepdim": (lambda a: a.sum((-1,), keepdim=True), [()]),
    "sum, empty, over the empty dim": (lambda a: a.sum(0), [(0, 4)]),
    "mean, empty, keepdim": (lambda a: a.mean(1, keepdim=True), [(0, 4)]),
    "sum, no dims": (lambda a: a.sum(()), [(2, 3)]),
    "softmax, empty": (lambda a: torch.softmax(a, 1), [(0, 4)]),
    "_softmax, half to float": (lambda a: A._softmax(a.half(), 1, True), [(2, 4)]),
    "_safe_softmax, empty": (lambda a: A._safe_softmax(a, 0), [(0, 3)]),
    "layer_norm, no normalized dims": (lambda a: A.native_layer_norm(a, [], None, None, 1e-5), [(2, 4)]),
    "conv2d, groups that do not divide": (lambda x, w: F.conv2d(x, w, groups=3), [(1, 4, 5, 5), (3, 2, 3, 3)]),
    "conv2d, output smaller than one": (F.conv2d, [(1, 2, 2, 2), (3, 2, 3, 3)]),
    "conv2d, empty batch": (F.conv2d, [(0, 2, 5, 5), (3, 2, 3, 3)]),
    "conv2d, empty batch, bias": (F.conv2d, [(0, 2, 5, 5), (3, 2, 3, 3), (3,)]),
    "conv2d, bias of the wrong size": (F.conv2d, [(1, 2, 5, 5), (3, 2, 3, 3), (4,)]),
    "conv2d, no output channels": (F.conv2d, [(1, 2, 5, 5), (0, 2, 3, 3)]),
    "convolution, negative padding": (
        lambda x, w: A.convolution(x, w, None, [1, 1], [-1, 0], [1, 1], False, [0, 0], 1), [(1, 2, 5, 5), (3, 2, 3, 3)]),
    "convolution, dilation 0": (
        lambda x, w: A.convolution(x, w, None, [1, 1], [0, 0], [0, 1], False, [0, 0], 1), [(1, 2, 5, 5), (3, 2, 3, 3)]),
    "group_norm, groups that do not divide": (lambda x: F.group_norm(x, 3), [(2, 4, 3, 3)]),
    "group_norm, a spatial dim of size 1": (lambda x: F.group_norm(x, 2), [(2, 4, 1, 3)]),
    "group_norm, spatial dims transposed": (lambda x: F.group_norm(x.transpose(2, 3), 2), [(2, 4, 3, 5)]),
    "group_norm, empty": (lambda x: F.group_norm(x, 2), [(0, 4, 3, 3)]),
    "group_norm, 2-d": (lambda x: F.group_norm(x, 2), [(3, 4)]),
    "native_group_norm, weight of the wrong size": (
        lambda x, w: A.native_group_norm(x, w, None, 2, 4, 9, 2, 1e-5), [(2, 4, 3, 3), (5,)]),
    "native_group_norm, bias of the wrong size": (
        lambda x, b: A.native_group_norm(x, None, b, 2, 4, 9, 2, 1e-5), [(2, 4, 3, 3), (3,)]),
    "native_group_norm, HxW that does not fit": (
        lambda x: A.native_group_norm(x, None, None, 2, 4, 8, 2, 1e-5), [(2, 4, 3, 3)]),
    "upsample_nearest2d, empty": (lambda x: F.interpolate(x, size=(4, 4)), [(0, 2, 2, 2)]),
    "upsample_nearest2d, output size 0": (lambda x: A.upsample_nearest2d(x, [0, 4]), [(1, 2, 2, 2)]),
    "upsample_nearest2d, scales": (lambda x: A.upsample_nearest2d(x, [4, 6], 2.0, 3.0), [(1, 2, 2, 2)]),
    "upsample_nearest2d, scales by keyword": (
        lambda x: A.upsample_nearest2d(x, [4, 6], scales_h=2.0, scales_w=3.0), [(1, 2, 2, 2)]),
    "upsample_nearest2d, 3-d": (lambda x: A.upsample_nearest2d(x, [4, 4]), [(2, 2, 2)]),
    "cat, nine tensors": (lambda *ts: torch.cat(ts, 1), [(2, 1)] * 9),
    "cat, dim out of range": (lambda a, b: torch.cat((a, b), 2), [(2, 3), (2, 3)]),
    "cat, sizes that differ": (lambda a, b: torch.cat((a, b), 0), [(2, 3), (2, 4)]),
    "cat, ranks that differ": (lambda a, b: torch.cat((a, b), 0), [(2, 3), (3,)]),
    "cat, a legacy empty 1-d tensor": (lambda a, b: torch.cat((a, b), 0), [(2, 3), (0,)]),
    "cat, 0-dim tensors": (lambda a, b: torch.cat((a, b), 0), [(), ()]),
    "cat, empty": (lambda a, b: torch.cat((a, b), 1), [(0, 3), (0, 2)]),
    "cat, empty beside full": (lambda a, b: torch.cat((a, b), 0), [(0, 3), (2, 3)]),
}


@on_sim
@pytest.mark.parametrize("name", list(UNUSUAL))
def test_unusual_arguments_of_the_table_ops_give_cpus_result_or_error(name):
    fn, shapes = UNUSUAL[name]
    dev = flagos.device()
    args = [randn(*shape, seed=80 + i) for i, shape in enumerate(shapes)]
    try:
        want, error = fn(*args), None
    except (RuntimeError, IndexError, ValueError) as e:
        want, error = None, e
    if error is not None:
        with pytest.raises(type(error)) as chip:
            fn(*[t.to(dev) for t in args])
        assert str(chip.value) == str(error)
        return
    got = fn(*[t.to(dev) for t in args])
    for w, g in zip(*((t if isinstance(t, tuple) else (t,)) for t in (want, got))):
        assert g.device == dev and (g.shape, g.dtype) == (w.shape, w.dtype)
        if w.numel() > 1:
            assert g.stride() == w.stride()
        torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5, equal_nan=True)
