"""The strides PyTorch's TensorIterator gives the result of an elementwise op on the CPU.

A C-ABI chip's kernels write a result laid out as the runner asks, and the runner asks for the
CPU's layout. The rule is TensorIterator's (aten/src/ATen/TensorIterator.cpp): a "fast setup"
when every operand has the result's shape (all contiguous: contiguous; all channels_last:
channels_last; all dense with the same strides: those strides), otherwise the dims sorted by the
operands' strides (`reorder_dimensions`) and the result contiguous in that order. A wrapped
Python number (`x + 1`) is an operand of shape (), so it takes the second way. PyTorch's meta
kernels compute layouts their own way and differ from the CPU's for size-1 dims and for some
float16 results (docs/design.md, "Result layouts"); this module follows the CPU's.

Operands are given as (sizes, strides) in elements: the dtypes are one (mixed dtypes go to the
host), so TensorIterator's byte strides order the dims as these do.
"""
from __future__ import annotations

Layout = tuple[tuple[int, ...], tuple[int, ...]]


def contiguous_strides(shape) -> tuple[int, ...]:
    """torch.empty(shape)'s strides (a size-0 or size-1 dim counts as 1)."""
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _channels_last_strides(shape) -> tuple[int, ...]:
    n, c, h, w = shape  # c10's get_channels_last_strides_2d
    return (c * w * h, 1, w * c, c)


def _dense_in_order(sizes, strides, order) -> bool:
    """Whether the dims in `order` (innermost first) are laid out densely, size-1 dims aside."""
    expected = 1
    for d in order:
        if sizes[d] != 1:
            if strides[d] != expected:
                return False
            expected *= sizes[d]
    return True


def _is_contiguous(sizes, strides) -> bool:
    return 0 in sizes or _dense_in_order(sizes, strides, range(len(sizes) - 1, -1, -1))


def _is_channels_last(sizes, strides) -> bool:
    return len(sizes) == 4 and _dense_in_order(sizes, strides, (1, 3, 2, 0))


def _is_non_overlapping_and_dense(sizes, strides) -> bool:
    order = sorted((d for d in range(len(sizes)) if sizes[d] >= 2), key=lambda d: strides[d])
    return _dense_in_order(sizes, strides, order)


def _broadcast_strides(sizes, strides, shape) -> tuple[int, ...]:
    """An operand's strides as TensorIterator sees them: 0 where it is broadcast."""
    pad = len(shape) - len(sizes)
    return tuple(0 if i < pad or (sizes[i - pad] == 1 and shape[i] != 1) else strides[i - pad]
                 for i in range(len(shape)))


def _fast_setup(shape, operands: list[Layout]):
    if all(_is_contiguous(*op) for op in operands):
        return contiguous_strides(shape)
    if all(_is_channels_last(*op) for op in operands):
        return _channels_last_strides(shape)
    first = operands[0][1]
    if all(_is_non_overlapping_and_dense(*op) for op in operands) and all(op[1] == first for op in operands):
        return tuple(first)
    return None


def _reordered(shape, operand_strides) -> list[int]:
    """TensorIterator's reorder_dimensions: the dims, innermost first, by an insertion sort
    that leaves ambiguous pairs (broadcast dims, equal strides) where they are."""
    ndim = len(shape)
    if ndim == 1:
        return [0]
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(dim0, dim1) -> int:
        for strides in operand_strides:
            stride0, stride1 = strides[dim0], strides[dim1]
            if stride0 == 0 or stride1 == 0:
                continue  # broadcast along one of them: the next operand decides
            if stride0 < stride1:
                return -1
            if stride0 > stride1:
                return 1
            if shape[dim0] > shape[dim1]:  # equal strides: the smaller dim goes first
                return 1
        return 0

    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return perm


def result_strides(shape, operands: list[Layout], scalars: int = 0) -> tuple[int, ...]:
    """The strides of an elementwise op's result of `shape` on the CPU, given its tensor
    operands' (sizes, strides) and how many Python numbers it takes as operands."""
    shape = tuple(shape)
    operands = [(tuple(s), tuple(st)) for s, st in operands]
    if all(sizes == shape for sizes, _ in operands) and (scalars == 0 or shape == ()):
        fast = _fast_setup(shape, operands)
        if fast is not None:
            return fast
    if not shape:
        return ()
    perm = _reordered(shape, [_broadcast_strides(s, st, shape) for s, st in operands])
    if perm == list(range(len(shape) - 1, -1, -1)):
        return contiguous_strides(shape)
    strides, acc = [0] * len(shape), 1
    for d in perm:  # contiguous in the sorted order (TensorIterator's compatible_stride)
        strides[d] = acc
        acc *= shape[d]
    return tuple(strides)
