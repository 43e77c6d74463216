"""Schema facts the C router needs about an op, computed once per overload."""
from __future__ import annotations

import re

import torch

from .. import _C

_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key

# Decompositions a model calls on every layer that make no complex value of real inputs: run on
# a payload device whole (inference mode), they need no conjugate or negative keys for real
# inputs, which cost 2 µs a call to turn back on. Every other decomposition gets them (fft.hfftn
# conjugates a complex intermediate of a real input); complex inputs always do.
REAL_DECOMPOSITIONS = frozenset(f"aten::{name}" for name in (
    "linear", "matmul", "einsum", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "_convolution_mode", "layer_norm", "group_norm",
    "batch_norm", "instance_norm", "rms_norm", "softmax", "log_softmax", "dropout",
    "scaled_dot_product_attention", "cross_entropy_loss", "nll_loss", "pad", "max_pool2d",
    "adaptive_avg_pool2d", "upsample_nearest2d", "upsample_bilinear2d", "relu6", "square",
    "where", "repeat_interleave", "cosine_similarity", "reshape", "reshape_as", "flatten",
    "unflatten", "contiguous", "to", "type_as", "view_as", "expand_as", "chunk", "narrow",
    "movedim", "swapaxes", "tensor_split", "hstack", "vstack"))

# Ops that make sparse tensors from strided ones (to_sparse, _to_sparse_csr, sparse_coo_tensor).
_SPARSE_OP = re.compile(r"::_?(to_sparse|sparse_(coo|csr|csc|bsr|bsc|compressed))")
# Ops that make strided nested tensors (jagged ones are a Python subclass over a dense tensor).
NESTED_OPS = frozenset({
    "aten::_nested_tensor_from_mask", "aten::_nested_from_padded",
    "aten::_nested_from_padded_and_nested_example", "aten::_nested_view_from_buffer",
    "aten::_nested_view_from_buffer_copy", "aten::_nested_tensor_from_tensor_list",
})

# Ops whose tensor arguments may legitimately sit on different devices (copies,
# and indexing with host index tensors, which PyTorch accepts on every device).
CROSS_DEVICE_OPS = frozenset({
    "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy",
    "aten::to", "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_put",
    "aten::set_", "aten::_local_scalar_dense", "aten::_has_compatible_shallow_copy_type",
    # its split points are a CPU tensor on every device (reaches flagos under inference mode)
    "aten::tensor_split",
    # lengths that PyTorch's Python API hands over on the CPU for any device: packed
    # sequences' lengths and batch sizes (their kernels read them on the host), CTC's lengths
    "aten::_pack_padded_sequence", "aten::_pack_padded_sequence_backward",
    "aten::_pad_packed_sequence", "aten::ctc_loss", "aten::_ctc_loss", "aten::_ctc_loss_backward",
    # the RNNs over a packed sequence (their `.data` overloads; whole only in inference mode)
    "aten::lstm", "aten::gru", "aten::rnn_tanh", "aten::rnn_relu",
})

# Ops whose second output is a host tensor on every device: a packed sequence's batch sizes
# (PackedSequence insists on it) and the lengths `pad_packed_sequence` returns.
HOST_SECOND_OUTPUT_OPS = frozenset({"aten::_pack_padded_sequence", "aten::_pad_packed_sequence"})

# In-place ops that change the metadata of the tensor they write.
INPLACE_VIEW_OPS = frozenset({
    "unsqueeze_", "squeeze_", "t_", "transpose_", "as_strided_", "swapdims_", "swapaxes_",
    "resize_", "resize_as_", "set_", "detach_",
})

# Ops that mutate arguments their schema does not mark as written (legacy
# schemas): argument indices the fallback must copy back anyway.
UNANNOTATED_WRITES = {
    "aten::native_batch_norm": (3, 4),  # running_mean, running_var in training
}


def op_name(func) -> str:
    """'aten::add.Tensor' for an OpOverload; the default overload has no suffix."""
    schema = func._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def op_overload(name: str):
    """The OpOverload of a dispatcher name ('aten::add.Tensor', 'mylib::op'), or None when
    torch.ops knows no such operator or overload."""
    namespace, _, rest = name.partition("::")
    packet, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def packet_name(name: str) -> str:
    """'aten::add' for 'aten::add.Tensor'."""
    ns, _, rest = name.partition("::")
    return f"{ns}::{rest.split('.', 1)[0]}"


def describe(func):
    """(name, arg_names, write_args, return_alias, flags) for the C op table."""
    schema = func._schema
    name = op_name(func)
    args = schema.arguments
    arg_names = tuple(a.name for a in args)
    write_args = tuple(i for i, a in enumerate(args)
                       if a.alias_info is not None and a.alias_info.is_write)
    write_args += tuple(i for i in UNANNOTATED_WRITES.get(name, ()) if i not in write_args)
    return_alias = []
    flags = 0
    for ret in schema.returns:
        info = ret.alias_info
        if info is None:
            return_alias.append(-1)
            continue
        if not info.is_write:
            flags |= _C.OP_VIEW
            return_alias.append(-1)
            continue
        sets = set(info.before_set)
        match = next((i for i in write_args if set(args[i].alias_info.before_set) & sets), -1)
        return_alias.append(match)
    # Only out= arguments (resized to fit) and in-place view ops (unsqueeze_, t_, as_strided_,
    # resize_, set_) change a written tensor's layout; plain in-place ops like add_ never do.
    writes_out = any(args[i].kwarg_only for i in write_args)
    inplace_view = packet_name(name).split("::")[1] in INPLACE_VIEW_OPS
    if writes_out or inplace_view:
        flags |= _C.OP_RELAYOUT
    if packet_name(name) in CROSS_DEVICE_OPS:
        flags |= _C.OP_CROSS_DEVICE
    if packet_name(name) in HOST_SECOND_OUTPUT_OPS:
        flags |= _C.OP_HOST_OUTPUT1
    if any("Device" in str(a.type) for a in args):
        flags |= _C.OP_DEVICE_ARG
    if _SPARSE_OP.search(name):
        flags |= _C.OP_SPARSE
    if packet_name(name) in NESTED_OPS:
        flags |= _C.OP_NESTED
    # `dtype=` picks the output dtype (factories, _to_copy, sum(dtype=)): where the downcast
    # policy rewrites bfloat16 (flagos/_activation.py). A positional dtype (view.dtype) does not.
    if any(a.name == "dtype" and a.kwarg_only for a in args):
        flags |= _C.OP_DTYPE_KW
    # PyTorch decomposes these above the flagos key, except under inference mode, which skips
    # the autograd key where that happens: then the op itself reaches the router.
    if _has_kernel(func.name(), "CompositeImplicitAutograd"):
        flags |= _C.OP_DECOMPOSES
        if packet_name(name) not in REAL_DECOMPOSITIONS:
            flags |= _C.OP_MATH_KEYS
    return name, arg_names, write_args, tuple(return_alias), flags
