"""Native mode: the same router as a dispatch mode over the chip's own tensors."""
from conftest import DEVICE_MODE, run_python


def test_native_mode_routes_reports_and_falls_back():
    proc = run_python("""
        import torch, flagos, warnings
        info = flagos.activate("cpu", mode="native")
        assert info["mode"] == "native" and flagos.device() == torch.device("cpu", 0)
        try:
            torch.device("flagos")
        except RuntimeError as e:
            print("no flagos device:", "flagos" in str(e))
        torch.manual_seed(0)
        x, w = torch.randn(4, 5), torch.randn(5, 3)
        flagos.set_route("aten::mm", "fallback")
        flagos.set_route("aten::add_", "fallback")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = x @ w
        assert any(issubclass(c.category, flagos.FallbackWarning) for c in caught)
        flagos.deactivate()
        ref = x @ w
        assert torch.allclose(out, ref)
        flagos.activate("cpu", mode="native")
        flagos.set_route("aten::add_", "fallback")
        a = torch.zeros(3)
        v = a[1:]
        assert v.add_(2) is v and a.tolist() == [0.0, 2.0, 2.0]
        model = torch.nn.Linear(5, 3)
        model(x).sum().backward()
        # d sum(x @ W.T + b) / dW[j] is the column sums of x for every row j; / db is the batch
        assert torch.allclose(model.weight.grad, x.sum(0).expand(3, 5))
        assert model.bias.grad.tolist() == [4.0, 4.0, 4.0]
        report = flagos.fallback_report()
        print(report)
        assert report.op("aten::add_.Tensor")["calls"]["fallback"] == 1
        assert report.op("aten::addmm")["calls"]["native"] == 1
        print("OK")
    """)
    assert "OK" in proc.stdout and "no flagos device: True" in proc.stdout


def test_native_mode_models_match_plain_cpu():
    proc = run_python("""
        import sys, torch, flagos
        sys.path.insert(0, "tests")
        import models
        m = models.bert(); ids, mask, labels = models.bert_batch()
        with torch.no_grad():
            ref = m(input_ids=ids, attention_mask=mask).logits
        flagos.activate("cpu", mode="native")
        flagos.set_route("aten::gelu", "fallback")
        m2 = models.bert().to(flagos.device())
        with torch.no_grad():
            out = m2(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        assert flagos.fallback_report().op("aten::gelu")["calls"]["fallback"] == 2
        print("OK")
    """, env={"FLAGOS_FALLBACK": "allow"})
    assert "OK" in proc.stdout


def test_default_mode_follows_what_pytorch_supports():
    proc = run_python("""
        import flagos
        print("MODE", flagos.activate("cpu")["mode"])
    """)
    expected = "device" if DEVICE_MODE else "native"
    assert f"MODE {expected}" in proc.stdout
    if not DEVICE_MODE:
        assert "flagos runs in native mode" in proc.stderr
