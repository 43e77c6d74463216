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


def run_unary(adapter, op, in_shape, out_shape):
    index = {name: i for i, (name, _) in enumerate(adapter.kernels())}[op]
    src = adapter.alloc_tensor(0, in_shape, None, 4)
    dst = adapter.alloc_tensor(0, out_shape, None, 4)

    def contiguous(shape):
        return tuple(shape[1:] + (1,)) if len(shape) == 2 else (1,)

    adapter.run_kernel(index, 0, [(src, 0, FLOAT32, in_shape, contiguous(in_shape))],
                       [(dst, 0, FLOAT32, out_shape, contiguous(out_shape))], (), ())


@pytest.mark.parametrize("op", ["aten::neg", "aten::relu"])
def test_unary_kernel_refuses_an_output_of_another_shape(sim_adapter, op):
    run_unary(sim_adapter, op, (2, 3), (2, 3))  # the same call with matching shapes runs
    # same rank and element count, other sizes: only a size-by-size comparison tells them apart
    with pytest.raises(DeviceError, match=f"{op}: input and output shapes differ"):
        run_unary(sim_adapter, op, (2, 3), (3, 2))
    with pytest.raises(DeviceError, match="input and output shapes differ"):
        run_unary(sim_adapter, op, (6,), (2, 3))
