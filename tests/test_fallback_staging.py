"""The CPU fallback's host staging buffers (csrc/staging.c, docs/design.md §3).

Every result is compared with the same op run by plain PyTorch on the host. Tensors are
large enough to be staged (at least _C.STAGING_MIN_BYTES); the pool's counters say whether a
buffer was reused, kept or freed.
"""
import threading

import pytest
import torch
from conftest import CHIP, RUNNER_ONLY, device_mode_only, run_python

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


def test_a_limit_of_one_size_class_keeps_a_buffer_of_that_class(dev, monkeypatch):
    """FLAGOS_FALLBACK_STAGING=256K keeps one 256 KiB buffer: a 200 KiB copy takes it, and the
    next call takes it again."""
    monkeypatch.setenv("FLAGOS_FALLBACK_STAGING", "256K")
    flagos.set_route("aten::neg", "fallback")
    x = torch.randn(50 * 1024)  # 200 KiB: the 256 KiB class
    fx = x.to(dev)
    assert torch.equal(torch.neg(fx).cpu(), -x)
    stats = _C.staging_stats()
    assert (stats["kept_buffers"], stats["kept_bytes"]) == (1, 256 << 10)
    assert torch.equal(torch.neg(fx).cpu(), -x)
    assert _C.staging_stats()["hits"] == stats["hits"] + 1


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


AT_THRESHOLD = _C.STAGING_MIN_BYTES // 4  # float32 elements: exactly the staging threshold


@pytest.mark.parametrize("elements", [AT_THRESHOLD, AT_THRESHOLD - 1], ids=["at-threshold", "one-under"])
def test_a_copy_of_exactly_the_threshold_is_staged_one_item_under_is_not(dev, elements):
    """The threshold is the first size staged: the second call of a fallback moving exactly
    _C.STAGING_MIN_BYTES takes the first one's buffer back; one element less takes none."""
    flagos.set_route("aten::neg", "fallback")
    x = torch.randn(elements)
    fx = x.to(dev)
    assert torch.equal(torch.neg(fx).cpu(), torch.neg(x))
    hits = _C.staging_stats()["hits"]
    assert torch.equal(torch.neg(fx).cpu(), torch.neg(x))
    assert (_C.staging_stats()["hits"] > hits) == (elements == AT_THRESHOLD)


@pytest.mark.skipif(CHIP != "sim", reason="the Python runner's round trip: adapter chips")
@pytest.mark.parametrize("elements", [N, AT_THRESHOLD, AT_THRESHOLD - 1, 16],
                         ids=["large", "at-threshold", "one-under", "small"])
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


@pytest.mark.parametrize("elements", [64, 1 << 16])
def test_the_runners_round_trip_covers_every_view_of_a_buffer(dev, elements):
    """Arguments viewing one buffer, a later one starting lower and one ending higher: the
    region copied to the host spans all of them (the Python runner, as above)."""
    flagos.set_route("aten::addcmul", "fallback")
    torch.manual_seed(0)
    x, two = torch.randn(3 * elements), torch.tensor(2.0)
    fx = x.to(dev)
    mid, low, high = slice(elements, 2 * elements), slice(0, elements), slice(2 * elements, None)
    assert torch.equal(torch.addcmul(fx[mid], fx[low], two).cpu(), torch.addcmul(x[mid], x[low], two))
    assert torch.equal(torch.addcmul(fx[mid], fx[high], two).cpu(), torch.addcmul(x[mid], x[high], two))


def test_the_runners_results_are_uploaded_each_and_an_op_without_results_returns_none(dev):
    """Calls the C round trip declines (a negative view, an empty tensor among the arguments)
    take the Python runner's: each of several results comes back a tensor of the device, and an
    op that returns nothing returns None, as on CPU."""
    flagos.set_route("aten::sort", "fallback")
    flagos.set_route("aten::_foreach_add_.Scalar", "fallback")
    torch.manual_seed(0)
    x = torch.randn(5, 7)
    values, indices = torch.sort(torch._neg_view(x.to(dev)), dim=1)
    expected = torch.sort(torch._neg_view(x), dim=1)
    assert values.device == indices.device == dev
    assert torch.equal(values.cpu(), expected.values) and torch.equal(indices.cpu(), expected.indices)
    a, empty, host = x.to(dev), torch.empty(0, device=dev), x.clone()
    assert torch.ops.aten._foreach_add_.Scalar([a, empty], 1.0) is None
    assert torch.ops.aten._foreach_add_.Scalar([host, torch.empty(0)], 1.0) is None
    assert torch.equal(a.cpu(), host)


SMALL = 4096  # float32 elements: 16 KiB, under the staging threshold (a host tensor of its own)


@pytest.mark.skipif(CHIP != "sim", reason="the C round trip of adapter chips")
@pytest.mark.skipif(RUNNER_ONLY, reason="kept host tensors are the C round trip's (adapter_fallback.c)")
def test_small_fallbacks_reuse_a_host_tensor_of_their_shape_and_never_leak_values(dev):
    """A small fallback copies into a host tensor of the argument's dtype and shape; the next
    call of that shape takes the same one back, overwritten whole."""
    flagos.set_route("aten::neg", "fallback")
    torch.manual_seed(0)
    x1, x2, x3 = torch.randn(64, SMALL // 64), torch.randn(64, SMALL // 64), torch.randn(32, SMALL // 32)
    first = torch.neg(x1.to(dev))
    stats = _C.staging_stats()
    assert stats["kept_host_tensors"] == 1 and stats["kept_bytes"] == SMALL * 4
    second = torch.neg(x2.to(dev))
    assert _C.staging_stats()["host_tensor_hits"] == stats["host_tensor_hits"] + 1
    third = torch.neg(x3.to(dev))  # same bytes, another shape: a tensor of its own
    assert _C.staging_stats()["host_tensor_hits"] == stats["host_tensor_hits"] + 1
    half = torch.neg(x1.half().to(dev))  # another dtype: of its own too
    assert _C.staging_stats()["kept_host_tensors"] == 3
    for got, want in ((first, -x1), (second, -x2), (third, -x3), (half, -x1.half())):
        assert torch.equal(got.cpu(), want)
    for rows in range(1, 11):  # ten more shapes: the eight most recent are kept
        y = torch.randn(rows, 8)
        assert torch.equal(torch.neg(y.to(dev)).cpu(), -y)
    assert _C.staging_stats()["kept_host_tensors"] == 8
    torch.flagos.empty_cache()
    assert _C.staging_stats()["kept_host_tensors"] == 0 and _C.staging_stats()["kept_bytes"] == 0


@pytest.mark.skipif(CHIP != "sim", reason="the C round trip of adapter chips")
def test_a_host_tensor_an_op_keeps_is_never_handed_out_again(dev):
    """An op that keeps a view of its host input (a custom op, as a user library may register
    one) leaves that host tensor to it: the next call gets another, and the view keeps its
    values."""
    kept = []
    lib = torch.library.Library("flagos_staging_test", "DEF")
    lib.define("stash(Tensor x) -> Tensor")
    lib.impl("stash", lambda x: (kept.append(x[:4]), x * 2)[1], "CPU")
    try:
        torch.manual_seed(0)
        x1, x2 = torch.randn(SMALL), torch.randn(SMALL)
        out1 = torch.ops.flagos_staging_test.stash(x1.to(dev))
        assert _C.staging_stats()["kept_host_tensors"] == 0  # the op's view sees it
        out2 = torch.ops.flagos_staging_test.stash(x2.to(dev))
        assert torch.equal(kept[0], x1[:4]) and torch.equal(kept[1], x2[:4])
        assert torch.equal(out1.cpu(), x1 * 2) and torch.equal(out2.cpu(), x2 * 2)
    finally:
        lib._destroy()


@pytest.mark.skipif(CHIP != "sim", reason="the C round trip of adapter chips")
def test_arguments_an_op_writes_or_resizes_take_no_kept_host_tensor(dev, monkeypatch):
    flagos.set_route("aten::neg", "fallback")
    flagos.set_route("aten::neg.out", "fallback")
    flagos.set_route("aten::neg_", "fallback")
    x = torch.randn(SMALL)
    fx = x.to(dev)
    before = _C.staging_stats()
    fx.neg_()  # in place: the host copy is written, then copied back
    out = torch.empty(3, device=dev)
    with pytest.warns(UserWarning, match="resized"):
        torch.neg(x.to(dev), out=out)  # the out= argument is resized on the host, as on the CPU
    stats = _C.staging_stats()
    assert stats["kept_host_tensors"] == 0
    assert (stats["host_tensor_hits"], stats["host_tensor_misses"]) == (before["host_tensor_hits"],
                                                                       before["host_tensor_misses"])
    assert torch.equal(fx.cpu(), -x) and torch.equal(out.cpu(), -x)
    monkeypatch.setenv("FLAGOS_FALLBACK_STAGING", "0")  # keeps nothing, host tensors included
    assert torch.equal(torch.neg(fx).cpu(), x)
    assert _C.staging_stats()["kept_host_tensors"] == 0
