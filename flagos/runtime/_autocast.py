"""`torch.autocast("flagos", dtype=...)`: the payload device's casting policy on flagos tensors.

PyTorch's autocast kernels for a device cast only tensors of that device type, so the chip's own
kernels (AutocastCPU, AutocastCUDA, ...) cannot act on flagos tensors. flagos registers, on the
AutocastPrivateUse1 key, one kernel for every op the payload device autocasts, with the same
policy: the matmul/convolution family runs in the autocast dtype, the ops that need range run
in float32, and cat/stack-like ops take the widest input type. Casts happen above autograd, so
they are recorded and backward gets the right dtypes. Every other op falls through at no cost.
"""
from __future__ import annotations

import torch

from ..core._schema import op_name, op_overload

_KEY = "AutocastPrivateUse1"
_lib = None

# Ops that run in the lower-precision dtype on the devices PyTorch autocasts (CPU, CUDA, XPU,
# MPS); every other op with an autocast kernel on the payload device runs in float32, except
# the "widest type" ops below.
LOWER_PRECISION = frozenset(
    f"aten::{n}" for n in (
        "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding",
        "conv_tbc", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
        "_convolution", "_convolution.deprecated", "convolution", "prelu",
        "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv", "matmul", "dot",
        "linear", "einsum", "chain_matmul", "linalg_multi_dot", "linalg_vecdot", "_addmm_activation",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell", "mkldnn_rnn_layer",
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        "_native_multi_head_attention"))
WIDEST = frozenset(
    f"aten::{n}" for n in (
        "cat", "stack", "index_copy", "addcdiv", "addcmul", "atan2", "bilinear", "cross",
        "vdot", "grid_sampler", "index_put", "tensordot", "scatter_add"))


def payload_autocast_key(chip) -> str:
    """The autocast key of the device whose policy flagos follows on this chip."""
    kind = chip.torch_type if chip.torch_type and not chip.payload_is_host else "cpu"
    return "Autocast" + {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS"}.get(kind, "CPU")


def register(chip) -> None:
    """Once per process (device mode): the payload device's policy on the flagos key."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    source = payload_autocast_key(chip)
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not torch._C._dispatch_has_kernel_for_dispatch_key(name, source):
            continue
        policy = "lower" if name in LOWER_PRECISION else "widest" if _packet(name) in WIDEST else "fp32"
        op = op_overload(name)
        if op is not None:
            lib.impl(name.split("::", 1)[1], _kernel(op, policy), _KEY)
    if source == "AutocastCPU":
        # The CPU runs nn.LSTM through oneDNN's mkldnn_rnn_layer, which it autocasts, so the
        # layer's result is in the autocast dtype; on flagos the layer takes the fused cells
        # PyTorch picks for other devices, which the CPU's policy does not name, and came out
        # float32. The whole layer is cast instead, as the CPU's result is.
        lib.impl("lstm.input", _cpu_lstm_layer(op_overload("aten::lstm.input")), _KEY)
    rest = torch.library.Library("_", "IMPL")
    rest.fallback(torch.library.fallthrough_kernel, dispatch_key=_KEY)
    _lib = (lib, rest)


def _packet(name: str) -> str:
    return name.split(".", 1)[0]


_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _kernel(op, policy):
    def autocast_kernel(*args, **kwargs):
        if policy == "lower":
            target = torch.get_autocast_dtype("flagos")
            cast = lambda t: t.to(target) if t.dtype == torch.float32 else t  # noqa: E731
        elif policy == "fp32":
            cast = lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t  # noqa: E731
        else:
            widest = _widest(args, kwargs)
            cast = lambda t: t.to(widest) if widest is not None else t  # noqa: E731
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            args, kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: cast(t) if _eligible(t) else t, (args, kwargs))
            return op(*args, **kwargs)
    autocast_kernel.__name__ = f"autocast_{op_name(op).replace('::', '_').replace('.', '_')}"
    return autocast_kernel


def _cpu_lstm_layer(op):
    """aten::lstm.input as the CPU autocasts it: in the autocast dtype where the CPU would run
    oneDNN's layer (RNN.cpp's use_mkldnn: oneDNN on, no projections, a non-empty float32
    input), as it is elsewhere (projections: the cells in float32, the projection in the
    autocast dtype, as for any op)."""
    lower = _kernel(op, "lower")

    def autocast_lstm(input, hx, params, *rest):
        projections = len(hx) > 1 and hx[0].size(-1) != hx[1].size(-1)
        if (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and not projections and input.numel() != 0 and input.dtype == torch.float32):
            return lower(input, hx, params, *rest)
        # its parts, each under autocast's policy, as without this kernel
        below = torch._C._dispatch_keys(input).remove(torch._C.DispatchKey.AutocastPrivateUse1)
        return op.redispatch(below, input, hx, params, *rest)
    return autocast_lstm


def _eligible(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.dtype != torch.float64 and t.device.type == "flagos"


def _widest(args, kwargs):
    dtypes = [t.dtype for t in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and _eligible(t)]
    if not dtypes:
        return None
    return dtypes[0] if len(set(dtypes)) == 1 else torch.float32
