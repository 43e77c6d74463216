"""Training where autograd's engine has no queue for a flagos device: after a backward pass
that ran before activation, and on flagos:1 and above. backward() raises an error that says
why and what to do (never PyTorch's internal assert), and the process stays usable: forward
work on every device matches plain CPU, and training on flagos:0 does when the engine allows.

Each case runs in its own process: the engine's queues are sized once per process.
"""
import pytest
from conftest import device_mode_only, run_python

pytestmark = device_mode_only

PRELUDE = """
import torch, flagos
torch.manual_seed(0)
ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
x = torch.randn(4, 6)
"""

STEP = """
def step(dev):
    import copy
    model = copy.deepcopy(ref).to(dev)
    loss = model(x.to(dev)).pow(2).sum()
    try:
        loss.backward()
    except Exception as e:
        print("RAISED", dev, type(e).__name__, "|", str(e))
        return
    ref.zero_grad()
    ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1.3e-6, atol=1e-6)
    print("TRAINED", dev)
"""


def forward_check(dev: str) -> str:
    return f"""
with torch.no_grad():
    model = __import__("copy").deepcopy(ref).to("{dev}")
    torch.testing.assert_close(model(x.to("{dev}")).cpu(), ref(x), rtol=1.3e-6, atol=1e-6)
print("FORWARD OK {dev}")
"""


@pytest.mark.parametrize("chip", ["cpu", "sim"])
def test_backward_before_activation_gives_a_clear_error(chip):
    proc = run_python(PRELUDE + """
ref(x).sum().backward()                         # plain CPU, before flagos exists
flagos.activate(CHIP)
print("BACKWARD_OK", flagos.info()["backward"])
""".replace("CHIP", repr(chip)) + STEP + "step('flagos:0')\n" + forward_check("flagos:0"),
        env={"FLAGOS_FALLBACK": "allow"}, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"
    assert "BACKWARD_OK False" in out
    assert "activates at `import torch`" in proc.stderr  # the warning at activation
    line = next(ln for ln in out.splitlines() if ln.startswith("RAISED"))
    assert "NoEngineQueueError" in line and "a backward pass ran before flagos was activated" in line
    assert "call flagos.activate() at the start of the program" in line
    assert "INTERNAL ASSERT" not in out + proc.stderr
    assert "FORWARD OK flagos:0" in out


def test_backward_after_activation_trains_on_the_cpu_chip():
    proc = run_python(PRELUDE + "flagos.activate('cpu')\n" + STEP + "step('flagos:0')\n"
                      "ref(x).sum().backward()\n" + STEP.replace("def step", "def step2")
                      + "step2('flagos:0')\n", env={"FLAGOS_FALLBACK": "allow"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("TRAINED flagos:0") == 2, proc.stdout


def test_second_sim_device_forward_works_and_backward_says_why():
    """With two sim devices: forward on flagos:1 matches CPU; backward there raises the clear
    error; the same process then trains on flagos:0 and matches CPU."""
    proc = run_python(PRELUDE + "flagos.activate('sim')\nassert torch.flagos.device_count() == 2\n"
                      + STEP + forward_check("flagos:1") + "step('flagos:1')\nstep('flagos:0')\n"
                      + forward_check("flagos:1"),
                      env={"FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_DEVICES": "2"}, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"
    line = next(ln for ln in out.splitlines() if ln.startswith("RAISED"))
    assert line.startswith("RAISED flagos:1 NoEngineQueueError"), line
    assert "flagos:1 or above" in line and "Train on flagos:0" in line
    assert "INTERNAL ASSERT" not in out + proc.stderr
    assert "TRAINED flagos:0" in out and out.count("FORWARD OK flagos:1") == 2


def test_factories_without_an_index_land_on_the_current_device():
    """As on CUDA, `torch.zeros(n, device="flagos")` after `torch.flagos.set_device(1)` is on
    flagos:1, with CPU's values. `.to("flagos")` and `torch.tensor(data, device="flagos")` give
    flagos:0: PyTorch fills in the index itself there, from its Python device guard, which
    answers 0 (docs/design.md §14, "The current device")."""
    proc = run_python("""
import torch, flagos
flagos.activate("sim")
torch.flagos.set_device(1)
made = {
    "zeros": (torch.zeros(2, 3, device="flagos"), torch.zeros(2, 3)),
    "full": (torch.full((4,), 2.5, device="flagos"), torch.full((4,), 2.5)),
    "arange": (torch.arange(5, device="flagos"), torch.arange(5)),
    "empty": (torch.empty(3, device="flagos"), None),
    "randn": (torch.randn(3, device="flagos", generator=torch.Generator("flagos").manual_seed(1)),
              torch.randn(3, generator=torch.Generator().manual_seed(1))),
}
for name, (got, expected) in made.items():
    assert got.device == torch.device("flagos", 1), (name, got.device)
    if expected is not None:
        torch.testing.assert_close(got.cpu(), expected)
assert torch.zeros(2, device="flagos:0").device == torch.device("flagos", 0)
print("TO", torch.ones(2).to("flagos").device, torch.tensor([1.0], device="flagos").device)
torch.flagos.set_device(0)
assert torch.zeros(2, device="flagos").device == torch.device("flagos", 0)
print("OK")
""", env={"FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_DEVICES": "2"}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "TO flagos:0 flagos:0" in proc.stdout and "OK" in proc.stdout


def test_the_current_device_is_each_threads_own():
    """As on CUDA, the current device belongs to the thread: a thread that serves flagos:1
    (`torch.flagos.set_device(1)`, one thread per device as servers and pin-memory threads do)
    does not move the others, and a new thread starts on flagos:0; factories without an index,
    `flagos.device()` and `torch.accelerator` follow the thread's device."""
    proc = run_python("""
import threading
import torch, flagos
flagos.activate("sim")
seen = {}
def serve(index):
    torch.flagos.set_device(index)
    barrier.wait()  # both threads have set theirs before either reads it
    made = torch.zeros(2, device="flagos") + index
    seen[index] = (torch.flagos.current_device(), made.device.index, flagos.device().index,
                   torch.accelerator.current_device_index(), made.cpu().tolist())
barrier = threading.Barrier(2)
workers = [threading.Thread(target=serve, args=(i,)) for i in (1, 0)]
[w.start() for w in workers]; [w.join() for w in workers]
print("SEEN", seen[0], seen[1])
fresh = {}
torch.flagos.set_device(1)
t = threading.Thread(target=lambda: fresh.update(i=torch.flagos.current_device(), d=torch.empty(1, device="flagos").device.index))
t.start(); t.join()
print("MAIN", torch.flagos.current_device(), torch.empty(1, device="flagos").device.index, "FRESH", fresh["i"], fresh["d"])
""", env={"FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_DEVICES": "2"}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "SEEN (0, 0, 0, 0, [0.0, 0.0]) (1, 1, 1, 1, [1.0, 1.0])" in proc.stdout
    assert "MAIN 1 1 FRESH 0 0" in proc.stdout
