"""The result layouts the runner gives a C-ABI chip's elementwise kernels (runtime/_iterator_layout.py)
against the CPU's own, over random operand layouts: dense in any dim order, with gaps, expanded,
transposed, with size-1 dims at any stride, empty, 0-dim, broadcast against each other and
against Python numbers, in float32 and float16."""
import itertools
import random

import pytest
import torch

from flagos.runtime._iterator_layout import contiguous_strides, result_strides


def random_layout(rng, shape):
    """Strides for shape: dense in a random dim order, sometimes with a gap or an expanded dim;
    size-1 dims sometimes at a stride of their own."""
    order = list(range(len(shape)))
    rng.shuffle(order)
    strides, acc = [0] * len(shape), 1
    for d in reversed(order):
        if shape[d] == 1 and rng.random() < 0.5:
            strides[d] = rng.choice([1, 2, 3, 7, 20, 60])
            continue
        if shape[d] > 1 and rng.random() < 0.1:
            strides[d] = 0  # expanded
            continue
        strides[d] = acc * (2 if rng.random() < 0.15 else 1)  # sometimes a gap
        acc = strides[d] * max(shape[d], 1)
    return tuple(strides)


def operand(rng, shape, dtype):
    strides = random_layout(rng, shape)
    span = 1 + sum((s - 1) * st for s, st in zip(shape, strides)) if all(shape) else 1
    return torch.zeros(span, dtype=dtype).as_strided(shape, strides)


OPS = {
    "unary": (lambda a, b: torch.neg(a), 0, False),
    "binary, same shape": (lambda a, b: a * b, 0, False),
    "binary, broadcast": (lambda a, b: a + b, 0, True),
    "with a number": (lambda a, b: a + 1, 1, False),
    "number first": (lambda a, b: 2.5 * a, 1, False),
}


def shapes(rng):
    for ndim in range(0, 5):
        for shape in itertools.product([0, 1, 2, 3], repeat=ndim):
            if rng.random() < (1.0 if ndim < 3 else 0.25):
                yield shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_result_strides_are_the_cpus(op, dtype):
    rng = random.Random(f"{op}-{dtype}")
    fn, scalars, broadcast = OPS[op]
    cases = 0
    for shape in shapes(rng):
        for _ in range(4):
            a = operand(rng, shape, dtype)
            other = shape
            if broadcast:  # b: a suffix of the shape with some dims 1, or a longer shape
                other = tuple(1 if rng.random() < 0.4 else s for s in shape)[rng.randrange(len(shape) + 1):]
                if rng.random() < 0.2:
                    other = (2,) + shape
            b = operand(rng, other, dtype)
            out = fn(a, b)
            operands = [(a.shape, a.stride())] + ([(b.shape, b.stride())] if "binary" in op else [])
            got = result_strides(out.shape, operands, scalars)
            cases += 1
            assert got == out.stride(), (op, tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), got)
    assert cases > 300


def test_contiguous_strides_are_torch_emptys():
    for shape in [(), (0,), (3, 0, 2), (1, 1), (2, 1, 3), (4, 5, 6)]:
        assert contiguous_strides(shape) == torch.empty(shape).stride()
