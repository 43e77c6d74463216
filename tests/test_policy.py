"""The fallback policy and the route decisions around it: when a fallback may run, what it
checks first, and who takes a call a kernel declines (NotImplementedError).

Every expectation is a plain value (what the tensor holds when nothing ran, what PyTorch on
the CPU computes), never what flagos did on another route.
"""
import warnings

import pytest
import torch
from conftest import CHIP, device_mode_only, run_python

import flagos

pytestmark = device_mode_only

torch_native_chip = pytest.mark.skipif(
    CHIP != "cpu", reason="the C router's own native/fallback path: torch-native chips (cpu here)")


class policy:
    """Set the fallback policy (0 allow, 1 warn, 2 error) for one block."""

    def __init__(self, code):
        self.code = code

    def __enter__(self):
        flagos._C.set_fallback_policy(self.code)

    def __exit__(self, *exc):
        flagos._C.set_fallback_policy(0)  # the suite's own policy (conftest: allow)


def test_error_policy_raises_before_an_inplace_fallback_runs(dev):
    a = torch.ones(3, device=dev)
    flagos.set_route("aten::add_", "fallback")
    with policy(2), pytest.raises(flagos.FallbackError, match=r"aten::add_\.Tensor would fall back"):
        a.add_(5)
    assert a.cpu().tolist() == [1.0, 1.0, 1.0]  # nothing ran, nothing was written
    row = flagos.fallback_report().op("aten::add_.Tensor")
    assert row is None or sum(row["calls"].values()) == 0


def test_warning_turned_error_stops_the_fallback_before_it_runs(dev):
    a = torch.ones(3, device=dev)
    flagos.set_route("aten::mul_", "fallback")
    with policy(1), warnings.catch_warnings():
        warnings.simplefilter("error", flagos.FallbackWarning)
        with pytest.raises(flagos.FallbackWarning, match=r"aten::mul_\.\w+ falls back"):
            a.mul_(3)
    assert a.cpu().tolist() == [1.0, 1.0, 1.0]


def test_warn_policy_warns_once_per_op_and_runs(dev):
    a = torch.ones(2, device=dev)
    # ops no other test warns about: the warning comes once per op for the whole process
    flagos.set_route("aten::cosh", "fallback")
    flagos.set_route("aten::sinh", "fallback")
    with policy(1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [a.cosh() for _ in range(3)] + [a.sinh()]
    ops = sorted(str(w.message).split()[0] for w in caught if issubclass(w.category, flagos.FallbackWarning))
    assert ops == ["aten::cosh", "aten::sinh"]
    assert outs[0].cpu().tolist() == torch.ones(2).cosh().tolist()


def test_allow_policy_is_silent(dev):
    a = torch.ones(2, device=dev)
    flagos.set_route("aten::tan", "fallback")
    with policy(0), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = a.tan()
    assert not [w for w in caught if issubclass(w.category, flagos.FallbackWarning)]
    assert out.cpu().tolist() == torch.ones(2).tan().tolist()


@pytest.mark.parametrize("route", ["native", "fallback"])
def test_mixed_devices_are_refused_on_every_route(dev, route):
    a = torch.ones(3, device=dev)
    flagos.set_route("aten::add", route)
    with pytest.raises(flagos.DeviceMismatchError, match=r"argument 'other' is a tensor on cpu"):
        a + torch.ones(3)
    flagos.set_route("aten::cat", route)
    with pytest.raises(flagos.DeviceMismatchError, match=r"argument 'tensors'"):
        torch.cat([a, torch.ones(3)])
    assert flagos.fallback_report().calls("fallback") == 0


def test_override_declining_hands_the_call_to_the_chip_kernel(dev):
    seen = []

    def declines(x):
        seen.append(1)
        raise NotImplementedError("not for these arguments")

    flagos.register_kernel("aten::relu", declines, chip=CHIP)
    try:
        out = torch.tensor([-1.0, 2.0, -3.0], device=dev).relu()
        assert out.cpu().tolist() == [0.0, 2.0, 0.0] and seen == [1]
        calls = flagos.fallback_report().op("aten::relu")["calls"]
        assert calls == {"override": 0, "native": 1, "fallback": 0}
        assert flagos.route_of("aten::relu") == "override"  # it stays registered
    finally:
        flagos.unregister_kernel("aten::relu", chip=CHIP)


_lib = None
_declined = []


def declining_op():
    """flagos_test::twice(x) = 2 * x, whose kernel declines its first call with
    NotImplementedError, as a chip kernel without support for some input does."""
    global _lib
    if _lib is None:
        _lib = torch.library.Library("flagos_test", "DEF")
        _lib.define("twice(Tensor x) -> Tensor")

        def kernel(x):
            if not _declined:
                _declined.append(1)
                raise NotImplementedError("this chip has no kernel for twice")
            return x * 2
        _lib.impl("twice", kernel, "CPU")
    return torch.ops.flagos_test.twice.default


@torch_native_chip
def test_chip_kernel_raising_not_implemented_takes_the_cpu_fallback(dev):
    op = declining_op()
    x = torch.tensor([1.0, -2.0, 3.5])
    out = op(x.to(dev))
    assert out.device == dev and out.cpu().tolist() == [2.0, -4.0, 7.0]
    again = op(x.to(dev))  # now known not implemented: straight to the fallback
    assert again.cpu().tolist() == [2.0, -4.0, 7.0]
    row = flagos.fallback_report().op("flagos_test::twice")
    assert row["calls"] == {"override": 0, "native": 0, "fallback": 2}
    assert row["not_implemented"] is True and flagos.route_of("flagos_test::twice") == "fallback"


@torch_native_chip
def test_not_implemented_and_error_policy_raises_fallback_error(dev):
    # a chip kernel that declines under FLAGOS_FALLBACK=error: the fallback is refused too
    proc = run_python("""
        import torch, flagos
        flagos.activate("cpu")
        lib = torch.library.Library("flagos_test", "DEF")
        lib.define("never(Tensor(a!) x) -> ()")
        def kernel(x):
            if not getattr(kernel, "declined", False):  # the chip's call: declined
                kernel.declined = True
                raise NotImplementedError("no kernel")
            x.add_(1)                                   # the host's call, if it came
        lib.impl("never", kernel, "CPU")
        a = torch.zeros(2, device="flagos")
        try:
            torch.ops.flagos_test.never(a)
        except flagos.FallbackError as e:
            print("REFUSED", a.cpu().tolist())
    """, env={"FLAGOS_FALLBACK": "error"})
    assert "REFUSED [0.0, 0.0]" in proc.stdout
