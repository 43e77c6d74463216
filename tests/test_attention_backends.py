"""scaled_dot_product_attention on an accelerator's payloads (runtime/_attention.py): the fused
backend PyTorch would choose for the payloads (flash, memory-efficient, cuDNN) gets the same
preparation PyTorch's own composite gives it. Those kernels exist only on the accelerators, so
here each backend's op is stood in for by the math decomposition, called with what flagos hands
the kernel: the answer and the gradients must be plain CPU attention's, and the arguments what
the kernel requires (a head dimension padded to a multiple of 8 with the scale of the original,
a bias aligned to 8 elements and expanded to (batch, heads, L, S), the log-sum-exp asked for only
when a backward will need it)."""
import math
import types

import pytest
import torch
from conftest import assert_close, device_mode_only

from flagos.runtime import _attention

pytestmark = device_mode_only
F = torch.nn.functional


class KernelStandIn:
    """The fused ops' names, recording their arguments and answering with the math
    decomposition of the same call (on the same flagos tensors, so autograd sees it) in the
    first of as many outputs as the real op has (the others stand-ins too: a caller that takes
    the wrong one gets no attention)."""

    # the math decomposition itself is PyTorch's, not stood in for
    _scaled_dot_product_attention_math = staticmethod(torch.ops.aten._scaled_dot_product_attention_math)

    def __init__(self):
        self.calls = []

    @staticmethod
    def _answer(n_outputs, q, k, v, bias, dropout_p, is_causal, scale):
        out = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, bias, dropout_p, is_causal, scale=scale)[0]
        return (out,) + tuple(f"output {i}" for i in range(1, n_outputs))

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p, is_causal, debug_mask, scale=None):
        self.calls.append(dict(op="flash", head=q.shape[-1], heads=(k.shape[-1], v.shape[-1]),
                               scale=scale, debug_mask=debug_mask))
        return self._answer(9, q, k, v, None, dropout_p, is_causal, scale)

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, log_sumexp, dropout_p, is_causal, scale=None):
        self.calls.append(dict(op="efficient", bias=bias, log_sumexp=log_sumexp))
        return self._answer(4, q, k, v, bias, dropout_p, is_causal, scale)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, bias, log_sumexp, dropout_p, is_causal,
                                            debug_mask, scale=None):
        self.calls.append(dict(op="cudnn", bias=bias, log_sumexp=log_sumexp, debug_mask=debug_mask))
        return self._answer(9, q, k, v, bias, dropout_p, is_causal, scale)

    def _scaled_dot_product_fused_attention_overrideable(self, q, k, v, bias, dropout_p, is_causal,
                                                         debug_mask, scale=None):
        self.calls.append(dict(op="overrideable", bias=bias, debug_mask=debug_mask))
        return self._answer(9, q, k, v, bias, dropout_p, is_causal, scale)


@pytest.fixture
def kernels(monkeypatch):
    stand_in = KernelStandIn()
    namespace = types.SimpleNamespace(**{name: getattr(stand_in, name) for name in dir(stand_in)
                                         if name.startswith("_scaled")})
    monkeypatch.setattr(_attention, "aten", namespace)
    return stand_in


def inputs(dev, head=16, kv_length=8, requires_grad=True):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, head, requires_grad=requires_grad)
    k, v = (torch.randn(2, 4, kv_length, head, requires_grad=requires_grad) for _ in range(2))
    on_dev = tuple(t.detach().to(dev).requires_grad_(requires_grad) for t in (q, k, v))
    return (q, k, v), on_dev


def check_against_cpu(plain, routed, out, ref):
    assert_close(out, ref, atol=1e-6)
    if plain[0].requires_grad:
        ref.sum().backward()
        out.sum().backward()
        for mine, theirs in zip(routed, plain):
            assert_close(mine.grad, theirs.grad, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"scale": 0.3}], ids=["plain", "causal", "scale"])
def test_flash_pads_the_head_dimension_and_keeps_the_original_scale(dev, kernels, options):
    plain, routed = inputs(dev, head=12)   # not a multiple of 8
    ref = F.scaled_dot_product_attention(*plain, **options)
    out = _attention._flash(*routed, None, 0.0, options.get("is_causal", False), options.get("scale"))
    (call,) = kernels.calls
    assert call["head"] == 16 and call["heads"] == (16, 16) and call["debug_mask"] is False
    assert call["scale"] == pytest.approx(options.get("scale", 1 / math.sqrt(12)), rel=1e-12)
    assert out.shape == ref.shape      # sliced back to the original head dimension
    check_against_cpu(plain, routed, out, ref)


def test_flash_leaves_an_aligned_head_dimension_as_it_is(dev, kernels):
    plain, routed = inputs(dev, head=16)
    out = _attention._flash(*routed, None, 0.0, False, None)
    assert kernels.calls[0]["head"] == 16
    check_against_cpu(plain, routed, out, F.scaled_dot_product_attention(*plain))


@pytest.mark.parametrize("mask_kind", ["bool", "float", "float, per batch and head"])
def test_efficient_gets_an_aligned_expanded_additive_bias(dev, kernels, mask_kind):
    plain, routed = inputs(dev, kv_length=13)   # a bias row of 13 elements: not aligned to 8
    torch.manual_seed(1)
    mask = (torch.rand(8, 13) > 0.3 if mask_kind == "bool" else
            torch.randn(8, 13) if mask_kind == "float" else torch.randn(2, 1, 8, 13))
    ref = F.scaled_dot_product_attention(*plain, attn_mask=mask)
    out = _attention._efficient(*routed, mask.to(dev), 0.0, False, None)
    (call,) = kernels.calls
    bias = call["bias"]
    assert bias.dtype == torch.float32 and tuple(bias.shape) == (2, 4, 8, 13)
    assert bias.stride(-1) == 1 and all(s % 8 == 0 for s in bias.stride()[:-1])
    assert call["log_sumexp"] is True
    check_against_cpu(plain, routed, out, ref)


def test_efficient_asks_no_log_sumexp_without_a_backward(dev, kernels):
    plain, routed = inputs(dev)
    with torch.no_grad():
        out = _attention._efficient(*routed, None, 0.0, False, None)
    _, routed_no_grad = inputs(dev, requires_grad=False)
    _attention._efficient(*routed_no_grad, None, 0.0, False, None)
    assert [c["log_sumexp"] for c in kernels.calls] == [False, False]
    assert [c["bias"] for c in kernels.calls] == [None, None]
    assert_close(out, F.scaled_dot_product_attention(*plain).detach(), atol=1e-6)


@pytest.mark.parametrize("backend, masked_value", [
    ("cudnn", -65504.0),           # cuDNN: a finite bias, as PyTorch gives it
    ("overrideable", float("-inf")),  # a PrivateUse1-style accelerator's (XPU's) own op
])
def test_a_boolean_mask_reaches_the_backend_as_pytorch_converts_it(dev, kernels, backend, masked_value):
    plain, routed = inputs(dev)
    torch.manual_seed(2)
    mask = torch.rand(8, 8) > 0.3
    ref = F.scaled_dot_product_attention(*plain, attn_mask=mask)
    out = getattr(_attention, f"_{backend}")(*routed, mask.to(dev), 0.0, False, None)
    (call,) = kernels.calls
    assert call["op"] == backend and call["debug_mask"] is False
    assert call.get("log_sumexp", True) is True   # cuDNN's: a backward follows
    assert call["bias"].dtype == torch.float32 and call["bias"].min().item() == masked_value
    check_against_cpu(plain, routed, out, ref)


def test_a_device_without_a_choice_function_gets_the_math_decomposition(monkeypatch):
    def no_choice(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::_fused_sdp_choice' with arguments from the 'MPS' backend")

    q = torch.randn(1, 2, 4, 8)
    monkeypatch.setattr(_attention, "aten", types.SimpleNamespace(_fused_sdp_choice=no_choice))
    assert _attention._accelerator_choice(q, q, q, None, 0.0, False, None, False) == _attention._MATH


def test_the_choice_is_the_payload_devices_own():
    """On plain tensors the choice is PyTorch's for their device: here the CPU's (flash for
    these shapes, math where a backend is switched off)."""
    q = torch.randn(1, 2, 64, 16)
    assert _attention._accelerator_choice(q, q, q, None, 0.0, False, None, False) == \
        int(torch.ops.aten._fused_sdp_choice(q, q, q))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert _attention._accelerator_choice(q, q, q, None, 0.0, False, None, False) == _attention._MATH


@pytest.mark.parametrize("backend", ["_FLASH", "_EFFICIENT", "_CUDNN", "_OVERRIDEABLE", "_MATH"])
def test_an_accelerators_choice_runs_that_backend(dev, kernels, monkeypatch, backend):
    """The path of a payload that is not on the CPU: the payload device's choice, asked with
    the wrappers' requires_grad (their payloads carry none and are left so), picks the op."""
    asked = []

    def choice(q, k, v, mask, *args):
        asked.append([t.requires_grad for t in (q, k, v)])
        return getattr(_attention, backend)

    monkeypatch.setattr(_attention, "_accelerator_choice", choice)
    plain, routed = inputs(dev, head=12)
    routed[1].requires_grad_(False)       # the key alone needs no gradient
    plain[1].requires_grad_(False)
    ref = F.scaled_dot_product_attention(*plain, is_causal=True)
    out = _attention._accelerator_attention(*routed, None, 0.0, True, None, False)
    assert asked == [[True, False, True]]
    assert not any(t._payload.requires_grad for t in routed)
    expected_op = {"_FLASH": "flash", "_EFFICIENT": "efficient", "_CUDNN": "cudnn",
                   "_OVERRIDEABLE": "overrideable", "_MATH": None}[backend]
    assert [c["op"] for c in kernels.calls] == ([expected_op] if expected_op else [])
    assert_close(out, ref, atol=1e-6)
    ref.sum().backward()
    out.sum().backward()
    for mine, theirs in ((routed[0], plain[0]), (routed[2], plain[2])):
        assert_close(mine.grad, theirs.grad, atol=1e-5)


def test_no_backward_asks_with_the_payloads_as_they_are(dev, monkeypatch):
    asked = []
    monkeypatch.setattr(_attention, "_accelerator_choice",
                        lambda q, k, v, *a: asked.append((q, k, v)) or _attention._MATH)
    _, routed = inputs(dev)
    with torch.no_grad():
        _attention._accelerator_attention(*routed, None, 0.0, False, None, False)
    assert all(a is t._payload for a, t in zip(asked[0], routed))


@pytest.mark.parametrize("needs_grad", ["query", "key", "value"])
def test_any_one_input_that_needs_a_gradient_asks_for_the_log_sumexp(dev, kernels, needs_grad):
    _, routed = inputs(dev, requires_grad=False)
    routed[("query", "key", "value").index(needs_grad)].requires_grad_()
    _attention._efficient(*routed, None, 0.0, False, None)
    assert kernels.calls[0]["log_sumexp"] is True


@pytest.mark.parametrize("shape", [(8, 8), (2, 1, 8, 8)], ids=["one", "per batch"])
def test_an_aligned_bias_is_expanded_in_place_not_copied(dev, kernels, shape):
    """PyTorch pads a bias only where its rows are not aligned to 8 elements: an aligned one
    reaches the kernel as a view of the caller's tensor."""
    _, routed = inputs(dev)
    mask = torch.randn(shape).to(dev)
    _attention._efficient(*routed, mask, 0.0, False, None)
    bias = kernels.calls[0]["bias"]
    assert tuple(bias.shape) == (2, 4, 8, 8) and bias.data_ptr() == mask.data_ptr()
    assert bias.stride() == ((0, 0, 8, 1) if len(shape) == 2 else (64, 0, 8, 1))


def test_traced_accelerator_payloads_take_the_math_decomposition(monkeypatch):
    """Payloads being traced (fake tensors, no data) cannot be asked: the choice function's Meta
    kernel answers math whatever the shapes, and flagos says math itself, not the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(_attention, "aten", types.SimpleNamespace(
        _fused_sdp_choice=lambda *args, **kwargs: _attention._FLASH))   # what a GPU would answer
    q = torch.randn(1, 2, 64, 16)
    assert _attention._accelerator_choice(q, q, q, None, 0.0, False, None, False) == _attention._FLASH
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(q)
        assert _attention._accelerator_choice(fake, fake, fake, None, 0.0, False, None, False) == _attention._MATH
