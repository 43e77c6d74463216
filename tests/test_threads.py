"""Ops in several threads while another thread changes the router's table.

The router runs Python in the middle of an op (the resolver, the adapter runner, override
kernels), which lets another thread run: routes that change then (set_route, register_kernel)
and a table rebuilt then (a new router configuration) must not free what the running op uses.
Each case runs in its own process, so a crash is a failure and not the end of the suite.
"""
import pytest
from conftest import device_mode_only, run_python

pytestmark = device_mode_only

WORKERS_AND_CHANGER = """
    import sys, threading, torch, flagos
    sys.setswitchinterval(1e-5)  # switch threads as often as possible: the races show sooner
    flagos.activate(CHIP)
    state = flagos.core._state.active()
    dev = flagos.device()
    torch.manual_seed(0)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    expected = (x @ y + x).relu().sum(0)
    stop = threading.Event()
    failures, runs = [], []

    def worker():
        fx, fy = x.to(dev), y.to(dev)
        n = 0
        try:
            while not stop.is_set():
                out = (fx @ fy + fx).relu().sum(0)        # mm, add, relu, sum
                acc = torch.zeros(16, device=dev)
                acc.add_(out)                              # in place: the written argument
                twice = torch.empty(16, device=dev)
                torch.mul(acc, 2, out=twice)               # out=: the written argument
                got = twice.view(4, 4).cpu().view(16)      # a view, then a copy to the host
                if not torch.allclose(got, 2 * expected, rtol=1e-5, atol=1e-5):
                    failures.append(f"wrong result: {got} != {2 * expected}")
                n += 1
        except Exception as e:  # an op that raises is a failure too
            failures.append(repr(e))
        runs.append(n)

    def add_on_payloads(a, b, alpha=1):
        if isinstance(a, flagos.FlagosTensor):
            raise NotImplementedError  # an adapter chip's kernel gets flagos tensors: hand back
        return torch.ops.aten.add.Tensor(a, b, alpha=alpha)

    def declining_add(a, b, alpha=1):
        raise NotImplementedError  # the chip's own kernel runs instead

    def changer():
        for i in range(CHANGES):
            flagos.set_route("aten::mm", ("fallback", "native", "auto")[i % 3])
            flagos.set_route("aten::relu", ("auto", "fallback")[i % 2])
            flagos.register_kernel("aten::add.Tensor", (add_on_payloads, declining_add)[i % 2])
            if i % 3 == 2:  # a call routed to the kernel before this takes the op's route now
                flagos.unregister_kernel("aten::add.Tensor")
            flagos.activate(CHIP)                          # same chip: stays as it is
            flagos._activation._configure_router(state)  # a new table
            flagos.fallback_report()                       # reads the table meanwhile
        stop.set()

    threads = [threading.Thread(target=worker) for _ in range(3)] + [threading.Thread(target=changer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert all(n > 0 for n in runs), runs
    # afterwards the routes asked for last are the ones taken
    flagos.set_route("aten::mm", "fallback")
    with flagos.track() as report:
        torch.testing.assert_close((x.to(dev) @ y.to(dev)).cpu(), x @ y)
    assert report.op("aten::mm")["calls"]["fallback"] == 1
    print("OK", sum(runs), "runs")
"""


@pytest.mark.parametrize("chip", ["cpu", "sim"])
def test_route_changes_and_new_tables_while_other_threads_run_ops(chip):
    code = f"    CHIP, CHANGES = {chip!r}, 150" + WORKERS_AND_CHANGER
    proc = run_python(code, env={"FLAGOS_FALLBACK": "allow"}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "OK" in proc.stdout
