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
        # the chip's tensors are the host's: the fallback still counts what it moved (the
        # view's 2 float32 values each way) and their dtype, as in device mode
        row = report.op("aten::add_.Tensor")
        print("moved", row["bytes_to_host"], row["bytes_to_device"], row["dtypes"])
        assert report.op("aten::addmm")["calls"]["native"] == 1
        print("OK")
    """)
    assert "OK" in proc.stdout and "no flagos device: True" in proc.stdout
    assert "moved 8 8 ['torch.float32']" in proc.stdout, proc.stdout


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


def test_deactivate_where_native_mode_cannot_be_left_is_a_clear_error():
    """Inside an op (an override kernel), from another thread or under a dispatch mode
    entered later, deactivate() raises ConfigError and leaves flagos active and whole; from
    the activating thread, outside any op, it then works, and works again as a no-op."""
    proc = run_python("""
        import threading, torch, flagos
        from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
        flagos.activate("cpu", mode="native")
        calls = []
        def leaving_add(a, b, alpha=1):
            calls.append(1)
            flagos.deactivate()
            return torch.ops.aten.add.Tensor(a, b, alpha=alpha)
        flagos.register_kernel("aten::add.Tensor", leaving_add)
        x = torch.arange(3.0)
        try:
            x + x
        except flagos.ConfigError as e:
            print("IN OP", e)
        assert calls == [1]
        flagos.unregister_kernel("aten::add.Tensor")

        def other_thread():
            try:
                flagos.deactivate()
            except flagos.ConfigError as e:
                print("THREAD", e)
        t = threading.Thread(target=other_thread); t.start(); t.join()

        class Later(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))
        class Latest(Later):
            pass
        with Later():
            try:
                flagos.deactivate()
            except flagos.ConfigError as e:
                print("UNDER", e)
            with Latest():   # two modes on top: the message names the one to leave first
                try:
                    flagos.deactivate()
                except flagos.ConfigError as e:
                    print("UNDER TWO", e)

        # still active, still routing
        assert flagos.info()["active"]
        with flagos.track() as report:
            assert (x + x).tolist() == [0.0, 2.0, 4.0]
        assert report.op("aten::add.Tensor")["calls"]["native"] == 1
        flagos.deactivate()
        assert not flagos.info()["active"] and _get_current_dispatch_mode_stack() == []
        flagos.deactivate()                              # inactive: nothing to do
        flagos.activate("cpu", mode="native")
        assert len(_get_current_dispatch_mode_stack()) == 1
        flagos.deactivate()
        assert _get_current_dispatch_mode_stack() == []
        print("OK")
    """)
    out = proc.stdout
    assert "IN OP flagos.deactivate() cannot run inside an op that flagos routes" in out
    assert "Call it after the op returns" in out
    assert "THREAD flagos.deactivate() must be called in the thread that activated native mode" in out
    assert "UNDER flagos.deactivate(): the dispatch mode Later, entered after flagos.activate()" in out
    assert "UNDER TWO flagos.deactivate(): the dispatch mode Latest, entered after flagos.activate()" in out
    assert "OK" in out
