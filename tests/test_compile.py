"""torch.compile over flagos tensors, compared with plain PyTorch eager on the CPU.

On a torch-native chip (cpu) graphs compile through Inductor with the payload device's code
generator; on a C-ABI chip (sim) torch.compile warns once and the functions run eagerly.
"""
import contextlib
import copy
import io
import json
import logging
import re
import types
import warnings

import pytest
import torch
from conftest import CHIP, device_mode_only, reference_device, run_python, runs_once
from torch._dynamo import guards as dynamo_guards
from torch._dynamo import output_graph
from torch._dynamo.guards import GuardBuilder
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd import graph_compile
from torch._guards import TracingContext, tracing
from torch._inductor.utils import fresh_cache
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.testing import assert_close

import flagos
from flagos.integrations import _compile
from flagos.runtime import _tracing
from flagos.runtime._tensor import FlagosTensor

pytestmark = device_mode_only
# chips whose flagos tensors hold torch tensors (the cpu chip, cuda, ...): not C-ABI chips
COMPILES = flagos.chips.profile(CHIP).torch_type is not None


@pytest.fixture(scope="module", autouse=True)
def own_inductor_cache(tmp_path_factory):
    """The compilations here, and the processes these tests start, use an Inductor cache of
    their own: what other programs compiled into the user's shared cache never reaches them."""
    with fresh_cache(dir=str(tmp_path_factory.mktemp("inductor"))):
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def assert_no_graph_break():
    """Plain PyTorch compiles the functions here whole; on a chip that compiles, flagos must
    not make Dynamo give up on a part and run it eagerly (the result would still match)."""
    if COMPILES:
        assert not counters["graph_break"], dict(counters["graph_break"])


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def test_factory_on_the_tensors_device(dev):
    """A graph that makes its own tensor on the input's device (positions, masks)."""
    def add_positions(x):
        return x * 2 + torch.arange(8, device=x.device) + torch.tensor([0.5], device=x.device)

    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sim's eager-only notice
        out = torch.compile(add_positions)(x.to(dev))
    assert out.device == dev and isinstance(out, flagos.FlagosTensor)
    assert_close(out.cpu(), add_positions(x), rtol=1.3e-6, atol=1e-6)
    assert_no_graph_break()
    assert flagos.fallback_report().compiled_calls == (1 if COMPILES else 0)


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_a_graph_over_flagos_tensors_with_only_host_outputs_is_counted(dev):
    """A graph that reads flagos tensors and hands back a host tensor has no flagos output to
    tell it from a plain CPU graph: the tracer marks it when it meets the flagos inputs, so its
    calls are counted in the report like any graph over flagos tensors."""
    def total_on_the_host(x):
        return (x * 2).sum(0).cpu()

    x = torch.randn(3, 8)
    compiled = torch.compile(total_on_the_host)
    flagos.reset_report()
    for _ in range(2):
        out = compiled(x.to(dev))
    assert type(out) is torch.Tensor and out.device.type == "cpu"
    assert_close(out, total_on_the_host(x), rtol=1.3e-6, atol=1e-6)
    assert flagos.fallback_report().compiled_calls == 2
    assert_no_graph_break()


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_compiled_outputs_have_the_layout_and_bits_plain_pytorch_gives_them(dev):
    """Every output of a compiled graph is wrapped on its way out (in C, as the router's are):
    views of the inputs with their strides and offsets, a conjugate view with its bit, a new
    tensor, each as the same graph compiled over plain tensors returns it."""
    def outputs(x, z):
        return x.t(), x[:, 1::2], z.conj(), x.sum(0) * 2

    x = torch.randn(4, 6)
    z = torch.randn(3, dtype=torch.complex64)
    ref_x, ref_z = x.to(reference_device()), z.to(reference_device())
    want = torch.compile(outputs)(ref_x, ref_z)
    got = torch.compile(outputs)(x.to(dev), z.to(dev))
    for g, w in zip(got, want):
        assert isinstance(g, FlagosTensor) and g.device == dev
        assert (g.shape, g.stride(), g.storage_offset()) == (w.shape, w.stride(), w.storage_offset())
        assert (g.is_conj(), g.is_neg(), g.requires_grad) == (w.is_conj(), w.is_neg(), w.requires_grad)
        assert_close(g.cpu(), w.cpu(), rtol=0, atol=0)
    assert_no_graph_break()


def test_wrapping_a_payload_before_activation_says_how_to_activate():
    """The C wrap behind every compiled output, asked before flagos is active: an error that
    names the fix, and the process goes on."""
    proc = run_python("""
        import torch
        from flagos.runtime._tensor import wrap
        try:
            wrap(torch.ones(2))
        except RuntimeError as e:
            print("refused:", e)
        print(torch.ones(2).sum().item())
    """)
    assert "refused: flagos is not active: call flagos.activate()" in proc.stdout
    assert proc.stdout.strip().endswith("2.0")


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_the_cache_key_of_a_flagos_input_holds_the_chip(dev, monkeypatch):
    """AOTAutograd's on-disk cache knows a flagos input only by this key: two inputs whose
    compiled code differs must not share it, in a cache folder two chips share. The same
    tensor on another chip gets another key; another shape or dtype too."""
    import dataclasses

    from flagos.core import _state as state_module
    first = torch.arange(12.0).to(dev)
    key = first._stable_hash_for_caching()
    assert key == torch.arange(12.0).to(dev)._stable_hash_for_caching()   # a key, not an identity
    assert first.view(3, 4)._stable_hash_for_caching() != key
    assert first.double()._stable_hash_for_caching() != key
    with torch.inference_mode():  # the same values, sizes and strides; its payload an inference tensor
        made_in_inference_mode = torch.arange(12.0).to(dev)
    assert made_in_inference_mode._stable_hash_for_caching() != key
    other_chip = dataclasses.replace(state_module.active(), chip=flagos.chips.profile("sim"))
    monkeypatch.setattr(state_module, "active_or_none", lambda: other_chip)
    assert first._stable_hash_for_caching() != key


def test_the_cache_key_of_flagos_graphs_changes_with_flagos_code_and_payload_device(monkeypatch, tmp_path):
    """What keys Inductor's cached graphs over flagos tensors: the compile and tracing code of
    this flagos and the payload device, so another flagos version or chip never gets them."""
    key = _compile._pass_id("cpu")
    assert re.fullmatch("flagos-compile-[0-9a-f]{16}-cpu", key) and key == _compile._pass_id("cpu")
    assert _compile._pass_id("cuda") == key[:-len("cpu")] + "cuda"
    for module in (_compile, _tracing):
        changed = tmp_path / f"{module.__name__}.py"
        changed.write_bytes(open(module.__file__, "rb").read() + b"# another version\n")
        with monkeypatch.context() as patch:
            patch.setattr(module, "__file__", str(changed))
            assert _compile._pass_id("cpu") != key
    assert _compile._pass_id("cpu") == key


def test_inductor_learns_the_payload_device_once_and_again_after_a_failure(monkeypatch):
    """The flagos device is compiled with the code generator of its payloads' device: cpu for
    a host chip, the chip's own device type otherwise. A registration that fails is tried
    again by the next compilation instead of leaving Inductor without the flagos device."""
    asked = []

    def register_for(payload_type):
        asked.append(payload_type)
        if len(asked) == 1:
            raise RuntimeError("Inductor is not ready")

    gpu = types.SimpleNamespace(payload_is_host=False, torch_type="cuda")
    monkeypatch.setattr(_compile, "_ready", False)
    monkeypatch.setattr(_compile, "_light_guards", lambda: None)
    monkeypatch.setattr(_compile, "_register_inductor_for", register_for)
    monkeypatch.setattr(_compile._state, "active", lambda: types.SimpleNamespace(chip=gpu))
    with pytest.raises(RuntimeError, match="not ready"):
        _compile._register_inductor()
    _compile._register_inductor()
    _compile._register_inductor()  # registered: not asked again
    assert asked == ["cuda", "cuda"]
    gpu.payload_is_host = True
    monkeypatch.setattr(_compile, "_ready", False)
    _compile._register_inductor()
    assert asked[-1] == "cpu"


def test_the_lighter_guards_are_installed_once():
    """A registration tried again (above) must not wrap Dynamo's guard builders twice."""
    _compile._light_guards()
    installed = [GuardBuilder.TENSOR_SUBCLASS_METADATA_MATCH, GuardBuilder.EQUALS_MATCH, GuardBuilder.TENSOR_MATCH]
    _compile._light_guards()
    assert [GuardBuilder.TENSOR_SUBCLASS_METADATA_MATCH, GuardBuilder.EQUALS_MATCH,
            GuardBuilder.TENSOR_MATCH] == installed


@pytest.mark.parametrize("index, expected", [(None, 0), (0, 0), (1, 1), (2, 2)])
def test_a_graph_moves_each_flagos_device_to_the_payload_device_of_its_index(monkeypatch, index, expected):
    """`torch.ones(2, device="flagos:1")` in a graph is made on the payload device of flagos:1
    (cuda:1 on the cuda chip); a device without an index is device 0's."""
    asked = []
    monkeypatch.setattr(_compile, "payload_device", lambda i: (asked.append(i), torch.device("cpu"))[1])
    graph = torch.fx.Graph()
    made = graph.call_function(torch.ones, (2,), {"device": torch.device("flagos", index)})
    graph.output(made)
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    _compile._to_payload_device(module)
    assert asked == [expected] and "flagos_outputs" not in module.meta   # no traced value said flagos
    assert "flagos" not in module.code   # recompiled: the code that runs is the moved graph's
    # traced: the output's fake value says flagos:index; it leaves the graph on that flagos device
    asked.clear()
    made.meta["val"] = FakeTensor(FakeTensorMode(), torch.empty(2, device="meta"), torch.device("flagos", index))
    _compile._to_payload_device(module)
    assert asked == [expected] and module.meta["flagos_outputs"] == {0: expected}
    assert made.meta["val"].device == torch.device("cpu")
    (node,) = [n for n in module.graph.nodes if n.op == "call_function"]
    assert node.kwargs["device"] == torch.device("cpu")
    assert torch.equal(module(), torch.ones(2))   # the module's code is the moved graph's


@pytest.mark.parametrize("missing", ["TENSOR_SUBCLASS_METADATA_MATCH", "EQUALS_MATCH"])
def test_a_pytorch_without_either_guard_builder_keeps_its_guards_as_they_are(monkeypatch, missing):
    """Another PyTorch whose GuardBuilder lacks one of the two builders flagos lightens: none of
    its builders is replaced (not half of them), and no error."""
    class OtherBuilder:
        TENSOR_SUBCLASS_METADATA_MATCH = EQUALS_MATCH = TENSOR_MATCH = staticmethod(lambda *a: None)

    delattr(OtherBuilder, missing)
    before = dict(vars(OtherBuilder))
    monkeypatch.setattr(dynamo_guards, "GuardBuilder", OtherBuilder)
    _compile._light_guards()
    assert dict(vars(OtherBuilder)) == before


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_a_guard_filter_sees_the_guards_of_flagos_inputs_by_their_names(dev):
    """`torch.compile(options={"guard_filter_fn": ...})` (and PyTorch's own filters, such as
    `torch.compiler.keep_tensor_guards_unsafe`) tell guards apart by their builder's name: the
    builders flagos lightens keep theirs."""
    seen = []

    def record(entries):
        seen.extend(entry.guard_type for entry in entries)
        return [True] * len(entries)

    compiled = torch.compile(lambda x: x * 2 + 1, options={"guard_filter_fn": record})
    x = torch.randn(4)
    assert_close(compiled(x.to(dev)).cpu(), x * 2 + 1)
    assert {"TENSOR_MATCH", "TENSOR_SUBCLASS_METADATA_MATCH", "EQUALS_MATCH"} <= set(seen)
    assert [name for name in seen if not hasattr(GuardBuilder, name)] == []


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_graph_without_flagos_inputs():
    """Every tensor of the graph is made in it, on flagos; its outputs are flagos tensors. In a
    fresh process: here Inductor meets flagos before any flagos tensor is traced."""
    run_python("""
        import torch, flagos
        from torch.testing import assert_close
        flagos.activate("cpu")

        def make():
            return torch.ones(3, 4, device="flagos").cumsum(1) * 2, torch.arange(4, device="flagos")

        out, positions = torch.compile(make)()
        assert isinstance(out, flagos.FlagosTensor) and out.device == flagos.device()
        assert isinstance(positions, flagos.FlagosTensor)
        assert_close(out.cpu(), torch.ones(3, 4).cumsum(1) * 2)
        assert_close(positions.cpu(), torch.arange(4))
        assert flagos.fallback_report().compiled_calls == 1
    """)


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_eager_work_imports_nothing_of_dynamo_or_inductor():
    """Activation, a training step and the device module's other attributes leave Dynamo and
    Inductor unimported (seconds of import time a program that never compiles does not pay)."""
    run_python("""
        import sys, torch, flagos
        flagos.activate("cpu")
        model = torch.nn.Linear(4, 2).to(flagos.device())
        model(torch.randn(3, 4, device="flagos")).sum().backward()
        assert torch.flagos.device_count() == 1 and torch.flagos.is_available()
        assert getattr(torch.flagos, "no_such_attribute", None) is None
        loaded = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
        assert loaded == [], loaded
    """)


def test_llama_forward_with_cache_matches_plain_cpu(dev):
    """The default forward: a DynamicCache made inside the graph (torch.tensor on the device)."""
    ref = tiny_llama().eval()
    model = copy.deepcopy(ref).to(dev)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        expected = ref(ids).logits
        out = torch.compile(model)(ids.to(dev))
    assert out.logits.device == dev
    assert_close(out.logits.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert_no_graph_break()


def test_llama_forward_backward_matches_plain_cpu(dev):
    ref = tiny_llama()
    model = copy.deepcopy(ref).to(dev)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ref_out = ref(ids, labels=ids, use_cache=False)
    ref_out.loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = torch.compile(model)(ids.to(dev), labels=ids.to(dev), use_cache=False)
        out.loss.backward()
    assert out.logits.device == dev
    assert_close(out.logits.cpu(), ref_out.logits, rtol=1e-5, atol=1e-5)
    assert_close(out.loss.cpu(), ref_out.loss, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert q.grad is not None and q.grad.device == dev, name
        assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert_no_graph_break()


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_report_counts_compiled_graph_calls(dev):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(copy.deepcopy(ref).to(dev))
    x = torch.randn(5, 8)
    xd, xd2 = x.to(dev), (x * 2).to(dev)
    flagos.reset_report()
    first = compiled(xd)  # compiles: the ops traced through the router are not counted
    with flagos.track() as scope:
        out = compiled(xd)
        out2 = compiled(xd2)
    report = flagos.fallback_report()
    assert_close(first.cpu(), ref(x), rtol=1.3e-6, atol=1e-5)
    assert_close(out.cpu(), ref(x), rtol=1.3e-6, atol=1e-5)
    assert_close(out2.cpu(), ref(x * 2), rtol=1.3e-6, atol=1e-5)
    assert scope.compiled_calls == 2
    assert report.to_dict()["totals"]["compiled_graph_calls"] == 3
    assert report.calls() == 0, str(report)  # the graph's ops bypass the router
    assert "3 calls of torch.compile'd graphs" in str(report) and "not counted" in str(report)
    flagos.reset_report()
    assert flagos.fallback_report().compiled_calls == 0
    # outputs carry autograd as the grad mode of each call says, not as the first call's did
    assert out.requires_grad
    with torch.no_grad():
        assert not compiled(xd).requires_grad


class StrictLogHandler(logging.Handler):
    """Formats every record and raises when one cannot be formatted, as pytest's log capture
    does (logging's own handlers print "--- Logging error ---" and go on)."""

    def emit(self, record):
        self.format(record)

    def handleError(self, record):
        raise


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_compile_logs_print_traced_flagos_tensors(dev):
    """The aot_graphs and dynamo logs print the traced (fake) flagos tensors of a compilation
    in AOTAutograd's metadata and Dynamo's graph inputs. Printing one must not run ops on its
    fake payload (a fake tensor refuses masked_select, which formatting values needs): the
    compilation would fail, graph-break and run eagerly, its calls uncounted."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(copy.deepcopy(ref).to(dev))
    x = torch.randn(5, 8)
    loggers = (graph_compile.aot_graphs_log, output_graph.log)
    strict = StrictLogHandler()
    try:
        with contextlib.redirect_stderr(io.StringIO()) as stderr:
            torch._logging.set_logs(dynamo=logging.DEBUG, aot_graphs=True)  # logs to stderr
            for logger in loggers:
                logger.addHandler(strict)
            out = compiled(x.to(dev))
    finally:
        for logger in loggers:
            logger.removeHandler(strict)
        torch._logging.set_logs()
    assert "device='flagos:0'" in stderr.getvalue()  # the logs did print flagos tensors
    assert_close(out.cpu(), ref(x), rtol=1.3e-6, atol=1e-5)
    assert flagos.fallback_report().compiled_calls == 1  # compiled, not run eagerly


def mlp_in_a_process(width: int) -> str:
    """A program that compiles a small MLP of the given width twice, first on plain CPU tensors,
    then on flagos, checks the flagos result against plain PyTorch eager, and prints how many
    compiled calls flagos counted and how many graphs AOTAutograd took from its cache."""
    return f"""
        import copy, json, torch, flagos
        from torch._dynamo.utils import counters
        from torch.testing import assert_close
        flagos.activate("cpu")
        torch.set_grad_enabled(False)  # inference graphs: AOTAutograd caches them at once
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(8, {width}), torch.nn.GELU(), torch.nn.Linear({width}, 4))
        x = torch.randn(5, 8)
        assert_close(torch.compile(ref)(x), ref(x))  # the plain CPU graph
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(ref).to(flagos.device()))
        flagos.reset_report()
        out = compiled(x.to(flagos.device()))
        compiled(x.to(flagos.device()))
        assert isinstance(out, flagos.FlagosTensor)
        assert_close(out.cpu(), ref(x))
        print(json.dumps({{"calls": flagos.fallback_report().compiled_calls,
                          "hits": counters["aot_autograd"]["autograd_cache_hit"]}}))
    """


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_processes_sharing_a_cache_reuse_graphs_of_their_own_shapes_only(tmp_path):
    """Programs share one Inductor cache directory (by default every program of a user shares
    one). A second program with the same model code at another width must not be handed the
    first one's graphs, whose code checks the sizes it was made for. A third, at the first
    width, loads the graphs AOTAutograd cached, and its calls are counted. A plain CPU graph
    compiled first, identical to the flagos one once flagos tensors are seen as their
    payloads, does not stand in for the flagos graph (its code would not count the calls)."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def run(width):
        return json.loads(run_python(mlp_in_a_process(width), env=env).stdout.strip().splitlines()[-1])

    assert run(16) == {"calls": 2, "hits": 0}
    assert run(32) == {"calls": 2, "hits": 0}  # nothing of width 16 served
    assert run(16) == {"calls": 2, "hits": 2}  # the plain graph and the flagos graph, both loaded


@pytest.mark.skipif(COMPILES, reason="only C-ABI chips refuse compilation")
def test_adapter_chip_warns_once_and_runs_eagerly(dev):
    _tracing._warned = False  # the notice is once per process; this test wants to see it
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)
    x = torch.randn(5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model)
        out = compiled(x.to(dev))
        out.sum().backward()
        compiled(x.to(dev) * 2)
        torch.compile(lambda t: t + 1)(x.to(dev))
    notices = [w for w in caught if "torch.compile cannot trace" in str(w.message)]
    assert len(notices) == 1, [str(w.message) for w in caught]
    message = str(notices[0].message)
    assert f"chip '{CHIP}'" in message and "C-ABI adapter chip" in message and "eagerly" in message
    assert_close(out.cpu(), ref(x), rtol=1.3e-6, atol=1e-5)
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad.cpu(), q.grad, rtol=1.3e-6, atol=1e-5)
    report = flagos.fallback_report()
    assert report.calls() > 0 and report.compiled_calls == 0  # eager: every op routed


@runs_once
def test_inductor_set_up_before_activation_still_learns_the_flagos_device():
    """A process that compiled plain CPU code before activating flagos: Inductor asked for
    PrivateUse1's code generators while the slot had no name, and does not ask again; the
    first trace of a flagos tensor registers the device (the graph's calls are counted, its
    output is a flagos tensor)."""
    proc = run_python("""
        import torch
        torch.compile(lambda t: t + 1)(torch.ones(2))   # Inductor set up first
        import flagos
        flagos.activate("cpu")
        x = torch.randn(3, 4)
        out = torch.compile(lambda t: (t * 2).sum(0))(x.to(flagos.device()))
        print("OUT", type(out).__name__, torch.allclose(out.cpu(), (x * 2).sum(0)),
              flagos.fallback_report().compiled_calls)
    """)
    assert "OUT FlagosTensor True 1" in proc.stdout, proc.stdout + proc.stderr[-2000:]


@runs_once
def test_a_fresh_process_on_an_adapter_chip_warns_at_its_first_compilation():
    """The notice is once per process, and a new process has not given it yet (the test
    above resets the flag itself, so it cannot see the flag's starting value)."""
    proc = run_python("""
        import warnings, torch, flagos
        flagos.activate("sim")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                torch.compile(lambda t: t + 1)(torch.ones(2, device=flagos.device()))
        print("NOTICES", sum("torch.compile cannot trace" in str(w.message) for w in caught))
    """)
    assert "NOTICES 1" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(COMPILES, reason="only C-ABI chips' tensors hold no torch tensor")
def test_a_library_asking_an_adapter_tensor_for_its_inner_tensors_is_told_what_to_ask(dev):
    """Outside a compilation (huggingface_hub's storage ids when saving ask this way) a C-ABI
    chip's tensor has no inner tensor to give: a clear error names what to ask instead."""
    import torch._dynamo  # noqa: F401 - the answer differs once Dynamo is imported
    t = torch.ones(2, device=dev)
    with pytest.raises(RuntimeError, match=f"on chip '{CHIP}' hold adapter buffers, not torch tensors.*data_ptr"):
        t.__tensor_flatten__()


def test_fake_copies_made_outside_a_compilation(dev):
    """A FakeTensorMode entered by hand, make_fx and torch.export's default (non-strict) export
    copy flagos tensors as PyTorch copies CPU ones: the fake copy's wrapper describes its own storage, not
    its payload's (taken for shared memory, PyTorch then tried to set a meta storage on a flagos
    tensor). A C-ABI chip's tensors cannot be traced: the error says where to trace instead."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, ref = torch.randn(3, 4), torch.randn(3, 4)
    on_chip = x.to(dev)  # made before the mode: inside it, `.to()` itself makes a fake tensor

    def f(t):
        return (t.sin() @ t.T).softmax(-1)

    if not COMPILES:  # (this file imports Dynamo, which is when flagos refuses)
        with pytest.raises(RuntimeError, match="trace the model on the CPU"):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                mode.from_tensor(on_chip)
        return
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(on_chip[1:])
        out = fake @ fake.T
    assert fake.device == dev and fake.shape == (2, 4) and fake.stride() == (4, 1)
    assert out.shape == (2, 2) and out.device == dev
    graph = make_fx(f)(on_chip)
    assert_close(graph(ref.to(dev)).cpu(), f(ref))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.LayerNorm(4))
    on_flagos = copy.deepcopy(model).to(dev)
    exported = torch.export.export(on_flagos, (on_chip,))  # non-strict: fake parameters, no Dynamo
    assert_close(exported.module()(ref.to(dev)).cpu(), model(ref))


@pytest.mark.skipif(COMPILES, reason="only C-ABI chips refuse compilation")
def test_adapter_chip_fullgraph_names_the_reason(dev):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(Exception, match="C-ABI adapter chip"):
            torch.compile(lambda t: t * 2, fullgraph=True)(torch.ones(3, device=dev))


class LlamaBlock(torch.nn.Module):
    """One Llama decoder layer with its rotary embedding, as a model runs it: the positions
    are made on the input's device inside the graph."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        config._attn_implementation = "sdpa"
        self.rotary = LlamaRotaryEmbedding(config)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return self.layer(x, position_embeddings=self.rotary(x, positions))


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def test_llama_block_compiles_once_per_shape(dev):
    """A compiled Llama block matches plain PyTorch eager; a second call with new values is
    served by the same graph (no recompilation); a new sequence length compiles again and is
    right too; every call is counted; the outputs are flagos tensors that carry autograd
    (without it: test_report_counts_compiled_graph_calls)."""
    ref = LlamaBlock()
    compiled = torch.compile(copy.deepcopy(ref).to(dev))
    g = torch.Generator().manual_seed(1)
    x1, x2, x3 = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g), \
        torch.randn(2, 5, 32, generator=g)
    flagos.reset_report()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sim's eager-only notice
        out1 = compiled(x1.to(dev))
        graphs = graphs_compiled()
        out2 = compiled(x2.to(dev))
        assert graphs_compiled() == graphs and not counters["recompiles"]  # the same graph
        out3 = compiled(x3.to(dev))
    for out, x in ((out1, x1), (out2, x2), (out3, x3)):
        assert isinstance(out, flagos.FlagosTensor) and out.device == dev
        assert out.requires_grad  # the block's parameters require grad
        assert_close(out.detach().cpu(), ref(x).detach(), rtol=1e-5, atol=1e-5)
    assert_no_graph_break()
    if COMPILES:
        assert graphs_compiled() > graphs  # the new shape compiled its own graph
    assert flagos.fallback_report().compiled_calls == (3 if COMPILES else 0)


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_compiled_calls_do_not_ask_flagos_tensors_to_flatten(dev, monkeypatch):
    """Dynamo guards a tensor subclass by asking it for `__tensor_flatten__` twice per input on
    every call (in Python, from C++): for a flagos tensor the answer is a constant, and those
    guards are dropped. Other subclasses keep them (the check still runs for them)."""
    from torch.testing._internal.two_tensor import TwoTensor

    calls = {FlagosTensor: 0, TwoTensor: 0}

    def counting(cls):
        flatten = cls.__tensor_flatten__

        def counted(self):
            calls[cls] += 1
            return flatten(self)
        return counted

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(copy.deepcopy(ref).to(dev))
    x = torch.randn(5, 8)
    two = TwoTensor(x.clone(), x.clone())
    add = torch.compile(lambda t: t + 1)
    with torch.no_grad():
        compiled(x.to(dev))
        add(two)
        monkeypatch.setattr(FlagosTensor, "__tensor_flatten__", counting(FlagosTensor))
        monkeypatch.setattr(TwoTensor, "__tensor_flatten__", counting(TwoTensor))
        out = compiled(x.to(dev))
        add(two)
    assert calls[FlagosTensor] == 0
    assert calls[TwoTensor] > 0
    assert_close(out.cpu(), ref(x), rtol=1.3e-6, atol=1e-5)


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_guards_still_tell_flagos_and_plain_tensors_apart(dev):
    """The guards that stay check the input's type and its payload: a plain CPU tensor in place
    of a flagos one compiles its own graph (a plain output), and the flagos graph is kept."""
    def f(t):
        return t * 2 + 1

    compiled = torch.compile(f)
    x = torch.randn(4, 3)
    flagos.reset_report()
    out = compiled(x.to(dev))
    graphs = graphs_compiled()
    plain = compiled(x)
    assert graphs_compiled() == graphs + 1
    assert type(plain) is torch.Tensor and plain.device.type == "cpu"
    again = compiled(x.to(dev))
    assert graphs_compiled() == graphs + 1  # served by the first graph
    assert isinstance(again, flagos.FlagosTensor) and again.device == dev
    for result in (out, plain, again):
        assert_close(result.cpu(), f(x))
    assert flagos.fallback_report().compiled_calls == 2  # the flagos graph's calls only



@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_inputs_sharing_a_payload_are_still_seen(dev):
    """A flagos input that is not a parameter keeps its payload in Dynamo's no-aliasing guard:
    a call whose two inputs view one payload gives the eager result (`b` sees `a`'s update),
    after a call with distinct inputs compiled the function."""
    def f(a, b):
        a.add_(1)
        return b * 2

    compiled = torch.compile(f)
    x, y = torch.randn(6), torch.randn(6)
    fx, fy = x.to(dev), y.to(dev)
    assert_close(compiled(fx, fy).cpu(), f(x.clone(), y))
    shared = torch.randn(6)
    fs = shared.to(dev)
    out = compiled(fs, fs[:])
    ref = shared.clone()
    expected = f(ref, ref[:])  # b views a: a's update shows in b
    assert_close(out.cpu(), expected)
    assert_close(fs.cpu(), ref)
    assert_no_graph_break()


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_the_per_call_guards_left_out_are_the_payloads_marks_and_parameters_aliasing(dev):
    """What a compiled call checks of its flagos inputs, read from Dynamo's guard tree: a
    payload keeps its TENSOR_MATCH but not the dimension-mark check (nothing marks a payload), a
    parameter's payload is out of the no-aliasing check as a native parameter is, and an input's
    payload stays in it."""
    cache_entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if cache_entries is None:
        pytest.skip("this PyTorch has no _debug_get_cache_entry_list to read guards with")
    model = torch.nn.Linear(4, 3).to(dev)

    def f(x):
        return model(x) * 2

    torch.compile(f)(torch.randn(2, 4).to(dev))
    (entry,) = cache_entries(f.__code__)
    guards = str(entry.guard_manager).splitlines()
    payload_checks = [g for g in guards if "TENSOR_MATCH: check_tensor(" in g and "._payload" in g]
    assert len(payload_checks) == 3  # x, weight and bias: type, dtype, device, sizes, strides
    assert not [g for g in guards if "DIMENSION_DYNAMIC_MARKING_GUARD" in g and "._payload" in g]
    assert [g for g in guards if "DIMENSION_DYNAMIC_MARKING_GUARD" in g and "L['x']" in g]
    (aliasing,) = [g for g in guards if "check_no_aliasing(" in g]
    assert "L['x']._payload" in aliasing and "weight" not in aliasing and "bias" not in aliasing


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_marks_changed_payloads_and_mutated_parameters_are_seen(dev):
    """The guards left out per call (a parameter's no-aliasing check, a payload's dimension
    marks) miss nothing: a parameter updated in place gives the new result, a parameter whose
    payload is replaced by one of another shape recompiles, and `mark_dynamic` on a flagos input
    compiles a graph with a dynamic dimension that serves the next size."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    mod = copy.deepcopy(ref).to(dev)
    compiled = torch.compile(mod)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert_close(compiled(x.to(dev)).cpu(), ref(x))
        ref.weight.add_(0.5)
        mod.weight.add_(0.5)
        assert_close(compiled(x.to(dev)).cpu(), ref(x))
        graphs = graphs_compiled()
        ref.weight = torch.nn.Parameter(torch.randn(5, 4))
        ref.bias = torch.nn.Parameter(torch.randn(5))
        mod.weight.data = ref.weight.data.to(dev)
        mod.bias.data = ref.bias.data.to(dev)
        out = compiled(x.to(dev))
        assert out.shape == (2, 5) and graphs_compiled() > graphs
        assert_close(out.cpu(), ref(x))

    def g(t):
        return t.sin() * 2

    compiled_g = torch.compile(g)
    a = torch.randn(3, 4)
    assert_close(compiled_g(a.to(dev)).cpu(), g(a))
    graphs = graphs_compiled()
    b = torch.randn(5, 4)
    fb = b.to(dev)
    torch._dynamo.mark_dynamic(fb, 0)
    assert_close(compiled_g(fb).cpu(), g(b))
    assert graphs_compiled() == graphs + 1  # the mark was seen: a graph with a dynamic size
    c = torch.randn(7, 4)
    fc = c.to(dev)
    torch._dynamo.mark_dynamic(fc, 0)
    assert_close(compiled_g(fc).cpu(), g(c))
    assert graphs_compiled() == graphs + 1  # served by the dynamic graph
    assert_no_graph_break()

def test_reduce_overhead_mode(dev):
    """mode="reduce-overhead" asks for CUDA graphs; a CPU payload has none: Inductor skips
    them and the graph runs as in the default mode (on sim the function runs eagerly)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(copy.deepcopy(ref).to(dev), mode="reduce-overhead")
    x = torch.randn(5, 8)
    flagos.reset_report()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        outs = [compiled((x * i).to(dev)) for i in range(3)]
    for i, out in enumerate(outs):
        assert isinstance(out, flagos.FlagosTensor) and out.device == dev
        assert_close(out.cpu(), ref(x * i), rtol=1.3e-6, atol=1e-5)
    assert_no_graph_break()
    assert flagos.fallback_report().compiled_calls == (3 if COMPILES else 0)
    if COMPILES and reference_device().type == "cpu":  # Inductor said it skipped them, as
        assert counters["inductor"]["cudagraph_skips"] >= 1   # for a plain CPU graph


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
@pytest.mark.parametrize("grouped", [False, True], ids=["heads", "grouped_key_value_heads"])
def test_attention_compiles_to_the_ops_of_plain_pytorch(dev, grouped):
    """Attention as Llama calls it (causal, grouped key/value heads): the graph flagos hands
    Inductor holds the ops plain PyTorch's graph holds, the CPU's fused kernel included, not
    the math decomposition (a dozen more ops to compile and run)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=grouped)

    def ops_compiled(*inputs):
        seen = []

        def capture(gm, example_inputs):
            seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(attend, backend=aot_autograd(fw_compiler=capture))(*inputs)
        return sorted(seen), out

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g)
    k, v = (torch.randn(2, 2 if grouped else 4, 8, 16, generator=g) for _ in range(2))
    native_ops, expected = ops_compiled(q, k, v)
    flagos_ops, out = ops_compiled(q.to(dev), k.to(dev), v.to(dev))
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in native_ops
    assert flagos_ops == native_ops
    assert_close(out.cpu(), expected, rtol=0, atol=0)


@pytest.mark.skipif(not COMPILES, reason="the chip's tensors are not torch tensors: no compiled graphs")
def test_attention_over_a_length_known_only_at_run_time(dev):
    """A sequence length read from a tensor inside the graph (an unbacked size: no value while
    tracing) cannot ask the CPU's attention choice; the graph keeps the math decomposition and
    the result matches plain PyTorch eager."""
    def attend(q, k, v, n):
        m = n.item()
        torch._check(m >= 2)
        torch._check(m <= q.shape[2])
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, :m], k[:, :, :m], v[:, :, :m],
                                                                is_causal=True)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    n = torch.tensor(5)
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        expected = attend(q, k, v, n)
        out = torch.compile(attend, fullgraph=True)(q.to(dev), k.to(dev), v.to(dev), n.to(dev))
    assert out.shape == (1, 2, 5, 16)
    assert_close(out.cpu(), expected, rtol=1.3e-6, atol=1e-5)


@pytest.mark.skipif(not COMPILES, reason="C-ABI chips' tensors are not traced")
def test_a_tracer_fakes_a_flagos_tensor_from_its_own_storage(dev):
    """Dynamo fakes every input inside its tracing context, where `is_compiling()` still answers
    False on PyTorch 2.11: the wrapper must describe its own storage there, not its payload's
    (else PyTorch's meta converter takes the two for aliases and refuses the result)."""
    t = torch.randn(4, 4, device=dev)
    assert t.untyped_storage().data_ptr() == t._payload.untyped_storage().data_ptr()  # eager
    mode = FakeTensorMode()
    with tracing(TracingContext(mode)):
        assert t.untyped_storage().device == dev  # the wrapper's own
        fake = mode.from_tensor(t)
    assert isinstance(fake, FlagosTensor) and fake.device == dev and fake.shape == (4, 4)


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["flagos_first", "dynamo_first"])
def test_compiling_a_host_model_beside_flagos_matches_eager(dynamo_first):
    """A compilation over host tensors only, in a process where flagos is the accelerator: Dynamo
    asks torch.accelerator for the current stream in its guards, which flagos's Python answers;
    traced as frames of the model, those frames' own guards asked again without end
    (RecursionError from `torch.compile(model, dynamic=True)`). flagos's frames are skipped from
    the moment Dynamo loads, whichever comes first."""
    proc = run_python(f"""
import sys, warnings
import torch
if {dynamo_first}:
    import torch._dynamo
import flagos
flagos.activate("{CHIP}")
assert ("torch._dynamo" in sys.modules) == {dynamo_first}  # activation does not import Dynamo
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
compiled = torch.compile(model, dynamic=True)
for n in (2, 3, 5):
    x = torch.randn(n, 8)
    torch.testing.assert_close(compiled(x), model(x))
print("MATCHES EAGER")
""", env={"FLAGOS_FALLBACK": "allow"}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "MATCHES EAGER" in proc.stdout
