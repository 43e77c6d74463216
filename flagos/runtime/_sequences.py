"""Sequence-model ops whose PyTorch path on a PrivateUse1 device assumes CUDA kernels or
lengths on the CPU: the fused LSTM and GRU cells, and CTC loss given length tensors.

`nn.LSTM`, `nn.GRU`, `nn.LSTMCell` and `nn.GRUCell` decompose (aten/src/ATen/native/RNN.cpp)
into matmuls and one fused cell per step for CUDA, XPU and PrivateUse1 inputs,
`_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell`, whose kernels (and their backwards') are
CUDA's only: on a chip whose payloads are host tensors, or on a C-ABI chip, the CPU fallback has
nothing to run. There the cells are override kernels made of the pointwise ops of the CUDA
kernels (the same gate order, bias placement, saved gates and gradient formulas), so PyTorch's
own autograd formulas for the cells keep working; a chip whose payload device has the kernels
(cuda) keeps them.

`F.ctc_loss` with length tensors takes, for a tensor subclass, a path that divides the flagos
loss by the host `target_lengths` (a mixed-device op), where a CUDA tensor takes the path that
reads the lengths on the host as lists. flagos gives its tensors that path.
"""
from __future__ import annotations

import torch

from ..core import _routes

_aten = torch.ops.aten
_ctc_lib = None


# ---- the fused RNN cells ----------------------------------------------------------------

def lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)
    ingate, forgetgate = ingate.sigmoid(), forgetgate.sigmoid()
    cellgate, outgate = cellgate.tanh(), outgate.sigmoid()
    cy = forgetgate * cx + ingate * cellgate
    hy = outgate * cy.tanh()
    # the activated gates: what the backward below reads, as CUDA's workspace holds them
    return hy, cy, torch.cat((ingate, forgetgate, cellgate, outgate), 1)


def lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    ingate, forgetgate, cellgate, outgate = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_cell = torch.zeros_like(cy) if grad_cy is None else grad_cy
    if grad_hy is not None:
        grad_cell = grad_cell + grad_hy * outgate * (1 - tanh_cy * tanh_cy)
        grad_out = grad_hy * tanh_cy * outgate * (1 - outgate)
    else:
        grad_out = torch.zeros_like(outgate)
    grad_gates = torch.cat((grad_cell * cellgate * ingate * (1 - ingate),
                            grad_cell * cx * forgetgate * (1 - forgetgate),
                            grad_cell * ingate * (1 - cellgate * cellgate),
                            grad_out), 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_cell * forgetgate, grad_bias


def gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:  # inside the reset gate's product for the new gate, as on CUDA
        hidden_gates = hidden_gates + hidden_bias
    i_reset, i_input, i_new = input_gates.chunk(3, 1)
    h_reset, h_input, h_new = hidden_gates.chunk(3, 1)
    resetgate = (i_reset + h_reset).sigmoid()
    inputgate = (i_input + h_input).sigmoid()
    newgate = (i_new + resetgate * h_new).tanh()
    hy = (hx - newgate) * inputgate + newgate
    return hy, torch.cat((resetgate, inputgate, newgate, hx, h_new), 1)


def gru_cell_backward(grad_hy, workspace, has_bias):
    resetgate, inputgate, newgate, hx, h_new = workspace.chunk(5, 1)
    grad_input = grad_hy * (hx - newgate) * inputgate * (1 - inputgate)
    grad_new = grad_hy * (1 - inputgate) * (1 - newgate * newgate)
    grad_reset = grad_new * h_new * resetgate * (1 - resetgate)
    grad_input_gates = torch.cat((grad_reset, grad_input, grad_new), 1)
    grad_hidden_gates = torch.cat((grad_reset, grad_input, grad_new * resetgate), 1)
    if has_bias:
        return (grad_input_gates, grad_hidden_gates, grad_hy * inputgate,
                grad_input_gates.sum(0), grad_hidden_gates.sum(0))
    return grad_input_gates, grad_hidden_gates, grad_hy * inputgate, None, None


CELL_KERNELS = {
    "aten::_thnn_fused_lstm_cell": lstm_cell,
    "aten::_thnn_fused_lstm_cell_backward_impl": lstm_cell_backward,
    "aten::_thnn_fused_gru_cell": gru_cell,
    "aten::_thnn_fused_gru_cell_backward": gru_cell_backward,
}


# ---- CTC loss with length tensors -------------------------------------------------------

def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1,
             zero_infinity=False):
    """ctc_loss.Tensor as PyTorch runs it for a CUDA tensor: the lengths read on the host."""
    for name, lengths in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise RuntimeError(f"{name} must be integral")
    return _aten.ctc_loss.IntList(log_probs, targets, input_lengths.tolist(),
                                  target_lengths.tolist(), blank, reduction, zero_infinity)


# ---- registration -----------------------------------------------------------------------

def register_autograd() -> None:
    """ctc_loss.Tensor for the flagos key, where PyTorch decomposes it (once per process)."""
    global _ctc_lib
    if _ctc_lib is None:
        _ctc_lib = torch.library.Library("aten", "IMPL")
        _ctc_lib.impl("ctc_loss.Tensor", ctc_loss, "AutogradPrivateUse1")


def needed(chip) -> bool:
    """Chips whose payload device has no fused cells: host payloads and C-ABI chips."""
    return getattr(chip, "torch_type", None) is None or chip.payload_is_host


def register(chip) -> None:
    """At device-mode activation (which lasts for the process). Under inference mode
    ctc_loss.Tensor reaches the router whole: a C-ABI chip, which runs its decomposition
    there, gets the host-lengths path too (a host payload runs PyTorch's CPU kernel)."""
    if needed(chip):
        for op, fn in CELL_KERNELS.items():
            _routes.register_kernel(op, fn, chip=chip.name)
    if getattr(chip, "torch_type", None) is None:
        _routes.register_kernel("aten::ctc_loss.Tensor", ctc_loss, chip=chip.name)
