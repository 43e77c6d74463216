"""What the CPU fallback counts (time, bytes each way) and what it writes back.

Expected bytes are computed here from the tensors' sizes. Times depend on the machine and its
load, so the tests check how they are counted (on fallback calls only, adding up, reset by
`reset_report`), never against a duration.
"""
import time

import pytest
import torch
from conftest import CHIP, device_mode_only

import flagos

pytestmark = device_mode_only


def fallback_ns(op: str) -> int:
    row = flagos.fallback_report().op(op)
    return row["fallback_ns"] if row else 0


def test_fallback_time_is_counted_on_fallback_calls_only(dev):
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    fx, fy = x.to(dev), y.to(dev)
    flagos.set_route("aten::mm", "fallback")
    outside = []  # the host clock around each fallback call: the counted time lies inside
    for expected_calls in (1, 2):
        before = fallback_ns("aten::mm")
        t0 = time.perf_counter_ns()
        out = fx @ fy
        outside.append(time.perf_counter_ns() - t0)
        row = flagos.fallback_report().op("aten::mm")
        assert row["calls"]["fallback"] == expected_calls
        assert row["fallback_ns"] > before  # each fallback call adds its time
        torch.testing.assert_close(out.cpu(), x @ y)
    assert fallback_ns("aten::mm") <= sum(outside)
    assert flagos.fallback_report().fallback_seconds == pytest.approx(fallback_ns("aten::mm") / 1e9)

    counted = fallback_ns("aten::mm")
    flagos.set_route("aten::mm", "native")  # the chip's own kernel: no fallback time
    torch.testing.assert_close((fx @ fy).cpu(), x @ y, atol=1e-5, rtol=1e-5)
    row = flagos.fallback_report().op("aten::mm")
    assert row["calls"]["native"] == 1 and row["fallback_ns"] == counted

    flagos.reset_report()
    assert fallback_ns("aten::mm") == 0 and flagos.fallback_report().fallback_seconds == 0


def test_native_calls_count_no_fallback_time(dev):
    a = torch.ones(64, device=dev)
    (a + a).cpu()
    row = flagos.fallback_report().op("aten::add.Tensor")
    assert row["calls"]["native"] == 1 and row["fallback_ns"] == 0
    assert row["bytes_to_host"] == 0 and row["bytes_to_device"] == 0


def test_calls_that_never_fall_back_count_no_time_and_no_bytes(dev):
    """Allocation, copies, in-place views, detach, fills, an override kernel and a decomposition
    run whole: every row without a fallback call reports no fallback time and no bytes moved."""
    flagos.register_kernel("aten::relu", lambda x: torch.clamp(x, min=0), chip=CHIP)
    try:
        flagos.reset_report()
        a = torch.ones(4, 6, device=dev)
        b = a.clone().unsqueeze_(0).squeeze_(0).t_().transpose_(0, 1)
        b.fill_(2.0).zero_()
        c = torch.empty_like(a).copy_(a).relu().detach()
        with torch.inference_mode():   # a decomposition reaches the chip whole; its parts run there
            d = torch.nn.functional.linear(a, torch.ones(3, 6, device=dev))
        assert c.sum().item() == 24.0 and b.sum().item() == 0.0 and d.sum().item() == 72.0
        rows = [r for r in flagos.fallback_report().rows if r["calls"]["fallback"] == 0]
        assert {"aten::relu", "aten::unsqueeze_", "aten::fill_.Scalar", "aten::linear", "aten::detach"} <= \
            {r["op"] for r in rows}
        for row in rows:
            assert (row["op"], row["fallback_ns"], row["bytes_to_host"], row["bytes_to_device"]) == \
                (row["op"], 0, 0, 0)
    finally:
        flagos.unregister_kernel("aten::relu", chip=CHIP)


def test_bytes_of_an_inplace_fallback(dev):
    a, b = torch.arange(10.0), torch.full((10,), 2.0)
    fa = a.to(dev)
    flagos.set_route("aten::add_", "fallback")
    assert fa.add_(b.to(dev)) is fa
    assert fa.cpu().tolist() == (a + b).tolist()
    row = flagos.fallback_report().op("aten::add_.Tensor")
    assert row["bytes_to_host"] == 2 * 10 * 4   # self and other go to the host
    assert row["bytes_to_device"] == 10 * 4     # self, written, comes back; nothing else


def test_bytes_of_an_out_fallback(dev):
    a = torch.arange(6.0)
    fa, out = a.to(dev), torch.empty(6, device=dev)
    flagos.set_route("aten::mul", "fallback")
    assert torch.mul(fa, 3, out=out) is out
    assert out.cpu().tolist() == (a * 3).tolist()
    row = flagos.fallback_report().op("aten::mul.out")
    assert row["bytes_to_host"] == 2 * 6 * 4 and row["bytes_to_device"] == 6 * 4


def test_bytes_of_a_view_fallback(dev):
    base = torch.zeros(4, 8, device=dev)
    view = base[1, 2:5]                        # 3 elements inside a 32-element buffer
    flagos.set_route("aten::add_", "fallback")
    view.add_(1.5)
    expected = torch.zeros(4, 8)
    expected[1, 2:5] = 1.5
    assert torch.equal(base.cpu(), expected)
    row = flagos.fallback_report().op("aten::add_.Scalar") or flagos.fallback_report().op("aten::add_.Tensor")
    assert row["bytes_to_host"] == 3 * 4 and row["bytes_to_device"] == 3 * 4


def test_bytes_of_an_out_fallback_with_several_results(dev):
    """sort(out=(values, indices)): each written tensor comes back once, and the op returns
    the caller's own two tensors (no second upload of the results)."""
    x = torch.tensor([[3.0, 1.0, 2.0], [0.5, -1.0, 4.0]])
    values, indices = torch.empty(2, 3, device=dev), torch.empty(2, 3, dtype=torch.long, device=dev)
    flagos.set_route("aten::sort", "fallback")
    got = torch.sort(x.to(dev), dim=1, out=(values, indices))
    assert got[0] is values and got[1] is indices
    ref = torch.sort(x, dim=1)
    assert torch.equal(values.cpu(), ref.values) and torch.equal(indices.cpu(), ref.indices)
    row = flagos.fallback_report().op("aten::sort.values")
    assert row["bytes_to_host"] == 6 * 4 + 6 * 4 + 6 * 8   # x, values, indices
    assert row["bytes_to_device"] == 6 * 4 + 6 * 8         # values and indices, once each


def test_a_written_list_of_tensors_is_written_back_whole(dev):
    """An in-place op over a list (the foreach ops optimizers use) on the fallback: every
    tensor of the list comes back with its new values."""
    xs = [torch.randn(3), torch.randn(2, 2), torch.randn(1)]
    ys = [x.to(dev) for x in xs]
    flagos.set_route("aten::_foreach_add_", "fallback")
    torch._foreach_add_(ys, 1.5)
    for x, y in zip(xs, ys):
        torch.testing.assert_close(y.cpu(), x + 1.5)
    row = flagos.fallback_report().op("aten::_foreach_add_.Scalar")
    assert row["calls"]["fallback"] == 1 and row["bytes_to_device"] == (3 + 4 + 1) * 4


def test_new_results_count_their_upload(dev):
    x = torch.randn(5, 7)
    flagos.set_route("aten::cumsum", "fallback")
    out = x.to(dev).cumsum(1)
    torch.testing.assert_close(out.cpu(), x.cumsum(1))
    row = flagos.fallback_report().op("aten::cumsum")
    assert row["bytes_to_host"] == 5 * 7 * 4 and row["bytes_to_device"] == 5 * 7 * 4
    assert row["dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_running_statistics_are_written_back(dev, momentum):
    # sim has no batch-norm kernel; on cpu the route is forced: either way the fallback runs
    # native_batch_norm, which writes running_mean and running_var (not returned) in place
    flagos.set_route("aten::native_batch_norm", "fallback")
    flagos.set_route("aten::_native_batch_norm_legit", "fallback")
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm2d(3, momentum=momentum)
    bn = torch.nn.BatchNorm2d(3, momentum=momentum).to(dev)
    batches = [torch.randn(4, 3, 5, 5) * 3 + 1 for _ in range(3)]
    for x in batches:
        torch.testing.assert_close(bn(x.to(dev)).cpu(), ref(x), atol=1e-5, rtol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        mine, theirs = getattr(bn, name).cpu(), getattr(ref, name)
        assert not torch.equal(theirs, torch.nn.BatchNorm2d(3).__getattr__(name)), name  # it moved
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5, msg=name)
    bn.eval(), ref.eval()
    x = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(bn(x.to(dev)).cpu(), ref(x), atol=1e-5, rtol=1e-5)
    assert flagos.fallback_report().calls("fallback") >= 3
