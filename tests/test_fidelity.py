"""Tensor fidelity: the same numbers, the same errors and the same tensor behaviours as plain
PyTorch on CPU. Runs on the suite's chip (cpu, and sim with FLAGOS_TEST_CHIP=sim)."""
import copy
import io
import pickle
import warnings

import pytest
import torch
from conftest import device_mode_only, run_python, runs_once

import flagos
from flagos.runtime import _whole_ops

pytestmark = device_mode_only


def close(actual, expected, **kw):
    torch.testing.assert_close(actual.cpu() if isinstance(actual, torch.Tensor) else actual,
                               expected, **kw)


# ---- conjugate and negative views ---------------------------------------------------------

def test_conjugate_view_times_itself(dev):
    z = torch.tensor([1 + 2j, 3 - 4j])
    zd = z.to(dev)
    close(zd.conj() * zd, torch.tensor([5 + 0j, 25 + 0j]))
    assert zd.conj().is_conj() and not zd.is_conj()


def test_conjugate_view_reads(dev):
    z = torch.randn(3, 4, dtype=torch.complex64)
    zd = z.to(dev)
    close(zd.conj(), z.conj())
    close(zd.conj().resolve_conj(), z.conj().resolve_conj())
    assert not zd.conj().resolve_conj().is_conj()
    close(zd.conj().imag, z.conj().imag)
    # the negative bit on a real tensor (imag of a conjugate view) reaches the wrapper too
    assert zd.conj().imag.is_neg() == z.conj().imag.is_neg()
    assert torch._neg_view(zd.real).is_neg() and not zd.real.is_neg()
    close(zd.conj().real, z.conj().real)
    close(zd.mH @ zd, z.mH @ z, rtol=1e-5, atol=1e-5)
    close(torch._neg_view(zd.real), -z.real)
    close(zd.conj().clone(), z.conj())


def test_complex_ops_keep_their_keyword_arguments(dev):
    """Ops on complex tensors run with the conjugate keys on; their keyword-only arguments
    (alpha, dtype, rounding_mode) must reach the op."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 4, dtype=torch.complex64), torch.randn(3, 4, dtype=torch.complex64)
    ad, bd = a.to(dev), b.to(dev)
    close(torch.add(ad, bd, alpha=2), torch.add(a, b, alpha=2))
    close(torch.sub(ad.conj(), bd, alpha=-3), torch.sub(a.conj(), b, alpha=-3))
    close(torch.sum(ad.conj(), dim=0, dtype=torch.complex128), torch.sum(a.conj(), dim=0, dtype=torch.complex128))
    assert torch.sum(ad, dim=1, dtype=torch.complex128).dtype == torch.complex128


def test_conjugate_through_fft_and_gradients(dev):
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=torch.complex64)
    close(torch.fft.hfftn(x.to(dev)), torch.fft.hfftn(x), rtol=1e-4, atol=1e-4)

    abs_, ang = torch.rand(5) + 0.5, torch.randn(5)
    grads = []
    for device in ("cpu", dev):
        a = abs_.to(device).detach().requires_grad_()
        t = ang.to(device).detach().requires_grad_()
        torch.polar(a, t).abs().pow(2).sum().backward()
        grads.append((a.grad.cpu(), t.grad.cpu()))
    close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-5)


def test_eigen_decomposition_gradient(dev):
    torch.manual_seed(0)
    m = torch.randn(4, 4, dtype=torch.float64)
    grads = []
    for device in ("cpu", dev):
        a = m.to(device).detach().requires_grad_()
        vals, vecs = torch.linalg.eig(a)
        (vals.abs().sum() + vecs.abs().sum()).backward()
        grads.append(a.grad.cpu())
    close(grads[1], grads[0], rtol=1e-6, atol=1e-6)


def test_composite_ops_that_conjugate_inside(dev):
    """pinv and lstsq reach the router whole and build conjugate views inside: the chip op
    must run with PyTorch's conjugate fallback on, as on CPU."""
    torch.manual_seed(0)
    a = torch.randn(5, 5, dtype=torch.complex64)
    b = torch.randn(5, 2, dtype=torch.complex64)
    close(torch.linalg.pinv(a.to(dev)), torch.linalg.pinv(a), rtol=1e-4, atol=1e-4)
    close(torch.linalg.lstsq(a.to(dev), b.to(dev)).solution, torch.linalg.lstsq(a, b).solution,
          rtol=1e-4, atol=1e-4)


# ---- .data assignment --------------------------------------------------------------------

def test_data_assignment_takes_the_new_values(dev):
    w = torch.zeros(2, 3, device=dev)
    w.data = torch.ones(4, 3, device=dev)
    assert w.shape == (4, 3)
    assert w.sum().item() == 12.0
    w.data = torch.arange(6.0, device=dev).reshape(2, 3)
    close(w * 2, torch.arange(6.0).reshape(2, 3) * 2)


def test_resize_token_embeddings_then_train_like_plain_pytorch(dev, ref):
    transformers = pytest.importorskip("transformers")
    losses, grads = [], []
    for device in (ref, dev):   # the new rows' random numbers are the payload device's
        config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                         n_head=2, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).to(device)   # resizing updates config
        torch.manual_seed(1)
        model.resize_token_embeddings(60)
        ids = torch.arange(12).reshape(2, 6).add(48).to(device)   # uses the new rows
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach().cpu())
        grads.append(model.transformer.wte.weight.grad.cpu())
    close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


# ---- host views: tolist, numpy, format, deepcopy -----------------------------------------

def test_tolist_item_and_format(dev):
    t = torch.arange(6).reshape(2, 3)
    assert t.to(dev).tolist() == t.tolist()
    assert torch.tensor(2.5).to(dev).tolist() == 2.5
    s = torch.tensor(12345.678).to(dev)
    assert f"{s:.3e}" == f"{torch.tensor(12345.678):.3e}" == "1.235e+04"
    assert f"{torch.tensor(3).to(dev):>4}" == "   3"


def test_torch_tensor_of_flagos_scalars_reads_their_values_as_on_cpu(dev):
    """torch.tensor([a, b]) of 0-dim tensors reads each with item() while PyTorch keeps the
    Python key out, so the read reaches the flagos key itself (it hit an internal assert)."""
    values = [torch.tensor(1.5), torch.tensor(-2.0), torch.tensor(3, dtype=torch.int64)]
    on_flagos = [v.to(dev) for v in values]
    for data in (on_flagos[:2], [on_flagos[:1], on_flagos[1:2]], [on_flagos[2], 7]):
        expected = torch.tensor([[v.cpu() for v in d] if isinstance(d, list) else d.cpu() if
                                 isinstance(d, torch.Tensor) else d for d in data])
        got = torch.tensor(data)
        assert got.device.type == "cpu" and got.dtype == expected.dtype and torch.equal(got, expected)
        placed = torch.tensor(data, device=dev, dtype=torch.float64)
        assert placed.device == dev and torch.equal(placed.cpu(), expected.double())
    with pytest.raises(ValueError, match="only one element tensors"):
        torch.tensor([torch.ones(2, device=dev)])  # CPU's error for a tensor that is no scalar


def test_numpy_says_to_copy_to_the_host_first(dev):
    t = torch.arange(3.0).to(dev)
    with pytest.raises(TypeError, match=r"can't convert flagos:0 device type tensor to numpy\. "
                                        r"Use Tensor\.cpu\(\)"):
        t.numpy()
    assert t.cpu().numpy().tolist() == [0.0, 1.0, 2.0]
    assert t.numpy(force=True).tolist() == [0.0, 1.0, 2.0]
    # force is keyword-only, as on the CPU
    for tensor in (torch.arange(3.0), t):
        with pytest.raises(TypeError, match="positional argument"):
            tensor.numpy(True)


def test_a_parameter_rebuilt_from_its_type_is_a_parameter_as_on_cpu(dev):
    """Libraries rebuild a parameter as `type(param)(tensor)` (accelerate's offload hooks): on
    flagos, where type(param) is the flagos tensor type, that is a parameter requiring grad
    unless told otherwise, as nn.Parameter(tensor) is on the CPU."""
    for param in (torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3).to(dev))):
        rebuilt = type(param)(param.detach() * 2)
        assert isinstance(rebuilt, torch.nn.Parameter) and rebuilt.requires_grad
        assert rebuilt.device == param.device and torch.equal(rebuilt.cpu(), param.detach().cpu() * 2)
        assert type(param)(param.detach(), requires_grad=False).requires_grad is False


def test_deepcopy_of_tensors_and_modules(dev):
    t = torch.randn(3, 4).to(dev).requires_grad_()
    t.grad = torch.ones(3, 4, device=dev)
    c = copy.deepcopy(t)
    assert c is not t and c.device == t.device and c.requires_grad
    close(c, t.detach().cpu())
    close(c.grad, torch.ones(3, 4))
    c.detach().add_(1)                         # the copy owns its memory
    close(t.detach(), c.detach().cpu() - 1)
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2).to(dev)
    m2 = copy.deepcopy(m)
    x = torch.randn(3, 4)
    close(m2(x.to(dev)), m(x.to(dev)).detach().cpu())
    inputs = {"ids": torch.arange(4).to(dev), "mask": torch.ones(4, device=dev)}
    copied = copy.deepcopy(inputs)
    assert copied["ids"].tolist() == [0, 1, 2, 3]
    # Libraries mark tensors with attributes (transformers' `_is_hf_initialized`): a copy has
    # its own copy of each, as on CPU.
    for source in (torch.ones(2), torch.ones(2, device=dev)):
        source.marks = ["initialized"]
        copied = copy.deepcopy(source)
        assert copied.marks == ["initialized"] and copied.marks is not source.marks
        assert "_payload" not in vars(copied) or copied._payload is not source._payload


# ---- layouts of results -----------------------------------------------------------------

@pytest.mark.parametrize("shape", [(8, 8), (1, 8), (8, 1), (), (0, 3), (3, 0, 2), (2, 1, 3, 4)])
def test_result_layouts_match_cpu(dev, shape):
    """Contiguous results get their wrapper by a shorter call than strided ones: sizes, strides,
    offsets and contiguity of both kinds, and of the wrapper against its payload, as on CPU."""
    torch.manual_seed(0)
    x = torch.randn(shape)
    xd = x.to(dev)
    pairs = [(x + 1, xd + 1), (x.transpose(0, -1) if x.dim() else x,
                               xd.transpose(0, -1) if xd.dim() else xd),
             (x.expand(2, *shape) * 1, xd.expand(2, *shape) * 1),
             (torch.nn.functional.layer_norm(x, shape[-1:]) if x.dim() else x,
              torch.nn.functional.layer_norm(xd, shape[-1:]) if xd.dim() else xd)]
    if x.numel() > 1:
        pairs.append((x.reshape(-1)[1:], xd.reshape(-1)[1:]))
        pairs.append((x.transpose(0, -1).contiguous(), xd.transpose(0, -1).contiguous()))
    if x.dim() == 2 and x.numel():
        pairs.append((x @ x.t(), xd @ xd.t()))
        pairs.append((torch.empty_strided((2, 3), (1, 2)).fill_(1.0),
                      torch.empty_strided((2, 3), (1, 2), device=dev).fill_(1.0)))
    for ref, out in pairs:
        assert (out.shape, out.stride(), out.storage_offset(), out.is_contiguous()) == \
            (ref.shape, ref.stride(), ref.storage_offset(), ref.is_contiguous())
        payload = out._payload
        if isinstance(payload, torch.Tensor):
            assert (out.stride(), out.storage_offset()) == (payload.stride(), payload.storage_offset())
        close(out, ref)


# ---- inference mode ----------------------------------------------------------------------

def test_views_under_inference_mode(dev):
    x = torch.arange(12.0).reshape(3, 4).to(dev)
    with torch.inference_mode():
        v = x[1]
        assert not v.is_inference()                 # as on CPU: a view of a normal tensor
        close(v * 2, torch.arange(4.0, 8.0) * 2)
        y = torch.ones(2, 3, device=dev)
        assert y.is_inference() and y[0].is_inference()
        z = (x @ torch.ones(4, 2, device=dev)).t()
    close(y, torch.ones(2, 3))
    close(z, (torch.arange(12.0).reshape(3, 4) @ torch.ones(4, 2)).t())


@pytest.mark.parametrize("made_inside", [False, True], ids=["normal tensor", "inference tensor"])
def test_maybe_views_under_inference_mode_copy_when_they_must(dev, made_inside):
    """reshape, flatten, contiguous and to are decompositions that reach the chip whole under
    inference mode: a view where the layout allows, a copy where it does not, as on CPU."""
    ops = {"reshape": lambda t: t.transpose(1, 2).reshape(2, 12),
           "flatten": lambda t: t.transpose(1, 2).flatten(1),
           "contiguous": lambda t: t.transpose(1, 2).contiguous(),
           "reshape as a view": lambda t: t.reshape(6, 4),
           "to a dtype": lambda t: t.transpose(1, 2).to(torch.float64),
           "to its own dtype": lambda t: t.to(torch.float32)}
    x = torch.arange(24.0).reshape(2, 3, 4)
    with torch.inference_mode(made_inside):
        fx = x.to(dev)
        for name, op in ops.items():
            ref, out = op(x.clone()), op(fx)
            assert (out.shape, out.stride(), out.dtype) == (ref.shape, ref.stride(), ref.dtype), name
            close(out, ref)
    with torch.inference_mode():
        view, copy = fx.reshape(6, 4), fx.transpose(1, 2).reshape(2, 12)
        view.add_(100)  # a view writes through to its base; the copy kept the old values
    close(fx, x + 100)
    close(copy, x.transpose(1, 2).reshape(2, 12))


def test_views_of_a_parameter_under_inference_mode_as_on_cpu(dev):
    """chunk and narrow are decompositions that reach a C-ABI chip whole under inference mode;
    of a tensor that requires grad (multi-head attention chunks its packed in-projection weight)
    their parts' views carried autograd's view metadata, and PyTorch refused to make the op's
    views of them ("Attempted to make a tensor into a differentiable view")."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4))
    on_chip = torch.nn.Parameter(weight.detach().to(dev))
    ops = {"chunk": lambda t: t.chunk(3), "narrow": lambda t: t.narrow(0, 1, 2),
           "split": lambda t: t.split(4), "unbind": lambda t: t.unbind(1)}
    for name, op in ops.items():
        with torch.inference_mode():
            want, got = op(weight), op(on_chip)
        want, got = (list(want), list(got)) if isinstance(want, tuple) else ([want], [got])
        assert [(t.is_inference(), t._is_view(), t.requires_grad) for t in got] == \
            [(t.is_inference(), t._is_view(), t.requires_grad) for t in want], name
        for g, w in zip(got, want):
            close(g, w.detach())
    attention = torch.nn.MultiheadAttention(4, 2)
    on_chip_attention = torch.nn.MultiheadAttention(4, 2).to(dev)
    on_chip_attention.load_state_dict(attention.state_dict())
    q = torch.randn(3, 2, 4)
    with torch.inference_mode():
        want_out, want_weights = attention(q, q, q)
        got_out, got_weights = on_chip_attention(q.to(dev), q.to(dev), q.to(dev))
    close(got_out, want_out, rtol=1e-5, atol=1e-6)
    close(got_weights, want_weights, rtol=1e-5, atol=1e-6)


def test_a_lazy_module_first_runs_under_inference_mode_as_on_cpu(dev):
    """A lazy module's first forward under inference mode gives its parameters their data with
    `param.data = torch.empty(...)`, an inference tensor for a normal one: PyTorch allows it
    between two dense tensors of one device (`_has_compatible_shallow_copy_type`), and a C-ABI
    chip answered no."""
    model, on_chip = torch.nn.LazyLinear(3), torch.nn.LazyLinear(3).to(dev)
    x = torch.randn(2, 4)
    torch.manual_seed(1)  # the weights are drawn at the first forward, on each one's device
    with torch.inference_mode():
        want = model(x)
    torch.manual_seed(1)
    with torch.inference_mode():
        got = on_chip(x.to(dev))
    close(got, want)
    assert on_chip.weight.is_inference() == model.weight.is_inference()
    assert torch._has_compatible_shallow_copy_type(on_chip.weight, torch.ones(1, device=dev))


def test_sentence_transformers_style_encode_in_inference_mode(dev):
    """sentence-transformers' encode(): a model made outside inference_mode, run inside it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.inference_mode():
        ref = model(input_ids=ids).last_hidden_state.mean(1)
    model = model.to(dev)
    with torch.inference_mode():
        out = model(input_ids=ids.to(dev)).last_hidden_state.mean(1)
        emb = torch.nn.functional.normalize(out, dim=1)
    close(out, ref, rtol=1e-4, atol=1e-5)
    close(emb, torch.nn.functional.normalize(ref, dim=1), rtol=1e-4, atol=1e-5)


# ---- sparse layouts ----------------------------------------------------------------------

def test_sparse_tensors_get_a_clear_error(dev):
    with pytest.raises(RuntimeError, match=r"sparse tensors are not supported on flagos"):
        torch.ones(3).to_sparse().to(dev)
    with pytest.raises(RuntimeError, match=r"sparse tensors are not supported on flagos"):
        torch.ones(3, device=dev).to_sparse()
    with pytest.raises(RuntimeError, match=r"sparse tensors are not supported on flagos"):
        torch.eye(3).to_sparse_csr().to(dev)
    for layout in (torch.sparse_coo, torch.sparse_csr):  # factories that reach the sparse keys
        with pytest.raises(RuntimeError, match=r"^aten[.:]+empty\S*: sparse tensors are not supported on flagos"):
            torch.empty((2, 2), layout=layout, device=dev)  # the message names the op
    embedding = torch.nn.Embedding(5, 2, sparse=True).to(dev)
    loss = embedding(torch.tensor([1, 3], device=dev)).sum()
    with pytest.raises(RuntimeError, match=r"sparse tensors are not supported.*make it with sparse=False"):
        loss.backward()  # a sparse gradient: the error names the layer's option
    assert (torch.ones(3, device=dev) + 1).sum().item() == 6.0  # nothing else is affected


def test_quantized_tensors_where_the_payload_holds_them_and_a_clear_error_elsewhere(dev):
    """A torch-native chip's payload device quantizes (the cpu chip: CPU's quantized tensors);
    a C-ABI chip's buffers hold no quantized tensor, and no chip takes one moved from the host:
    each refusal says what to do, and the process goes on."""
    x = torch.randn(4, 4)
    want = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
    with pytest.raises(RuntimeError, match=r"^aten[.:]+\w+\S*: a quantized tensor cannot be moved to flagos"):
        want.to(dev)
    if flagos.core._state.active().chip.torch_type is None:
        with pytest.raises(RuntimeError, match="quantized tensors are not supported on a C-ABI chip"):
            torch.quantize_per_tensor(x.to(dev), 0.1, 0, torch.qint8)
    else:
        got = torch.quantize_per_tensor(x.to(dev), 0.1, 0, torch.qint8)
        assert got.dtype == torch.qint8 and torch.equal(got.dequantize().cpu(), want.dequantize())
    assert torch.equal((x.to(dev) + 1).cpu(), x + 1)


# ---- copies between views of one tensor -----------------------------------------------------

OVERLAPPING_COPIES = {
    "shifted by a row": lambda b: b[1:].copy_(b[:-1]),
    "shifted by an element": lambda b: b.view(-1)[1:].copy_(b.view(-1)[:-1]),
    "a square tensor's own transpose": lambda b: b.view(8, 6)[:6].copy_(b.view(8, 6)[:6].t()),
    "as int32, shifted": lambda b: b.view(torch.int32).view(-1)[1:].copy_(b.view(torch.int32).view(-1)[:-1]),
    "the same view": lambda b: b[1:].copy_(b[1:]),
    "itself": lambda b: b.copy_(b),
    "its own negative view": lambda b: b.copy_(torch._neg_view(b)),
    "disjoint halves": lambda b: b[:3].copy_(b[3:]),
    "as float16 halves": lambda b: b.view(-1)[:24].copy_(b.view(-1)[24:].half()),
    "disjoint halves, into the second": lambda b: b[3:].copy_(b[:3]),
    "one element read with another stride": lambda b: b.view(-1).as_strided((1, 1), (1, 1), 2).copy_(
        b.view(-1).as_strided((1, 1), (4, 1), 2)),
    "an empty view inside a float64 element": lambda b: b.view(-1)[5:5].copy_(
        b.view(-1).view(torch.float64)[2:3]),
    # a view with gaps: PyTorch cannot tell, and copies (each element read before it is written)
    "even elements from the odd ones": lambda b: b.view(-1)[0::2].copy_(b.view(-1)[1::2]),
    "the first half from its even elements": lambda b: b.view(-1)[:24].copy_(b.view(-1)[0::2]),
}


@pytest.mark.parametrize("case", OVERLAPPING_COPIES)
def test_a_copy_between_views_of_one_tensor_is_refused_or_made_as_on_cpu(dev, case):
    """copy_ from a view of the same memory: PyTorch refuses a partial overlap it can see (both
    views dense), copies nothing for the same data, and copies the rest. (Views it cannot tell
    apart, such as a gapped view and its transpose, give values that depend on the order of the
    copy on any device, as PyTorch documents: not compared.)"""
    torch.manual_seed(0)
    base = torch.randn(6, 8)

    def outcome(b):
        try:
            OVERLAPPING_COPIES[case](b)
        except RuntimeError as e:
            return str(e)
        return b.cpu()

    want, got = outcome(base.clone()), outcome(base.to(dev))
    if isinstance(want, str):
        assert got == want
    else:
        assert isinstance(got, torch.Tensor), got
        assert torch.equal(got, want)


FILLS = {
    "a view with gaps": lambda b, c: b[:, ::3].fill_(2),
    "a transposed view": lambda b, c: b.t()[1:].fill_(2),
    "an expanded view": lambda b, c: b[:1].expand(6, 8).fill_(2),
    "an expanded view, zeroed": lambda b, c: b[1:2].expand(3, 8).zero_(),
    "a negative view": lambda b, c: torch._neg_view(b[1:]).fill_(2),
    "a negative view with gaps, zeroed": lambda b, c: torch._neg_view(b[::2]).zero_(),
    "a conjugate view": lambda b, c: c.conj()[:, 1:].fill_(1 + 2j),
    "from a 0-dim tensor of the chip": lambda b, c: b[2:, ::2].fill_(b[0, 0]),
    "int32 from a float": lambda b, c: b.int()[:, 1:].fill_(2.7),
}


@pytest.mark.parametrize("case", FILLS)
def test_fill_and_zero_write_every_view_as_on_cpu(dev, case):
    """fill_ and zero_ write any view of a tensor, an expanded one included (PyTorch skips its
    overlap check for them), through negative and conjugate bits as the CPU does."""
    torch.manual_seed(0)
    base, cbase = torch.randn(6, 8), torch.randn(4, 4, dtype=torch.complex64)
    b, c = base.to(dev), cbase.to(dev)
    got = FILLS[case](b, c)
    want = FILLS[case](base, cbase)
    assert (got.shape, got.stride(), got.is_neg(), got.is_conj()) == \
        (want.shape, want.stride(), want.is_neg(), want.is_conj())
    assert torch.equal(got.cpu(), want)
    assert torch.equal(b.cpu(), base) and torch.equal(c.cpu(), cbase)  # and nothing else written


def test_copy_copy_is_a_new_tensor_over_the_same_memory_as_on_cpu(dev):
    """copy.copy of a tensor shares its memory (PyTorch hands the storage itself to the
    rebuild), keeps requires_grad and the Python attributes, drops the history; a Parameter
    stays a Parameter."""
    def run(device):
        x = torch.arange(4.).to(device).requires_grad_()
        x.note = "kept"
        y = x * 2
        p = torch.nn.Parameter(torch.arange(3.).to(device))
        cx, cy, cp = copy.copy(x), copy.copy(y), copy.copy(p)
        with torch.no_grad():
            cx[0] = 9.0
            cp[1] = 7.0
        return (x.detach().cpu().tolist(), p.detach().cpu().tolist(), cx.requires_grad, cx.is_leaf,
                getattr(cx, "note", None), cy.requires_grad, cy.grad_fn is None,
                isinstance(cp, torch.nn.Parameter), cp.requires_grad, cx.device.type == x.device.type)

    assert run(dev) == run("cpu")


def test_share_memory_is_a_no_op_for_chip_memory_and_keeps_the_values(dev):
    """share_memory_() (torch.multiprocessing, Module.share_memory()) moves host memory to shared
    memory; for an accelerator's memory it is a no-op, as for CUDA."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    fx = x.to(dev)
    assert fx.share_memory_() is fx
    assert fx.device == torch.device(dev) and torch.equal(fx.cpu(), x)
    model = torch.nn.Linear(4, 2).to(dev)
    assert model.share_memory() is model
    close(model(fx), model.cpu()(x))


def test_set_to_another_tensor_shares_its_memory_as_on_cpu(dev):
    """t.set_(source) gives t source's memory, sizes, strides and offset: a write through one
    is seen through the other; set_() leaves it empty; PyTorch's dtype check holds."""
    def run(device):
        base = torch.arange(24.).reshape(4, 6).to(device)
        t = torch.zeros(3).to(device)
        source = base[1:3, ::2]
        assert t.set_(source) is t
        t[0, 1] = -1.0
        layout = (t.shape, t.stride(), t.storage_offset())
        empty = torch.ones(2).to(device).set_()
        with pytest.raises(RuntimeError) as refused:
            torch.zeros(2).to(device).set_(torch.zeros(2, dtype=torch.float64).to(device))
        return layout, base.cpu(), t.cpu(), (empty.shape, empty.cpu()), str(refused.value)

    got, want = run(dev), run("cpu")
    assert got[0] == want[0] and got[3][0] == want[3][0] and got[4] == want[4]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # base[1, 2] became -1
    assert want[1][1, 2] == -1.0


def test_set_to_its_own_storage_lays_the_tensor_out_as_on_cpu(dev):
    def run(device):
        x = torch.arange(12.).to(device)
        x.set_(x.untyped_storage(), 2, (2, 3), (4, 1))
        first = (x.shape, x.stride(), x.storage_offset(), x.cpu().clone())
        x.set_(x.untyped_storage())
        return first, (x.shape, x.cpu())

    (got, got_whole), (want, want_whole) = run(dev), run("cpu")
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])
    assert got_whole[0] == want_whole[0] and torch.equal(got_whole[1], want_whole[1])


# ---- one table row per op across threads -------------------------------------------------

@runs_once
def test_first_calls_from_many_threads_make_one_row_per_op():
    proc = run_python("""
        import sys, threading, warnings, torch, flagos
        flagos.activate("cpu")
        sys.setswitchinterval(1e-6)              # switch threads as often as possible
        ops = [torch.sin, torch.cos, torch.tan, torch.atan, torch.sinh, torch.cosh, torch.erf,
               torch.expm1, torch.log1p, torch.sigmoid, torch.frac, torch.trunc, torch.floor,
               torch.ceil, torch.round, torch.sign, torch.abs, torch.rsqrt, torch.reciprocal]
        x = torch.rand(4, device="flagos")
        flagos.reset_report()
        for op in ops:
            flagos.set_route(f"aten::{op.__name__}", "fallback")
        barrier = threading.Barrier(8)
        def work():
            barrier.wait()
            for op in ops:
                op(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            threads = [threading.Thread(target=work) for _ in range(8)]
            [t.start() for t in threads]
            [t.join() for t in threads]
        rows = [r for r in flagos._C.table() if r["op"] in {f"aten::{op.__name__}" for op in ops}]
        print("ROWS", len(rows), "CALLS", sorted({r["calls"]["fallback"] for r in rows}))
        print("WARNINGS", len([w for w in caught if issubclass(w.category, flagos.FallbackWarning)]))
    """, env={"FLAGOS_FALLBACK": "warn"})
    assert "ROWS 19 CALLS [8]" in proc.stdout, proc.stdout
    assert "WARNINGS 19" in proc.stdout, proc.stdout




# ---- out= arguments the op resizes -----------------------------------------------------------

@pytest.mark.parametrize("route", ["auto", "fallback"])
def test_out_arguments_the_op_resizes_take_the_cpus_shape(dev, route):
    """An out= tensor of the wrong size is resized by the op (PyTorch warns when it held
    elements): afterwards the flagos tensor has the CPU tensor's shape, strides and values."""
    torch.manual_seed(0)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    calls = {"aten::neg.out": lambda x, y, out: torch.neg(x, out=out),
             "aten::add.out": lambda x, y, out: torch.add(x, y, out=out),
             "aten::cat.out": lambda x, y, out: torch.cat([x, y], 1, out=out)}
    for name, call in calls.items():
        if route == "fallback":
            flagos.set_route(name, "fallback")
        for size in (0, 3):  # empty: resized silently; 3 elements: resized with PyTorch's warning
            expected = torch.empty(size)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call(a, b, expected)
                out = torch.empty(size, device=dev)
                call(a.to(dev), b.to(dev), out)
            assert (out.shape, out.stride()) == (expected.shape, expected.stride()), (name, size)
            assert torch.equal(out.cpu(), expected), (name, size)


# ---- out= ops with several results ----------------------------------------------------------

@pytest.mark.parametrize("route", ["auto", "fallback"])
def test_out_ops_with_several_results_return_each_callers_tensor(dev, route):
    """sort/topk/aminmax with two out= tensors, called through torch.ops in inference mode
    (no autograd kernel in between to put the arguments back in place of the dispatch's
    results): the i-th result is the caller's i-th out tensor, as plain PyTorch returns it,
    holding CPU's values, on the chip's kernel and on the fallback."""
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    aten = torch.ops.aten
    calls = {"sort.values": lambda t, a, b: aten.sort.values(t, 1, values=a, indices=b),
             "topk.values": lambda t, a, b: aten.topk.values(t, 2, 1, values=a, indices=b),
             "aminmax.out": lambda t, a, b: aten.aminmax.out(t, dim=1, min=a, max=b)}
    for name, call in calls.items():
        if route == "fallback":
            flagos.set_route(f"aten::{name}", "fallback")
        second = torch.float32 if name == "aminmax.out" else torch.long
        with torch.inference_mode():
            expected = call(x, torch.empty(0), torch.empty(0, dtype=second))
            first, other = torch.empty(0, device=dev), torch.empty(0, dtype=second, device=dev)
            fx = x.to(dev)
            with flagos.track() as report:
                got = call(fx, first, other)
        calls_of = report.op(f"aten::{name}")["calls"]
        # auto: the chip's kernel where it has one (cpu), else the fallback (sim)
        assert (calls_of["fallback"] if route == "fallback" else sum(calls_of.values())) == 1, \
            (name, calls_of)
        assert got[0] is first and got[1] is other, name
        close(first, expected[0])
        close(other, expected[1], atol=0, rtol=0)


# ---- ops that return a list of tensors --------------------------------------------------------

@pytest.mark.parametrize("route", ["auto", "fallback"])
def test_ops_returning_a_list_give_flagos_tensors_with_the_cpus_values(dev, route):
    """The foreach ops (optimizers with foreach=True) and other Tensor[] results: each result
    is a flagos tensor on the inputs' device holding CPU's values, on the chip's kernel and on
    the fallback; the in-place forms change the caller's tensors."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 5), torch.randn(3)]
    calls = {"_foreach_add.Scalar": lambda ts: torch._foreach_add(ts, 1.5),
             "_foreach_mul.List": lambda ts: torch._foreach_mul(ts, ts),
             "unbind_copy.int": lambda ts: torch.unbind_copy(ts[0], 1)}
    for name, call in calls.items():
        if route == "fallback":
            flagos.set_route(f"aten::{name}", "fallback")
        expected = call(xs)
        got = call([x.to(dev) for x in xs])
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), name
        for g, e in zip(got, expected):
            assert g.device == dev, (name, g.device)
            assert torch.equal(g.cpu(), e), name
    if route == "fallback":
        flagos.set_route("aten::_foreach_add_.Scalar", "fallback")
    on_chip = [x.to(dev) for x in xs]
    assert torch._foreach_add_(on_chip, 2.0) is on_chip   # as on CPU: the caller's own list
    for t, x in zip(on_chip, xs):
        assert t.device == dev and torch.equal(t.cpu(), x + 2.0)


def test_inplace_view_ops_change_the_tensors_own_shape(dev):
    """t_, unsqueeze_, squeeze_, transpose_, as_strided_ and resize_ change the layout of the
    tensor they are called on: the flagos tensor says what the CPU tensor says."""
    cases = [  # (op, shape, elements to compare: resize_ leaves its new ones unset)
        (lambda t: t.t_(), (2, 3), 6),
        (lambda t: t.unsqueeze_(0), (4,), 4),
        (lambda t: t.squeeze_(1), (3, 1, 2), 6),
        (lambda t: t.transpose_(0, 2), (2, 3, 4), 24),
        (lambda t: t.as_strided_((2, 2), (1, 2)), (6,), 4),
        (lambda t: t.resize_(3, 3), (2, 3), 6),
    ]
    for op, shape, kept in cases:
        torch.manual_seed(0)
        host = torch.randn(*shape)
        on_flagos = host.to(dev)
        assert op(on_flagos) is on_flagos
        op(host)
        assert (on_flagos.shape, on_flagos.stride()) == (host.shape, host.stride())
        assert on_flagos.storage_offset() == host.storage_offset()
        assert torch.equal(on_flagos.cpu().flatten()[:kept], host.flatten()[:kept])
    # only the storage offset changes (the same sizes and strides): the flagos tensor follows
    host, on_flagos = torch.arange(10.0)[:3], torch.arange(10.0).to(dev)[:3]
    for t in (host, on_flagos):
        assert t.as_strided_((3,), (1,), 4) is t
    assert on_flagos.storage_offset() == host.storage_offset() == 4
    assert on_flagos.cpu().tolist() == host.tolist() == [4.0, 5.0, 6.0]


# ---- deepcopy -------------------------------------------------------------------------------

DEEPCOPIED = {
    "views of one tensor": lambda dev: (lambda x: [x, x[1:], x.view(2, 3), x[::2], x.view(torch.int32)])(
        torch.arange(6.0).to(dev)),
    "a negative view": lambda dev: (lambda x: [x, torch._neg_view(x)])(torch.arange(4.0).to(dev)),
    "channels_last": lambda dev: [torch.randn(2, 3, 4, 5).to(dev).contiguous(memory_format=torch.channels_last)],
    "a leaf and its detached self": lambda dev: (lambda x: [x, x.detach()])(
        torch.ones(3, device=dev, requires_grad=True)),
    "0-dim and empty": lambda dev: [torch.tensor(3.0).to(dev), torch.empty(0, 3).to(dev)],
}


@pytest.mark.parametrize("case", DEEPCOPIED)
def test_deepcopy_copies_memory_once_as_on_cpu(dev, case):
    """copy.deepcopy copies each piece of memory once per call, as PyTorch does: the copies of
    tensors that shared memory (views, a state dict's tied weights) share the copied memory,
    with the originals' sizes, strides, offsets and autograd flags."""
    torch.manual_seed(0)
    host = copy.deepcopy(DEEPCOPIED[case](torch.device("cpu")))
    torch.manual_seed(0)
    original = DEEPCOPIED[case](dev)
    copied = copy.deepcopy(original)

    def layout(ts):
        return [(t.shape, t.stride(), t.storage_offset(), t.dtype, t.requires_grad, t.is_leaf) for t in ts]

    def sharing(ts):  # which tensors share memory (empty ones hold none)
        return [[a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                 for b in ts] for a in ts]

    assert layout(copied) == layout(host) and sharing(copied) == sharing(host)
    assert all(t.device == dev for t in copied)
    assert not any(c.numel() and c.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
                   for c, o in zip(copied, original))  # new memory
    for c, h in zip(copied, host):
        assert torch.equal(c.detach().cpu(), h.detach())
    if case == "views of one tensor":  # writing through one copy shows in the others, as on CPU
        copied[0].add_(1)
        host[0].add_(1)
        assert [c.cpu().tolist() for c in copied] == [h.tolist() for h in host]


def test_deepcopy_of_a_state_dict_keeps_tied_weights_tied(dev):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    state = copy.deepcopy(model.to(dev).state_dict())
    tied = state["lm_head.weight"], state["transformer.wte.weight"]
    assert tied[0] is not tied[1] and tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()
    assert tied[0].data_ptr() != model.lm_head.weight.data_ptr() and torch.equal(tied[0].cpu(), tied[1].cpu())


class _Tagged(torch.Tensor):
    """A tensor subclass of a program's own (torchvision's tv_tensors are made this way)."""

    def describe(self):
        return f"tagged {tuple(self.shape)}"


class _Noted(torch.Tensor):
    """One with a __torch_function__ of its own, which marks its results."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, _Noted) and not hasattr(out, "note"):
            out.note = func.__name__
        return out


def test_tensor_subclasses_of_the_program_hold_flagos_tensors_as_on_cpu(dev):
    """`t.to(device)`, `as_subclass` and every op keep a __torch_function__ subclass, as on
    CPU; results leaving flagos are the program's class again; autograd goes through."""
    x = torch.randn(4)
    tagged = x.as_subclass(_Tagged)
    moved = tagged.to(dev)
    assert isinstance(moved, _Tagged) and moved.device == dev and moved.describe() == "tagged (4,)"
    result = (moved * 2 + 1).softmax(0)
    assert isinstance(result, _Tagged) and result.device == dev
    assert type(result) is type(moved)  # one class for the program's class on flagos
    close(result, (tagged * 2 + 1).softmax(0))
    back = result.cpu()
    assert type(back) is _Tagged and back.device.type == "cpu"
    assert moved.add_(1) is moved  # in place: the same object, as on CPU
    base = torch.zeros(3, device=dev)
    view = base.as_subclass(_Tagged)
    view.add_(5)
    assert base.tolist() == [5.0, 5.0, 5.0]  # as_subclass shares the memory
    leaf = x.to(dev).requires_grad_()
    (leaf.as_subclass(_Tagged) ** 2).sum().backward()
    close(leaf.grad, 2 * x)
    on_cpu = torch.ones(2).as_subclass(_Noted) + 1
    noted = torch.ones(2).as_subclass(_Noted).to(dev) + 1
    assert isinstance(noted, _Noted) and noted.note == on_cpu.note and noted.tolist() == [2.0, 2.0]
    module = torch.nn.Module()
    module.register_buffer("mask", torch.ones(2).as_subclass(_Tagged))
    module.to(dev)
    assert isinstance(module.mask, _Tagged) and module.mask.device == dev
    module.mask.note = "kept"  # saved as from the CPU: its class and attributes
    for location, on in ((None, dev), ("cpu", torch.device("cpu"))):
        buf = io.BytesIO()
        torch.save(module.mask, buf)
        buf.seek(0)
        loaded = torch.load(buf, map_location=location, weights_only=False)
        assert isinstance(loaded, _Tagged) and loaded.device == on and loaded.note == "kept"
        assert loaded.tolist() == [1.0, 1.0]
    assert isinstance(pickle.loads(pickle.dumps(module.mask)), _Tagged)


    class Dispatching(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with pytest.raises(TypeError, match="Dispatching has a __torch_dispatch__ of its own.*__torch_function__ only"):
        torch.ones(2, device=dev).as_subclass(Dispatching)


class _Logged(torch.Tensor):
    """A wrapper subclass of the program with a __torch_dispatch__ of its own (as PyTorch's
    LoggingTensor, torchao's quantized weights, DTensor): it holds a tensor of any device."""

    @staticmethod
    def __new__(cls, inner, log):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   strides=inner.stride())

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs or {}))
        log = next(a.log for a in flat if isinstance(a, _Logged))
        log.append(func.__name__)
        args, kwargs = torch.utils._pytree.tree_unflatten([a.inner if isinstance(a, _Logged) else a for a in flat], spec)
        out = func(*args, **kwargs)
        return _Logged(out, log) if isinstance(out, torch.Tensor) else out


def test_a_dispatch_subclass_of_the_program_handles_ops_mixed_with_flagos_tensors(dev):
    """PyTorch gives an op to each argument's __torch_dispatch__ in turn until one does not
    answer NotImplemented: flagos's defers to a subclass of the program, whichever argument
    comes first, and that subclass calls flagos back with flagos tensors (it was routed as if
    the subclass were a flagos tensor: a wrong result, or a device error)."""
    results = {}
    for device in ("cpu", dev):
        log = []
        held, plain = _Logged(torch.arange(4.0).to(device), log), torch.full((4,), 2.0).to(device)
        out = [held + plain, plain * held, torch.cat([plain, held]), torch.where(plain > 1, held, plain)]
        assert all(type(o) is _Logged and o.inner.device == o.device == torch.device(device) for o in out)
        results[device] = ([o.inner.cpu() for o in out], log)
    assert results["cpu"][1] == results[dev][1] == ["add.Tensor", "mul.Tensor", "cat.default", "where.self"]
    for got, want in zip(results[dev][0], results["cpu"][0]):
        assert torch.equal(got, want)


def test_jagged_nested_tensors_over_flagos_values_match_cpu(dev):
    """A jagged nested tensor (`layout=torch.jagged`) is a subclass over one values tensor: over
    flagos values its ops run on flagos, forward and backward, with CPU's results (its
    construction mixes the values with a meta tensor, which flagos took for a device mix-up).
    Its scaled_dot_product_attention takes PyTorch's math path on a device without a fused
    kernel, which makes a strided nested tensor: a clear error that names padding."""
    def run(device):
        torch.manual_seed(0)
        pieces = [torch.randn(3, 8), torch.randn(5, 8)]
        leaves = [p.to(device).requires_grad_() for p in pieces]
        nested = torch.nested.as_nested_tensor(leaves, layout=torch.jagged)
        layer = torch.nn.Linear(8, 8).to(device)
        hidden = torch.nn.functional.gelu(layer(nested))
        scores = hidden.softmax(-1)
        loss = scores.values().pow(2).sum()
        loss.backward()
        with torch.no_grad():  # reductions over the ragged dimension (no backward on CPU either)
            means = hidden.mean(dim=1)
        padded = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)], layout=torch.jagged,
                                            device=device).sin().to_padded_tensor(0.0)
        return [hidden.to_padded_tensor(0.0), scores.to_padded_tensor(0.0), loss, means, padded,
                layer.weight.grad, *[leaf.grad for leaf in leaves]]

    for got, want in zip(run(dev), run("cpu")):
        assert got.device == dev
        close(got, want)
    heads = torch.nested.nested_tensor([torch.randn(3, 2, 4), torch.randn(5, 2, 4)], layout=torch.jagged,
                                       device=dev).transpose(1, 2)
    with pytest.raises(RuntimeError, match="strided layout.*to_padded_tensor"):
        torch.nn.functional.scaled_dot_product_attention(heads, heads, heads)


# ---- ops PyTorch runs whole on CPU and decomposes elsewhere (runtime/_whole_ops.py) --------

def test_the_list_of_ops_cpu_runs_whole_is_the_dispatchers():
    assert list(_whole_ops.OPS) == _whole_ops.dispatcher_ops()


@pytest.mark.parametrize("activation", ["silu", "mish"])
def test_activation_backward_in_float16_runs_whole_as_on_cpu(dev, activation):
    """silu_backward and mish_backward have a CPU kernel (computing in float32) and, for other
    devices, a decomposition that rounds each part to float16; under grad mode it ran above
    flagos, so even the cpu chip, whose payloads run CPU's kernels, was 1-2 float16 units away
    from CPU. The op now reaches the chip whole: the cpu chip gives CPU's bits, a C-ABI chip
    its own kernel's or its decomposition's numbers (float16's tolerance)."""
    fn = getattr(torch.nn.functional, activation)
    torch.manual_seed(0)
    x = torch.randn(4, 33, dtype=torch.float16, requires_grad=True)
    grad = torch.randn(4, 33, dtype=torch.float16)
    want, = torch.autograd.grad(fn(x), x, grad)
    on_chip = x.detach().to(dev).requires_grad_()
    with flagos.track() as report:
        got, = torch.autograd.grad(fn(on_chip), on_chip, grad.to(dev))
    assert report.op(f"aten::{activation}_backward")["calls"]["native"] == 1
    if flagos.info()["chip"] == "cpu":
        assert torch.equal(got.cpu(), want)
    else:
        torch.testing.assert_close(got.cpu(), want, rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("activation", ["silu", "mish"])
def test_activation_double_backward_decomposes_as_on_cpu(dev, activation):
    """A gradient of the gradient needs the backward's own graph: there the op is decomposed,
    as PyTorch does for every device."""
    fn = getattr(torch.nn.functional, activation)
    torch.manual_seed(0)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    first, = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    want, = torch.autograd.grad(first.square().sum(), x)
    on_chip = x.detach().to(dev).requires_grad_()
    first_on_chip, = torch.autograd.grad(fn(on_chip).sum(), on_chip, create_graph=True)
    got, = torch.autograd.grad(first_on_chip.square().sum(), on_chip)
    torch.testing.assert_close(first_on_chip.cpu(), first.detach())
    torch.testing.assert_close(got.cpu(), want)


def test_native_channel_shuffle_forward_and_backward_match_cpu(dev):
    """CPU's kernel has no derivative ("derivative for aten::native_channel_shuffle is not
    implemented"); CUDA and flagos differentiate its decomposition, the expected values here."""
    x = torch.randn(2, 6, 3, 3, requires_grad=True)
    weights = torch.randn(2, 6, 3, 3)
    out = torch.ops.aten.native_channel_shuffle.default.decompose(x, 3)
    want, = torch.autograd.grad((out * weights).sum(), x)
    on_chip = x.detach().to(dev).requires_grad_()
    got_out = torch.native_channel_shuffle(on_chip, 3)
    got, = torch.autograd.grad((got_out * weights.to(dev)).sum(), on_chip)
    assert torch.equal(got_out.detach().cpu(), out.detach()) and torch.equal(got.cpu(), want)
    with torch.no_grad():
        assert torch.equal(torch.native_channel_shuffle(on_chip, 2).cpu(),
                           torch.native_channel_shuffle(x, 2))


def test_ops_cpu_runs_whole_reach_the_chip_whole_when_no_gradient_is_needed(dev):
    """Under grad mode, with no input requiring a gradient (a model in eval without no_grad),
    the op goes to the chip whole, counted as itself, as it runs on CPU: not its decomposition."""
    x, grad = torch.randn(2, 6, 3, 3), torch.randn(2, 6, 3, 3)
    assert torch.is_grad_enabled()
    with flagos.track() as report:
        shuffled = torch.native_channel_shuffle(x.to(dev), 3)
        silu_grad = torch.ops.aten.silu_backward(grad.to(dev), x.to(dev))
    assert report.op("aten::native_channel_shuffle")["calls"]["native"] == 1
    assert report.op("aten::silu_backward")["calls"]["native"] == 1
    assert torch.equal(shuffled.cpu(), torch.native_channel_shuffle(x, 3))
    torch.testing.assert_close(silu_grad.cpu(), torch.ops.aten.silu_backward(grad, x))
