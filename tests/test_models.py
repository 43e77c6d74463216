"""Real models on flagos, compared with plain PyTorch with the same seed: on the CPU, or for
inference on the chip's own device where it has one (cuda: the same kernels, so the CPU's
rounding differences stay out of the comparison). Training is compared with the CPU on every
chip: a plain CUDA backward cannot run in a process where flagos holds PrivateUse1
(pytorch/pytorch#161129, docs/design.md)."""
import contextlib
import copy

import models
import numpy as np
import pytest
import torch
from conftest import CHIP, OpCounter, assert_close, device_mode_only, reference_device
from torch.autograd import forward_ad
from torch.utils._python_dispatch import TorchDispatchMode

import flagos

F = torch.nn.functional

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


class OpsSeen(TorchDispatchMode):
    """The ops a dispatch mode above everything sees: (name, device type of the first argument)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func), args[0].device.type))
        return func(*args, **(kwargs or {}))


def _attention_inputs(dev, requires_grad=False):
    torch.manual_seed(0)
    cpu = [torch.randn(2, 4, 8, 16, requires_grad=requires_grad) for _ in range(3)]
    return cpu, [t.detach().to(dev).requires_grad_(requires_grad) for t in cpu]


@pytest.mark.parametrize("context", ["plain", "no_grad", "inference_mode"])
def test_attention_without_a_backward_matches_cpu(dev, context):
    """Inference: inputs that need no gradient, or gradients off (no graph recorded, as on CPU).
    Nothing sees the ops attention is made of then, and it reaches the chip whole."""
    requires_grad = context != "plain"
    (q, k, v), (fq, fk, fv) = _attention_inputs(dev, requires_grad)
    enter = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad,
             "inference_mode": torch.inference_mode}[context]
    with enter():
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with flagos.track() as report:
            out = F.scaled_dot_product_attention(fq, fk, fv, is_causal=True)
    assert out.requires_grad is ref.requires_grad is False and out.grad_fn is None
    assert out.is_inference() == ref.is_inference()
    assert_close(out, ref, atol=attention_tolerances()[0])
    if CHIP == "cpu":  # the payload device's own attention, whole: its fused kernel
        assert report.op("aten::scaled_dot_product_attention")["calls"]["native"] == 1
        assert report.op("aten::bmm") is None


def test_a_dispatch_mode_sees_the_attention_ops_cpu_shows_it(dev):
    (q, k, v), (fq, fk, fv) = _attention_inputs(dev)
    with OpsSeen() as on_cpu:
        ref = F.scaled_dot_product_attention(q, k, v)
    with OpsSeen() as on_flagos:
        out = F.scaled_dot_product_attention(fq, fk, fv)
    assert_close(out, ref, atol=attention_tolerances()[0])
    assert on_cpu.ops == [("aten._scaled_dot_product_flash_attention_for_cpu.default", "cpu")]
    if CHIP == "cpu":
        assert on_flagos.ops == [("aten._scaled_dot_product_flash_attention_for_cpu.default", "flagos")]
    else:  # the math decomposition, every op on the flagos tensors
        assert on_flagos.ops and {device for _, device in on_flagos.ops} == {"flagos"}


def test_the_profiler_records_the_attention_kernel_as_on_cpu(dev):
    (q, k, v), (fq, fk, fv) = _attention_inputs(dev)

    def attention_events(q, k, v):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            F.scaled_dot_product_attention(q, k, v)
        return {e.name for e in prof.events() if "_attention" in e.name}

    on_cpu, on_flagos = attention_events(q, k, v), attention_events(fq, fk, fv)
    if CHIP == "cpu":
        assert on_flagos == on_cpu == {"aten::scaled_dot_product_attention",
                                       "aten::_scaled_dot_product_flash_attention_for_cpu"}
    else:
        assert "aten::scaled_dot_product_attention" in on_flagos


def test_attention_under_vmap_matches_cpu(dev):
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 4, 8, 8) for _ in range(3))
    ref = torch.vmap(F.scaled_dot_product_attention)(q, k, v)
    out = torch.vmap(F.scaled_dot_product_attention)(q.to(dev), k.to(dev), v.to(dev))
    assert out.device == dev
    assert_close(out, ref, atol=attention_tolerances()[0])


def _attention_tangent(attention, query, key, value):
    """The forward-mode derivative of `attention` along ones in the query, or the error raised."""
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(query, torch.ones_like(query))
        try:
            out = attention(dual, key, value)
        except Exception as e:  # noqa: BLE001 - the error is the answer compared
            return e
        return forward_ad.unpack_dual(out).tangent


def test_forward_mode_gradients_of_attention_are_the_cpus(dev):
    """PyTorch's CPU attention kernel has no forward-mode derivative: the cpu chip raises the
    same error (a tangent is never dropped silently); sim runs the math decomposition, whose
    tangent is the CPU's math decomposition's."""
    (q, k, v), (fq, fk, fv) = _attention_inputs(dev)
    on_cpu = _attention_tangent(F.scaled_dot_product_attention, q, k, v)
    on_flagos = _attention_tangent(F.scaled_dot_product_attention, fq, fk, fv)
    if CHIP == "cpu":
        assert isinstance(on_cpu, NotImplementedError)
        assert type(on_flagos) is type(on_cpu) and str(on_flagos) == str(on_cpu)
    else:
        def math(q, k, v):
            return torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]
        assert isinstance(on_flagos, torch.Tensor), on_flagos
        assert_close(on_flagos, _attention_tangent(math, q, k, v), atol=1e-5)


def test_forward_mode_gradients_through_layers_are_the_cpus(dev):
    """Forward-mode AD (torch.func.jvp, forward_ad) through Linear, LayerNorm and GELU: where an
    input has no tangent, PyTorch stands in an "efficient zero tensor" that holds no memory,
    which as a payload of the cpu chip failed in the next matmul ("its data is not allocated
    yet"). The primal and the tangent match the CPU's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                                torch.nn.Linear(8, 3))
    x, direction = torch.randn(4, 6), torch.randn(4, 6)
    on_flagos = copy.deepcopy(model).to(dev)
    expected = torch.func.jvp(model, (x,), (direction,))
    got = torch.func.jvp(on_flagos, (x.to(dev),), (direction.to(dev),))
    for g, e in zip(got, expected):
        assert g.device == dev
        assert_close(g, e)
    with forward_ad.dual_level():
        out = on_flagos(forward_ad.make_dual(x.to(dev), direction.to(dev)))
        assert_close(forward_ad.unpack_dual(out).tangent, expected[1])


@pytest.mark.parametrize("model", ["bert", "unet"])
def test_inference_mode_runs_a_model_on_the_chip_as_no_grad_does(dev, model):
    """Under inference mode PyTorch skips the autograd key, where ops such as linear, layer_norm,
    conv2d and attention are decomposed, so they reach flagos whole: the chip runs them (or their
    parts) as under no_grad, with the same fallbacks, and the CPU's answer."""
    if model == "bert":
        net, (ids, mask, _) = models.bert(), models.bert_batch()
        inputs = {"input_ids": ids, "attention_mask": mask}

        def run(net, inputs):
            return net(**inputs).logits
    else:
        net = models.ddpm_pipeline().unet.eval()
        torch.manual_seed(2)
        inputs = {"sample": torch.randn(1, 3, 16, 16), "timestep": torch.tensor([10])}

        def run(net, inputs):
            return net(**inputs).sample
    with torch.inference_mode():
        ref = run(net, inputs)
    net = net.to(dev)
    on_dev = {name: t.to(dev) for name, t in inputs.items()}
    fallbacks = {}
    for context in (torch.no_grad, torch.inference_mode):
        with context(), flagos.track() as report:
            out = run(net, on_dev)
        assert_close(out, ref, atol=1e-5)
        fallbacks[context.__name__] = set(report.fallback_ops)
    assert fallbacks["inference_mode"] == fallbacks["no_grad"]


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
