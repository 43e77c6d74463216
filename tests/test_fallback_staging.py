"""The CPU fallback's host staging buffers (csrc/staging.c, docs/design.md §3).

Every result is compared with the same op run by plain PyTorch on the host. Tensors are
large enough to be staged (at least _C.STAGING_MIN_BYTES); the pool's counters say whether a
buffer was reused, kept or freed.
"""
import threading

import pytest
import torch
from conftest import CHIP, device_mode_only, run_python

import flagos
from flagos import _C

pytestmark = device_mode_only

N = _C.STAGING_MIN_BYTES // 4 * 2  # float32 elements: twice the staging threshold


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    monkeypatch.delenv("FLAGOS_FALLBACK_STAGING", raising=False)
    _C.staging_release()
    yield
    _C.staging_release()


def test_fallback_results_match_the_host(dev):
    torch.manual_seed(0)
    a, b = torch.randn(N), torch.randn(N)
    m1, m2 = torch.randn(256, 300), torch.randn(300, 200)
    for op in ("aten::neg", "aten::add.Tensor", "aten::mm", "aten::add_.Tensor", "aten::exp"):
        flagos.set_route(op, "fallback")
    fa, fb = a.to(dev), b.to(dev)
    assert torch.equal(torch.neg(fa).cpu(), torch.neg(a))
    assert torch.equal((fa + fb).cpu(), a + b)
    assert torch.equal(torch.exp(fa.view(512, -1)).cpu(), torch.exp(a.view(512, -1)))
    assert torch.equal((m1.to(dev) @ m2.to(dev)).cpu(), m1 @ m2)
    acc = fa.clone()
    acc.add_(fb)  # written argument: copied back into the caller's tensor
    assert torch.equal(acc.cpu(), a + b)
    assert torch.equal(fa.cpu(), a)  # the input it read is unchanged
    assert flagos.fallback_report().op("aten::neg")["calls"]["fallback"] == 1


def test_buffers_are_reused_and_never_leak_values_between_calls(dev):
    flagos.set_route("aten::neg", "fallback")
    x1, x2 = torch.randn(N), torch.randn(N - 1000)  # same size class, the second one smaller
    first = torch.neg(x1.to(dev))
    hits = _C.staging_stats()["hits"]
    second = torch.neg(x2.to(dev))
    assert _C.staging_stats()["hits"] > hits  # the second call took the first call's buffer
    assert torch.equal(second.cpu(), torch.neg(x2))
    assert second.shape == x2.shape
    assert torch.equal(first.cpu(), torch.neg(x1))  # the earlier result is its own memory


def test_empty_cache_releases_the_buffers(dev):
    flagos.set_route("aten::neg", "fallback")
    torch.neg(torch.randn(N).to(dev))
    assert _C.staging_stats()["kept_bytes"] >= N * 4
    torch.flagos.empty_cache()
    stats = _C.staging_stats()
    assert stats["kept_bytes"] == 0 and stats["kept_buffers"] == 0


def test_limit_zero_keeps_nothing_and_bad_values_name_the_fix(dev, monkeypatch):
    flagos.set_route("aten::neg", "fallback")
    x = torch.randn(N)
    monkeypatch.setenv("FLAGOS_FALLBACK_STAGING", "0")
    assert torch.equal(torch.neg(x.to(dev)).cpu(), torch.neg(x))
    assert _C.staging_stats()["kept_bytes"] == 0
    monkeypatch.setenv("FLAGOS_FALLBACK_STAGING", "lots")
    with pytest.raises(ValueError, match="FLAGOS_FALLBACK_STAGING=256M"):
        _C.staging_stats()
    monkeypatch.setenv("FLAGOS_FALLBACK_STAGING", "1M")
    assert _C.staging_stats()["limit"] == 1 << 20


def test_a_buffer_something_still_sees_is_not_handed_out_again():
    flat = _C.staging_take(N * 4)
    kept_view = flat[:16]
    kept_view.fill_(7)
    _C.staging_give(flat)
    assert _C.staging_stats()["kept_buffers"] == 0  # freed to its other owner, not pooled
    again = _C.staging_take(N * 4)
    assert again.data_ptr() != kept_view.data_ptr()
    again.fill_(0)
    assert torch.equal(kept_view, torch.full((16,), 7, dtype=torch.uint8))
    _C.staging_give(again)
    assert _C.staging_stats()["kept_buffers"] == 1
    with pytest.raises(TypeError, match="staging_take"):
        _C.staging_give(object())


def test_memory_accounting_comes_back_after_fallback_ops(dev):
    flagos.set_route("aten::neg", "fallback")
    x = torch.randn(N).to(dev)
    torch.neg(x)  # the pool's first buffer and any lazily made state
    before = torch.flagos.memory_allocated()
    for _ in range(5):
        y = torch.neg(x)
        del y
    assert torch.flagos.memory_allocated() == before


def test_concurrent_fallbacks_get_their_own_buffers(dev):
    flagos.set_route("aten::neg", "fallback")
    flagos.set_route("aten::mul.Tensor", "fallback")
    inputs = [torch.randn(N) for _ in range(4)]
    errors = []

    def worker(x):
        try:
            fx = x.to(dev)
            for _ in range(20):
                assert torch.equal(torch.neg(fx).cpu(), torch.neg(x))
                assert torch.equal((fx * fx).cpu(), x * x)
        except Exception as e:  # reported below: a thread's assertion does not fail the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _C.staging_stats()["kept_buffers"] <= 8


@pytest.mark.skipif(CHIP != "cpu", reason="starts its own sim process: runs once")
def test_out_of_memory_in_a_fallback_hands_its_buffers_back():
    run_python(f"""
        import torch, flagos
        from flagos import _C
        flagos.activate("sim")
        dev = flagos.device()
        flagos.set_route("aten::neg", "fallback")
        x = torch.randn({N})
        fx = x.to(dev)
        filler = torch.empty(({3 * 1024 * 1024} - 2 * fx.nbytes) // 4 + 1000, device=dev)
        used = torch.flagos.memory_allocated()
        try:
            torch.neg(fx)
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("expected an out-of-memory error")
        assert torch.flagos.memory_allocated() == used
        del filler
        assert torch.equal(torch.neg(fx).cpu(), torch.neg(x))
        assert _C.staging_stats()["kept_buffers"] == 1, _C.staging_stats()
    """, env={"FLAGOS_SIM_MEMORY": "3M", "FLAGOS_FALLBACK": "allow"})


@pytest.mark.skipif(CHIP != "sim", reason="the Python runner's round trip: adapter chips")
@pytest.mark.parametrize("elements", [N, 16], ids=["large", "small"])
def test_the_runners_round_trip_stages_large_regions_only(dev, elements):
    """A fallback call the C round trip declines (a host tensor among its arguments) takes the
    Python runner's: a region from the staging threshold on goes through a reused staging
    buffer, a smaller one into a host tensor of its own, as in the C round trip."""
    flagos.set_route("aten::mul.Tensor", "fallback")
    x, two = torch.randn(elements), torch.tensor(2.0)  # a 0-dim host tensor: allowed on every device
    fx = x.to(dev)
    assert torch.equal((fx * two).cpu(), x * 2)
    hits = _C.staging_stats()["hits"]
    assert torch.equal((fx * two).cpu(), x * 2)
    staged = _C.staging_stats()["hits"] > hits
    assert staged == (elements * 4 >= _C.STAGING_MIN_BYTES)
