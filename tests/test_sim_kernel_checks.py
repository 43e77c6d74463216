"""The sim adapter's own checks on the views its kernels get, reached through the adapter ABI
directly: flagos sizes every output before a kernel runs, so only a caller of the ABI that
skips flagos meets them, and a vendor adapter written after sim should refuse the same."""
import pytest
import torch
from torch.utils.dlpack import to_dlpack

from flagos import chips
from flagos.errors import DeviceError

FLOAT32, INT64 = 0, 4  # the ABI's dtype codes


@pytest.fixture(scope="module")
def sim_adapter():
    return chips.profile("sim").adapter


def contiguous(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return tuple(strides)


def run(adapter, op, in_shapes, out_shapes, scalars=(), ints=()):
    """Run a float32 kernel on fresh contiguous buffers of these shapes."""
    index = {name: i for i, (name, _) in enumerate(adapter.kernels())}[op]

    def descs(shapes):
        return [(adapter.alloc_tensor(0, shape, None, 4), 0, FLOAT32, shape, contiguous(shape))
                for shape in shapes]

    adapter.run_kernel(index, 0, descs(in_shapes), descs(out_shapes), scalars, ints)


def run_unary(adapter, op, in_shape, out_shape):
    run(adapter, op, [in_shape], [out_shape])


@pytest.mark.parametrize("op", ["aten::neg", "aten::relu"])
def test_unary_kernel_refuses_an_output_of_another_shape(sim_adapter, op):
    run_unary(sim_adapter, op, (2, 3), (2, 3))  # the same call with matching shapes runs
    # same rank and element count, other sizes: only a size-by-size comparison tells them apart
    with pytest.raises(DeviceError, match=f"{op}: input and output shapes differ"):
        run_unary(sim_adapter, op, (2, 3), (3, 2))
    with pytest.raises(DeviceError, match="input and output shapes differ"):
        run_unary(sim_adapter, op, (6,), (2, 3))


def test_mm_refuses_inner_dims_that_differ(sim_adapter):
    run(sim_adapter, "aten::mm", [(2, 3), (3, 4)], [(2, 4)])
    with pytest.raises(DeviceError, match="aten::mm: inner dims differ"):
        run(sim_adapter, "aten::mm", [(2, 3), (2, 4)], [(2, 4)])
    with pytest.raises(DeviceError, match=r"aten::mm: output shape is not \[M, N\]"):
        run(sim_adapter, "aten::mm", [(2, 3), (3, 4)], [(4, 2)])


def test_layer_norm_refuses_statistics_of_another_shape(sim_adapter):
    def layer_norm(mean_shape, rstd_shape):
        run(sim_adapter, "aten::native_layer_norm", [(2, 4), (4,), (4,)],
            [(2, 4), mean_shape, rstd_shape], scalars=(1e-5,), ints=(1,))

    layer_norm((2, 1), (2, 1))
    # either statistic alone of the wrong shape is refused
    for mean_shape, rstd_shape in (((1, 2), (2, 1)), ((2, 1), (1, 2))):
        with pytest.raises(DeviceError, match="mean or rstd is not"):
            layer_norm(mean_shape, rstd_shape)


def test_convolution_refuses_an_output_of_another_shape(sim_adapter):
    ints = (1, 1, 1, 1, 1, 1, 1)  # stride, padding, dilation (2 each), groups
    run(sim_adapter, "aten::convolution", [(1, 2, 5, 5), (3, 2, 3, 3), (3,)], [(1, 3, 5, 5)], ints=ints)
    with pytest.raises(DeviceError, match=r"aten::convolution: output is not \[N, Cout, OH, OW\]"):
        run(sim_adapter, "aten::convolution", [(1, 2, 5, 5), (3, 2, 3, 3), (3,)], [(1, 3, 4, 4)],
            ints=ints)
    with pytest.raises(DeviceError, match="channels do not divide into groups"):
        run(sim_adapter, "aten::convolution", [(1, 2, 5, 5), (3, 2, 3, 3), (3,)], [(1, 3, 5, 5)],
            ints=ints[:6] + (2,))
    with pytest.raises(DeviceError, match=r"bias is not \[Cout\]"):
        run(sim_adapter, "aten::convolution", [(1, 2, 5, 5), (3, 2, 3, 3), (4,)], [(1, 3, 5, 5)],
            ints=ints)


def test_group_norm_refuses_statistics_of_another_shape(sim_adapter):
    def group_norm(out_shape, mean_shape, rstd_shape, ints=(2, 4, 6, 2)):
        run(sim_adapter, "aten::native_group_norm", [(2, 4, 6), (4,), (4,)],
            [out_shape, mean_shape, rstd_shape], scalars=(1e-5,), ints=ints)

    group_norm((2, 4, 6), (2, 2), (2, 2))
    for mean_shape, rstd_shape in (((2, 1), (2, 2)), ((2, 2), (2, 4))):
        with pytest.raises(DeviceError, match=r"mean or rstd is not \[N, group\]"):
            group_norm((2, 4, 6), mean_shape, rstd_shape)
    with pytest.raises(DeviceError, match="output shape differs"):
        group_norm((2, 4, 5), (2, 2), (2, 2))
    with pytest.raises(DeviceError, match="C does not divide into the groups"):
        group_norm((2, 4, 6), (2, 3), (2, 3), ints=(2, 4, 6, 3))


def test_upsample_refuses_an_output_other_than_the_ints_say(sim_adapter):
    run(sim_adapter, "aten::upsample_nearest2d", [(1, 2, 3, 4)], [(1, 2, 6, 8)], scalars=(2.0, 2.0),
        ints=(6, 8))
    with pytest.raises(DeviceError, match=r"output is not \[N, C, OH, OW\] as the ints say"):
        run(sim_adapter, "aten::upsample_nearest2d", [(1, 2, 3, 4)], [(1, 2, 6, 8)],
            scalars=(2.0, 2.0), ints=(6, 7))


def test_embedding_refuses_float_indices_and_another_output_shape(sim_adapter):
    index = {name: i for i, (name, _) in enumerate(sim_adapter.kernels())}["aten::embedding"]
    weight = (sim_adapter.alloc_tensor(0, (5, 3), None, 4), 0, FLOAT32, (5, 3), (3, 1))
    ids = sim_adapter.alloc_tensor(0, (4,), None, 8)
    ids.write(to_dlpack(torch.tensor([0, 4, 2, 0])), 0)
    out = (sim_adapter.alloc_tensor(0, (4, 3), None, 4), 0, FLOAT32, (4, 3), (3, 1))
    sim_adapter.run_kernel(index, 0, [weight, (ids, 0, INT64, (4,), (1,))], [out], (), ())
    with pytest.raises(DeviceError, match="input 1 has dtype 0 but the call's dtype is 4"):
        sim_adapter.run_kernel(index, 0, [weight, (ids, 0, FLOAT32, (4,), (1,))], [out], (), ())
    short = (sim_adapter.alloc_tensor(0, (3, 3), None, 4), 0, FLOAT32, (3, 3), (3, 1))
    with pytest.raises(DeviceError, match=r"indices \[...\] -> output \[..., D\]"):
        sim_adapter.run_kernel(index, 0, [weight, (ids, 0, INT64, (4,), (1,))], [short], (), ())
    # an index past the table: declined (FLAGOS_STATUS_UNSUPPORTED), so flagos falls back
    ids.write(to_dlpack(torch.tensor([5])), 8)
    with pytest.raises(NotImplementedError, match="index 5 out of range for 5 rows"):
        sim_adapter.run_kernel(index, 0, [weight, (ids, 0, INT64, (4,), (1,))], [out], (), ())


def test_cat_refuses_sizes_that_do_not_add_up(sim_adapter):
    run(sim_adapter, "aten::cat", [(2, 3), (2, 4)], [(2, 7)], ints=(1,))
    with pytest.raises(DeviceError, match="do not add up to the output's"):
        run(sim_adapter, "aten::cat", [(2, 3), (2, 4)], [(2, 8)], ints=(1,))
    with pytest.raises(DeviceError, match="differs from the output off the cat dim"):
        run(sim_adapter, "aten::cat", [(2, 3), (3, 4)], [(2, 7)], ints=(1,))
    with pytest.raises(DeviceError, match="dim 2 out of range"):
        run(sim_adapter, "aten::cat", [(2, 3), (2, 4)], [(2, 7)], ints=(2,))


def times(adapter):
    return {op: (calls, seconds) for op, calls, seconds in adapter.kernel_times()}


def test_kernel_times_count_the_calls_that_ran_and_their_time(sim_adapter):
    assert [op for op, _, _ in sim_adapter.kernel_times()] == [op for op, _ in sim_adapter.kernels()]
    before = times(sim_adapter)
    run(sim_adapter, "aten::mm", [(2, 3), (3, 4)], [(2, 4)])
    run(sim_adapter, "aten::mm", [(2, 3), (3, 4)], [(2, 4)])
    with pytest.raises(DeviceError, match="inner dims differ"):  # failed: not a run
        run(sim_adapter, "aten::mm", [(2, 3), (4, 4)], [(2, 4)])
    after = times(sim_adapter)
    assert after["aten::mm"][0] == before["aten::mm"][0] + 2
    assert after["aten::mm"][1] > before["aten::mm"][1]
    assert {op: v for op, v in after.items() if op != "aten::mm"} == \
        {op: v for op, v in before.items() if op != "aten::mm"}


@pytest.mark.parametrize("field", ["scalars", "ints"])
def test_run_kernel_passes_up_to_16_scalars_and_ints_to_the_adapter(sim_adapter, field):
    """16 reach the adapter (sim names the count it got); 17 never leave flagos."""
    with pytest.raises(DeviceError, match=r"expected 1 inputs, 1 outputs, 0 scalars and 0 ints; "
                                          r"got 1, 1, (16 and 0|0 and 16)"):
        run(sim_adapter, "aten::neg", [(2,)], [(2,)], **{field: (0,) * 16})
    with pytest.raises(ValueError, match="at most 16 scalars and ints"):
        run(sim_adapter, "aten::neg", [(2,)], [(2,)], **{field: (0,) * 17})


def test_a_view_of_a_buffer_is_checked_against_it(sim_adapter):
    """Buffer.check_view, the runner's bound on a view it makes of a buffer: PyTorch's errors
    for a negative offset and for a view past the end; a view inside passes."""
    buf = sim_adapter.alloc_tensor(0, (4, 4), None, 4)   # 64 bytes
    assert buf.check_view((4, 4), (4, 1), 0, 4) is None
    assert buf.check_view((2, 2), (1, 4), 10, 4) is None  # the last element is the 16th
    with pytest.raises(RuntimeError, match="invalid storage offset -1"):
        buf.check_view((2,), (1,), -1, 4)
    with pytest.raises(RuntimeError, match=r"setStorage: sizes \[2, 2\], strides \[1, 4\], storage "
                                           r"offset 11, and itemsize 4 requiring a storage size of "
                                           r"68 are out of bounds for storage of size 64"):
        buf.check_view((2, 2), (1, 4), 11, 4)
    with pytest.raises(RuntimeError, match="mismatch in length of strides and shape"):  # as_strided's words
        buf.check_view((2, 2), (1,), 0, 4)
    # a negative stride or size is refused even where it would add nothing to the extent
    # (a dim of one element, a stride of 0): PyTorch's storage-size error
    for sizes, strides in [((1, 2), (-1, 1)), ((-1,), (0,))]:
        with pytest.raises(RuntimeError, match="Storage size calculation overflowed"):
            buf.check_view(sizes, strides, 0, 4)
    # contiguous (no strides): the offset counts, and an end that wraps past 2**64 bytes is
    # refused, not taken for the few bytes it wraps to
    with pytest.raises(RuntimeError, match="storage offset 1, and itemsize 4 requiring a storage size of 68"):
        buf.check_view((4, 4), None, 1, 4)
    with pytest.raises(RuntimeError, match="Storage size calculation overflowed"):
        buf.check_view((2**63 - 1, 2), None, 3, 1)
    with pytest.raises(OverflowError):  # a size past int64: Python's own error, as it is read
        buf.check_view((2**64,), (1,), 0, 4)
    for sizes, strides in [(4, (1,)), ((4,), 1)]:   # not sequences: nothing parsed
        with pytest.raises(TypeError, match="sizes and strides are sequences of ints"):
            buf.check_view(sizes, strides, 0, 4)


def test_sim_refuses_to_destroy_the_default_stream(sim_adapter):
    with pytest.raises(DeviceError, match="the default stream cannot be destroyed"):
        sim_adapter.stream_destroy(0, 0)
    stream = sim_adapter.stream_create(0, 0)
    sim_adapter.stream_destroy(0, stream)
    with pytest.raises(DeviceError, match=rf"stream {stream} is not a live stream of sim device 0"):
        sim_adapter.stream_destroy(0, stream)


@pytest.mark.parametrize("dtype, size", [(0, 4), (1, 2), (2, 2), (3, 8), (4, 8), (5, 4), (6, 2), (7, 1), (8, 1),
                                         (9, 1)])
def test_a_view_that_fills_its_buffer_exactly_reaches_the_kernel(sim_adapter, dtype, size):
    """flagos checks every kernel tensor against its buffer with the ABI's element size of its
    dtype (float32 ... bool): a view that fills the 16 bytes exactly reaches the kernel (which
    runs it, or refuses a dtype it has no kernel for), one element more never does."""
    index = {name: i for i, (name, _) in enumerate(sim_adapter.kernels())}["aten::neg"]
    source, result = sim_adapter.alloc(0, 16), sim_adapter.alloc(0, 16)

    def neg(count):
        sim_adapter.run_kernel(index, 0, [(source, 0, dtype, (count,), (1,))],
                               [(result, 0, dtype, (count,), (1,))], (), ())

    if dtype in (FLOAT32, 1, 2):
        neg(16 // size)
    else:
        with pytest.raises(DeviceError, match="aten::neg: .*dtype"):
            neg(16 // size)
    with pytest.raises(ValueError, match="a kernel tensor lies outside its buffer"):
        neg(16 // size + 1)


def test_sizes_and_strides_that_are_not_int64_are_pythons_errors(sim_adapter):
    """A size or stride past int64, or not an int, is refused with Python's own error for it,
    before any bounds check reads it as -1."""
    index = {name: i for i, (name, _) in enumerate(sim_adapter.kernels())}["aten::neg"]
    source, result = sim_adapter.alloc(0, 16), sim_adapter.alloc(0, 16)
    for sizes, strides, error in [((2**64,), (1,), OverflowError), ((4,), (2**64,), OverflowError),
                                  ((4.0,), (1,), TypeError)]:
        with pytest.raises(error):
            sim_adapter.run_kernel(index, 0, [(source, 0, FLOAT32, sizes, strides)],
                                   [(result, 0, FLOAT32, (4,), (1,))], (), ())


def test_an_absent_optional_tensor_is_passed_as_none(sim_adapter):
    """run_kernel takes None for an optional tensor the op was called without (a convolution
    without bias): the kernel runs, and computes the convolution without one."""
    torch.manual_seed(0)
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    expected = torch.nn.functional.conv2d(x, w)

    def on_sim(t):
        buf = sim_adapter.alloc(0, t.nbytes)
        buf.write(to_dlpack(t), 0)
        return (buf, 0, FLOAT32, tuple(t.shape), t.stride())

    out = sim_adapter.alloc(0, expected.nbytes)
    index = {name: i for i, (name, _) in enumerate(sim_adapter.kernels())}["aten::convolution"]
    sim_adapter.run_kernel(index, 0, [on_sim(x), on_sim(w), None],
                           [(out, 0, FLOAT32, tuple(expected.shape), expected.stride())],
                           (), (1, 1, 0, 0, 1, 1, 1))  # stride, padding, dilation, groups
    got = torch.empty_like(expected)
    out.read(to_dlpack(got), 0)
    torch.testing.assert_close(got, expected)
