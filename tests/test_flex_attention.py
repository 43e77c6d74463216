"""FlexAttention over flagos tensors (integrations/_flex_attention.py), against the same call on
plain PyTorch tensors: score and mask functions that capture tensors (a bias table, document
ids), GQA, the log-sum-exp, autocast, torch.compile, a transformers model that asks for it, and
the refusals: backward where the payload device has none (as on the CPU), and C-ABI chips,
whose tensors cannot be traced, with the host run that the error names."""
import pytest
import torch
import torch.nn.attention.flex_attention as flex
from conftest import CHIP, assert_close, device_mode_only, reference_device

import flagos

pytestmark = device_mode_only
ADAPTER_CHIP = CHIP in ("sim", "opencl")
torch_native_only = pytest.mark.skipif(ADAPTER_CHIP, reason="a C-ABI chip refuses flex_attention")


def _inputs(heads_kv=4, length=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, length, 8, generator=g)
    k = torch.randn(2, heads_kv, length, 8, generator=g)
    v = torch.randn(2, heads_kv, length, 8, generator=g)
    return q, k, v


def _document_attention(device, q, k, v):
    """A relative bias table and document-causal masking, both captured tensors on `device`."""
    bias = torch.arange(256, dtype=torch.float32).reshape(16, 16).div(100).sin().to(device)
    documents = torch.tensor([0] * 6 + [1] * 10).to(device)

    def biased(score, b, h, q_index, kv_index):
        return score + bias[q_index, kv_index]

    def same_document_causal(b, h, q_index, kv_index):
        return (documents[q_index] == documents[kv_index]) & (q_index >= kv_index)

    mask = flex.create_block_mask(same_document_causal, None, None, 16, 16, device=device)
    return flex.flex_attention(q.to(device), k.to(device), v.to(device), score_mod=biased,
                               block_mask=mask, return_lse=True)


@torch_native_only
def test_score_and_mask_functions_with_captured_tensors_give_plain_pytorchs_answer(dev):
    ref = reference_device()
    expected_out, expected_lse = _document_attention(ref, *_inputs())
    out, lse = _document_attention(dev, *_inputs())
    assert out.device == dev and lse.device == dev
    assert_close(out, expected_out)
    assert_close(lse, expected_lse)
    # every op of it was routed and counted: the report names the attention's matmul
    assert "aten::matmul" in {row["op"] for row in flagos.fallback_report().to_dict()["ops"]}


@torch_native_only
def test_grouped_query_attention_and_default_mask(dev):
    ref = reference_device()
    q, k, v = _inputs(heads_kv=2)
    expected = flex.flex_attention(q.to(ref), k.to(ref), v.to(ref), enable_gqa=True)
    out = flex.flex_attention(q.to(dev), k.to(dev), v.to(dev), enable_gqa=True)
    assert out.device == dev
    assert_close(out, expected)


@torch_native_only
def test_backward_follows_the_payload_devices_rule(dev):
    """The cpu chip's payloads are CPU tensors, and PyTorch's FlexAttention has no backward on
    the CPU: the same refusal, with the same words."""
    ref = reference_device()
    q, k, v = _inputs()
    errors = []
    for device in (ref, dev):
        query = q.to(device).requires_grad_()
        try:
            flex.flex_attention(query, k.to(device), v.to(device)).sum().backward()
            errors.append(None)
        except NotImplementedError as e:
            errors.append(str(e))
    assert errors[1] == errors[0]


@torch_native_only
def test_gradients_where_the_device_has_a_backward(dev, monkeypatch):
    """Where the payload device has a backward (CUDA), the backward operator runs PyTorch's
    own eager backward over the flagos tensors: the gradients of plain PyTorch's. Here
    PyTorch's device check is told both sides have one."""
    monkeypatch.setattr(flex._validate_device, "__wrapped__", None, raising=False)
    monkeypatch.setattr(flex, "_validate_device", lambda query, key, value: None)
    ref = reference_device()
    grads = []
    for device in (ref, dev):
        q, k, v = (t.to(device).requires_grad_() for t in _inputs())
        out, lse = _document_attention(device, q, k, v)
        (out.square().sum() + lse.sum()).backward()
        grads.append([t.grad for t in (q, k, v)])
    for got, expected in zip(grads[1], grads[0]):
        assert got.device == dev
        assert_close(got, expected, atol=1e-5)


@torch_native_only
def test_autocast_casts_query_key_and_value_as_pytorch_does(dev):
    ref = reference_device()
    q, k, v = _inputs()
    with torch.autocast(ref.type, dtype=torch.bfloat16):
        expected = flex.flex_attention(q.to(ref), k.to(ref), v.to(ref))
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        out = flex.flex_attention(q.to(dev), k.to(dev), v.to(dev))
    assert out.dtype == expected.dtype == torch.bfloat16
    assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


@torch_native_only
def test_compiled_flex_attention(dev):
    ref = reference_device()
    q, k, v = _inputs()
    expected = flex.flex_attention(q.to(ref), k.to(ref), v.to(ref))
    compiled = torch.compile(flex.flex_attention)
    out = compiled(q.to(dev), k.to(dev), v.to(dev))
    assert out.device == dev
    assert_close(out, expected, atol=1e-5)


@torch_native_only
def test_transformers_model_with_flex_attention_generates_as_on_the_cpu(dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0)
    config._attn_implementation = "flex_attention"
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 100, (2, 12))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected_logits = model(ids, attention_mask=mask).logits
        expected_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        model.to(dev)
        logits = model(ids.to(dev), attention_mask=mask.to(dev)).logits
        tokens = model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=4,
                                do_sample=False)
    assert_close(logits, expected_logits, atol=1e-5)
    assert torch.equal(tokens.cpu(), expected_tokens)


@pytest.mark.skipif(not ADAPTER_CHIP, reason="C-ABI chips only")
def test_c_abi_chip_refuses_and_names_the_host_run(dev):
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match=rf"cannot run on chip '{CHIP}'.*q\.cpu\(\)"):
        flex.flex_attention(q.to(dev), k.to(dev), v.to(dev))
    # the way out it names, and the device still works
    out = flex.flex_attention(q.to(dev).cpu(), k.to(dev).cpu(), v.to(dev).cpu()).to(dev)
    assert out.device == dev
    assert_close(out, flex.flex_attention(q, k, v))
