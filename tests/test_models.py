"""Real models on flagos, compared with plain PyTorch with the same seed: on the CPU, or for
inference on the chip's own device where it has one (cuda: the same kernels, so the CPU's
rounding differences stay out of the comparison). Training is compared with the CPU on every
chip: a plain CUDA backward cannot run in a process where flagos holds PrivateUse1
(pytorch/pytorch#161129, docs/design.md)."""
import copy

import models
import numpy as np
import pytest
import torch
from conftest import CHIP, OpCounter, assert_close, device_mode_only, reference_device

import flagos

pytestmark = device_mode_only


def test_ddpm_pipeline_matches_plain_pytorch(dev, ref):
    expected = models.run_ddpm(models.ddpm_pipeline().to(ref))
    pipe = models.ddpm_pipeline().to(dev)
    assert pipe.device == dev
    flagos.reset_report()
    with OpCounter() as counter:
        out = models.run_ddpm(pipe)
    assert out.shape == (1, 16, 16, 3)
    assert np.abs(out - expected).max() <= 1e-5
    report = flagos.fallback_report()
    # the report counts exactly the ops the pipeline ran on flagos tensors, whatever their route
    counted = {r["op"]: sum(r["calls"].values()) for r in report.rows}
    assert {op: counted.get(op) for op in counter.counts} == dict(counter.counts)
    assert report.calls("native") > 100
    if CHIP == "cpu":
        assert report.calls("fallback") == 0
    else:  # C-ABI chips: ops with a kernel run natively (the UNet's group norms, upsampling
        # and skip cats included), the rest fall back to the CPU
        for op in ("aten::silu", "aten::native_group_norm", "aten::upsample_nearest2d", "aten::cat"):
            calls = report.op(op)["calls"]
            assert calls["native"] > 0 and calls["fallback"] == 0, f"{op}:\n{report}"
        # convolutions too, but those of the channels_last tensors the attention blocks hand
        # on, which flagos leaves to the CPU
        conv = report.op("aten::convolution")["calls"]
        assert conv["native"] > conv["fallback"], str(report)


def test_ddpm_pipeline_with_fallback_ops_matches_plain_pytorch(dev, ref):
    expected = models.run_ddpm(models.ddpm_pipeline().to(ref))
    flagos.set_route("aten::silu", "fallback")
    flagos.set_route("aten::native_group_norm", "fallback")
    out = models.run_ddpm(models.ddpm_pipeline().to(dev))
    assert np.abs(out - expected).max() <= 1e-5
    report = flagos.fallback_report()
    forced = {"aten::silu", "aten::native_group_norm"}
    assert forced <= set(report.fallback_ops)
    if CHIP == "cpu":
        assert set(report.fallback_ops) == forced
    # every call of a forced op is a fallback call, and the host round trip is counted
    for op in forced:
        row = report.op(op)
        assert row["calls"]["native"] == 0 and row["calls"]["fallback"] > 0
        assert row["bytes_to_host"] > 0 and row["bytes_to_device"] > 0


def attention_tolerances():
    """The CPU's kernels on a chip with host payloads; an accelerator's fused kernels sum in
    another order than the CPU's (float32: about 1e-6 of the values here)."""
    return (1e-6, 1e-5) if reference_device().type == "cpu" else (1e-5, 1e-4)


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_attention_matches_cpu_forward_and_backward(dev, mask):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    m = None if mask is None else torch.rand(8, 8) > 0.3 if mask == "bool" else torch.randn(8, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
    ref.sum().backward()
    fq, fk, fv = (t.detach().to(dev).requires_grad_() for t in (q, k, v))
    fm = None if m is None else m.to(dev)
    with flagos.track() as report:
        out = torch.nn.functional.scaled_dot_product_attention(fq, fk, fv, attn_mask=fm)
        out.sum().backward()
    out_tol, grad_tol = attention_tolerances()
    assert_close(out, ref, atol=out_tol)
    for mine, theirs in ((fq, q), (fk, k), (fv, v)):
        assert_close(mine.grad, theirs.grad, atol=grad_tol)
    if CHIP == "cpu":  # the chip's fused kernel, not the math decomposition
        assert report.op("aten::_scaled_dot_product_flash_attention_for_cpu") is not None
        assert report.op("aten::bmm") is None


@pytest.mark.parametrize("options", [{"is_causal": True}, {"scale": 0.5}, {"enable_gqa": True}],
                         ids=["causal", "scale", "gqa"])
def test_attention_options_match_cpu(dev, options):
    torch.manual_seed(0)
    heads = 2 if options.get("enable_gqa") else 4  # grouped-query: 4 query heads share 2 key/value heads
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, heads, 8, 16, requires_grad=True) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
    ref.sum().backward()
    fq, fk, fv = (t.detach().to(dev).requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(fq, fk, fv, **options)
    out.sum().backward()
    out_tol, grad_tol = attention_tolerances()
    assert_close(out, ref, atol=out_tol)
    for mine, theirs in ((fq, q), (fk, k), (fv, v)):
        assert_close(mine.grad, theirs.grad, atol=grad_tol)


def test_bert_forward_and_training_step_match_cpu(dev):
    ids, mask, labels = models.bert_batch()
    ref_model, model = models.bert(), models.bert().to(dev)
    ref_model.train(), model.train()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ref_out = ref_model(input_ids=ids, attention_mask=mask, labels=labels)
    out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev))
    assert out.logits.device == dev
    assert_close(out.logits, ref_out.logits, atol=1e-5)
    assert_close(out.loss, ref_out.loss, atol=1e-5)
    ref_out.loss.backward()
    out.loss.backward()
    ref_opt.step()
    opt.step()
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert q.device == dev, name
        assert_close(q, p, atol=1e-5)


@pytest.mark.skipif(CHIP != "cpu", reason="torch.compile traces through a flagos tensor to its "
                    "payload, and only torch-native chips have torch tensors as payloads; on a "
                    "C-ABI chip (sim) the payload is an adapter buffer, which Dynamo rejects "
                    "('expected Tensor or OpaqueBase'): such models run eagerly")
def test_torch_compile_matches_plain_cpu(dev):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)
    x = torch.randn(5, 8)
    compiled = torch.compile(model)
    out = compiled(x.to(dev))
    assert isinstance(out, flagos.FlagosTensor) and out.device == dev
    assert_close(out, ref(x), atol=1e-5)
    out2 = compiled(x.to(dev) * 2)  # second call reuses the compiled graph
    assert_close(out2, ref(x * 2), atol=1e-5)


def test_attention_with_fewer_key_value_heads_needs_enable_gqa_as_on_cpu(dev):
    """Grouped key/value heads without `enable_gqa=True` are an error on the CPU; flagos raises
    the same error instead of grouping them."""
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    with pytest.raises(RuntimeError) as on_cpu:
        torch.nn.functional.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError) as on_flagos:
        torch.nn.functional.scaled_dot_product_attention(q.to(dev), k.to(dev), k.to(dev))
    assert str(on_flagos.value).splitlines()[0] == str(on_cpu.value).splitlines()[0]
