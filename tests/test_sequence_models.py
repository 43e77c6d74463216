"""Recurrent models, packed sequences and CTC loss on flagos give what they give on the CPU:
forward, gradients, under no_grad and inference mode.

On a PrivateUse1 device PyTorch's RNNs call fused cells that only CUDA has kernels for, packed
sequences keep their batch sizes on the host, and CTC loss takes host length tensors
(flagos/runtime/_sequences.py)."""
import contextlib

import pytest
import torch
from conftest import assert_close, device_mode_only

import flagos

pytestmark = device_mode_only
MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode}

# (module, input size, extra arguments); each of them is an LSTM or GRU path of RNN.cpp
RNNS = {
    "lstm": (torch.nn.LSTM, dict(input_size=4, hidden_size=6, num_layers=2)),
    "lstm_bidirectional_batch_first": (torch.nn.LSTM, dict(input_size=4, hidden_size=5,
                                                           bidirectional=True, batch_first=True)),
    "lstm_no_bias_proj": (torch.nn.LSTM, dict(input_size=4, hidden_size=6, bias=False, proj_size=3)),
    "gru": (torch.nn.GRU, dict(input_size=4, hidden_size=6, num_layers=2)),
    "gru_bidirectional_no_bias": (torch.nn.GRU, dict(input_size=4, hidden_size=5, bias=False,
                                                     bidirectional=True)),
}


def _run_rnn(module, x, dev, mode, packed_lengths=None):
    """Outputs, final states and (in grad mode) every parameter's and the input's gradient."""
    x = x.detach().to(dev, copy=True).requires_grad_(mode == "grad")
    inp = x
    if packed_lengths is not None:
        inp = torch.nn.utils.rnn.pack_padded_sequence(x, packed_lengths, batch_first=module.batch_first,
                                                      enforce_sorted=False)
    with MODES[mode]():
        out, state = module(inp)
        lengths = []
        if packed_lengths is not None:
            out, padded_lengths = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=module.batch_first)
            assert padded_lengths.device.type == "cpu"
            lengths = [padded_lengths]
    states = list(state) if isinstance(state, tuple) else [state]
    results = [out, *states, *lengths]
    if mode == "grad":
        (out.square().mean() + sum(s.sum() for s in states)).backward()
        results += [x.grad] + [p.grad for p in module.parameters()]
    return results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", RNNS)
def test_rnns_match_cpu(dev, name, mode):
    cls, kwargs = RNNS[name]
    torch.manual_seed(0)
    ref = cls(**kwargs)
    model = cls(**kwargs)
    model.load_state_dict(ref.state_dict())
    model.to(dev)
    shape = (3, 7, 4) if kwargs.get("batch_first") else (7, 3, 4)
    x = torch.randn(shape)
    want = _run_rnn(ref, x, "cpu", mode)
    got = _run_rnn(model, x, dev, mode)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device == dev
        assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_packed_sequences_match_cpu(dev, cls, mode):
    """pack_padded_sequence with host lengths, unsorted: the batch sizes stay on the host, as
    PackedSequence insists, and pad_packed_sequence returns its lengths there."""
    torch.manual_seed(1)
    ref = cls(4, 5, batch_first=True)
    model = cls(4, 5, batch_first=True)
    model.load_state_dict(ref.state_dict())
    model.to(dev)
    x = torch.randn(3, 6, 4)
    lengths = [4, 6, 2]
    packed = torch.nn.utils.rnn.pack_padded_sequence(x.to(dev), torch.tensor(lengths), batch_first=True,
                                                     enforce_sorted=False)
    assert packed.data.device == dev and packed.batch_sizes.device.type == "cpu"
    assert torch.equal(packed.batch_sizes, torch.tensor([3, 3, 2, 2, 1, 1]))
    want = _run_rnn(ref, x, "cpu", mode, lengths)
    got = _run_rnn(model, x, dev, mode, lengths)
    for g, w in zip(got, want):
        assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell])
def test_cells_match_cpu_with_double_backward(dev, cls):
    """A cell step, and a gradient of a gradient (PyTorch's differentiable cell backward)."""
    torch.manual_seed(2)
    ref = cls(3, 4)
    cell = cls(3, 4)
    cell.load_state_dict(ref.state_dict())
    cell.to(dev)
    x = torch.randn(2, 3)
    results = []
    for module, device in ((ref, "cpu"), (cell, dev)):
        inp = x.to(device).requires_grad_()
        out = module(inp)
        h = out[0] if isinstance(out, tuple) else out
        (g,) = torch.autograd.grad(h.square().sum(), inp, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), inp)
        results.append((h, g, gg))
    for got, want in zip(results[1], results[0]):
        assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_missing_cell_gradient_counts_as_zero(dev):
    """Only the final hidden state reaches the loss: the cell state's gradient is undefined,
    and the fused backward takes it as zero, as CUDA's does."""
    torch.manual_seed(3)
    ref = torch.nn.LSTM(3, 4)
    model = torch.nn.LSTM(3, 4)
    model.load_state_dict(ref.state_dict())
    model.to(dev)
    x = torch.randn(5, 2, 3)
    for module, device in ((ref, "cpu"), (model, dev)):
        module(x.to(device))[1][0].sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lengths_on", ["host tensor", "flagos tensor", "list"])
def test_ctc_loss_matches_cpu(dev, lengths_on, reduction, mode):
    torch.manual_seed(4)
    log_probs = torch.randn(12, 2, 5).log_softmax(2)
    targets = torch.tensor([[1, 2, 2], [3, 4, 1]])
    input_lengths, target_lengths = torch.tensor([12, 10]), torch.tensor([3, 2])

    def loss(device, lp):
        il, tl = input_lengths, target_lengths
        if lengths_on == "flagos tensor" and device != "cpu":
            il, tl = il.to(device), tl.to(device)
        elif lengths_on == "list":
            il, tl = il.tolist(), tl.tolist()
        return torch.nn.functional.ctc_loss(lp, targets.to(device), il, tl, reduction=reduction)

    results = []
    for device in ("cpu", dev):
        lp = log_probs.to(device, copy=True).requires_grad_(mode == "grad")
        with MODES[mode]():
            out = loss(device, lp)
        if mode == "grad":
            out.sum().backward()
            results.append((out, lp.grad))
        else:
            results.append((out,))
    assert results[1][0].device == dev
    for got, want in zip(results[1], results[0]):
        assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("lengths", [torch.tensor([4.0]), torch.tensor([4 + 0j]), torch.tensor([True])],
                         ids=["float", "complex", "bool"])
def test_ctc_loss_refuses_lengths_that_are_not_integers(dev, lengths):
    log_probs = torch.randn(4, 1, 3).log_softmax(2)
    for device in ("cpu", dev):
        with pytest.raises(RuntimeError, match="input_lengths must be integral"):
            torch.nn.functional.ctc_loss(log_probs.to(device), torch.tensor([[1]]).to(device),
                                         lengths, torch.tensor([1]))
        with pytest.raises(RuntimeError, match="target_lengths must be integral"):
            torch.nn.functional.ctc_loss(log_probs.to(device), torch.tensor([[1]]).to(device),
                                         torch.tensor([4]), lengths)


def test_the_cells_route_where_the_payload_device_has_none():
    chip = flagos.core._state.active().chip
    route = flagos.route_of("aten::_thnn_fused_lstm_cell")
    assert route == ("native" if chip.torch_type and not chip.payload_is_host else "override")


def test_a_transformer_encoder_with_a_padding_mask_says_how_to_run(dev):
    """In eval mode, nn.TransformerEncoder turns a padded batch into a strided nested tensor,
    which flagos does not hold: the error names enable_nested_tensor=False, with which the
    tokens the mask keeps get CPU's values (the padded ones are computed instead of zeroed)."""
    torch.manual_seed(5)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    nested = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    with torch.no_grad():
        want = nested(x, src_key_padding_mask=mask)
        nested.to(dev)
        with pytest.raises(RuntimeError, match="enable_nested_tensor=False"):
            nested(x.to(dev), src_key_padding_mask=mask.to(dev))
        dense = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval().to(dev)
        got = dense(x.to(dev), src_key_padding_mask=mask.to(dev))
    kept = ~mask
    assert_close(got.cpu()[kept], want[kept], atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match=r"^aten[.:]+_to_copy\S*: nested tensors of the strided layout are not "
                                           r"supported on flagos"):  # the message names the op
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]).to(dev)
