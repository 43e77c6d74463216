"""The sim adapter's own checks on the views its kernels get, reached through the adapter ABI
directly: flagos sizes every output before a kernel runs, so only a caller of the ABI that
skips flagos meets them, and a vendor adapter written after sim should refuse the same."""
import pytest

from flagos import chips
from flagos.errors import DeviceError

FLOAT32 = 0  # the ABI's dtype code


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
