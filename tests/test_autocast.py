"""torch.autocast("flagos") follows the payload device's casting policy (CPU's on the cpu chip
and on sim, CUDA's on the cuda chip), so a mixed-precision step on flagos matches the same step
under that device's own autocast."""
import copy

import pytest
import torch
from conftest import CHIP, device_mode_only, runs_once

import flagos
from flagos.core._schema import op_overload
from flagos.runtime import _autocast
from flagos.runtime._autocast import payload_autocast_key

pytestmark = device_mode_only


def small_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 10), torch.nn.LogSoftmax(-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_forward_backward_matches_the_payload_devices_autocast(dev, ref, dtype):
    assert torch.amp.is_autocast_available("flagos")
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for device in (ref, dev):
        model = copy.deepcopy(small_cnn()).to(device)
        with torch.autocast(torch.device(device).type, dtype=dtype):
            out = model(x.to(device))
            square = torch.ones(3, 3, device=device) @ torch.ones(3, 3, device=device)
            joined = torch.cat([torch.ones(2, device=device, dtype=dtype), torch.ones(2, device=device)])
        out.float().sum().backward()
        results.append(dict(out=out.detach().cpu(), square=square.dtype, joined=joined.dtype,
                            conv_grad=model[0].weight.grad.cpu(), lin_grad=model[4].weight.grad.cpu()))
    ref, got = results
    assert got["out"].dtype == ref["out"].dtype
    assert got["square"] == ref["square"] == dtype          # matmul runs in the autocast dtype
    assert got["joined"] == ref["joined"] == torch.float32  # cat takes the widest type
    torch.testing.assert_close(got["out"], ref["out"], rtol=0, atol=0)
    assert got["conv_grad"].dtype == got["lin_grad"].dtype == torch.float32  # params stay fp32
    # The gradients are float32 but pass through float16/bfloat16 ops on the way, where a
    # chip's own kernels may round a sum one unit in the last place away from CPU's (seen on
    # sim: 1.5e-5 in a float16 conv gradient of 0.027, one float16 ulp): that dtype's tolerance.
    tol = {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]
    torch.testing.assert_close(got["conv_grad"], ref["conv_grad"], **tol)
    torch.testing.assert_close(got["lin_grad"], ref["lin_grad"], **tol)


def test_autocast_off_outside_the_region(dev):
    a = torch.ones(2, 2, device=dev)
    with torch.autocast("flagos", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with torch.autocast("flagos", enabled=False):
            assert (a @ a).dtype == torch.float32
    assert (a @ a).dtype == torch.float32


def test_grad_scaler_fp16_training_steps_match_plain_pytorch(dev, ref):
    torch.manual_seed(7)  # the same inputs whatever ran before in this process
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    params = []
    for device in (ref, dev):
        model = copy.deepcopy(small_cnn()).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0 ** 8)
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast(torch.device(device).type, dtype=torch.float16):
                loss = torch.nn.functional.nll_loss(model(x.to(device)), y.to(device))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        params.append([p.detach().cpu() for p in model.parameters()] + [torch.tensor(scaler.get_scale())])
    # A torch-native chip runs its device's kernels: equal. A C-ABI chip's float16 convolution
    # (sim, opencl) rounds otherwise than oneDNN's, so a weight gradient may differ by a float16
    # ulp, which the learning rate turns into up to ~1.2e-5 after three steps (seen over many
    # inputs).
    tol = 1e-5 if CHIP == "cpu" or ref.type != "cpu" else 5e-5
    for got, ref in zip(params[1], params[0]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_policy_ops_upcast_both_low_precision_dtypes(dev, ref, dtype):
    """mse_loss and prod are on the float32 list of CPU's and CUDA's autocast: inputs in
    float16 *or* bfloat16 run in float32, as under the payload device's autocast."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 5).to(dtype), torch.randn(6, 5).to(dtype)
    results = []
    for device in (ref, dev):
        with torch.autocast(torch.device(device).type, dtype=dtype):
            loss = torch.nn.functional.mse_loss(a.to(device), b.to(device))
            product = torch.prod(a.to(device)[0])
        results.append((loss.cpu(), product.cpu()))
    (ref_loss, ref_product), (loss, product) = results
    assert ref_loss.dtype == ref_product.dtype == torch.float32  # what plain autocast does
    assert loss.dtype == product.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(product, ref_product, rtol=1.3e-6, atol=1e-5)


@runs_once
def test_each_chip_follows_the_casting_policy_of_its_payload_device():
    """The policy a chip's flagos tensors follow under autocast is that of the device their
    payloads live on: PyTorch's own accelerators keep theirs, a host payload or a C-ABI chip's
    buffer follows the CPU's."""
    expected = {"cpu": "AutocastCPU", "sim": "AutocastCPU", "opencl": "AutocastCPU",
                "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"}
    assert {chip: payload_autocast_key(flagos.chips.profile(chip)) for chip in expected} == expected


def test_widest_type_ops_cast_as_the_payload_devices_autocast_does(dev, ref):
    """The ops autocast runs in the widest input type: a float32 tensor takes float16 rows
    where the payload device's policy widens index_copy (CPU's does; CUDA's does not, and
    index_copy refuses mixed types there as on plain CUDA), an integer index does not count as
    a type to widen to, and float64 is left out of autocast."""
    def outcome(fn):
        try:
            return fn().cpu()
        except RuntimeError as e:
            return type(e), str(e)

    def run(device):
        idx = torch.tensor([0, 2], device=device)
        half = torch.arange(4.0).reshape(2, 2).half().to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.float16):
            return [outcome(fn) for fn in (
                lambda: torch.zeros(3, 2, device=device).index_copy(0, idx, half),
                lambda: torch.zeros(3, 2, device=device, dtype=torch.float16).index_copy(0, idx, half),
                lambda: torch.cat([torch.ones(2, device=device, dtype=torch.float64), torch.ones(2, device=device)]),
                lambda: torch.stack([torch.ones(2, device=device, dtype=torch.float64), half[0]]))]

    expected = run(ref)
    if ref.type == "cpu":   # CPU autocast widens index_copy: no error anywhere
        assert all(isinstance(e, torch.Tensor) for e in expected), expected
    for got, plain in zip(run(dev), expected):
        if not isinstance(plain, torch.Tensor):
            assert got == plain
            continue
        assert got.dtype == plain.dtype
        torch.testing.assert_close(got, plain, rtol=0, atol=0)


@runs_once
def test_op_names_resolve_to_their_overload_and_an_unknown_one_is_skipped():
    """The dispatcher's op names map to torch.ops overloads ("aten::relu" is relu's default); a
    name torch.ops cannot resolve (an op a newer PyTorch lists under another name) is skipped at
    activation, not an error."""
    assert op_overload("aten::relu") is torch.ops.aten.relu.default
    assert op_overload("aten::add.Tensor") is torch.ops.aten.add.Tensor
    assert op_overload("aten::flagos_no_such_op") is None
    assert op_overload("aten::add.flagos_no_such_overload") is None
    assert op_overload("flagos_no_such_namespace::op") is None
    assert _autocast._packet("aten::cat.names") == _autocast._packet("aten::cat") == "aten::cat"


def _lstm_under_bfloat16_autocast(device, layer, kwargs, x, whole_in_bfloat16=False):
    """(out, h, c, the first layer's input-weight gradient) of an LSTM under bfloat16
    autocast on device; whole_in_bfloat16: the layer run in bfloat16 without autocast instead,
    the gradient as float32 (the dtype of autocast's float32 parameters)."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(x.shape[-1], 3, **kwargs).to(device)
    inputs = x.to(device)
    if whole_in_bfloat16:
        lstm, inputs = lstm.bfloat16(), inputs.bfloat16()
    if layer == "packed":
        inputs = torch.nn.utils.rnn.pack_padded_sequence(inputs, torch.tensor([5, 3]))
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=not whole_in_bfloat16):
        out, (h, c) = lstm(inputs)
    out = out.data if layer == "packed" else out
    out.float().sum().backward()
    return [t.detach().cpu() for t in (out, h, c, lstm.weight_ih_l0.grad.float() if whole_in_bfloat16
                                       else lstm.weight_ih_l0.grad)]


@pytest.mark.parametrize("layer", ["plain", "projections", "bidirectional, 2 layers", "packed",
                                   "empty batch", "one value"])
def test_lstm_under_bfloat16_autocast_matches_the_payload_devices_autocast(dev, ref, layer):
    """The CPU runs nn.LSTM through oneDNN's layer, which it autocasts: the output and states
    come out bfloat16 (with projections, or packed, not: the CPU's own path). flagos runs the
    layer through the fused cells PyTorch picks for other devices, and gave float32.
    On a processor without oneDNN's bfloat16 (AVX2 only) plain CPU raises there instead
    (docs/design.md, "PyTorch limits"); flagos still runs the layer in bfloat16, and the
    reference is the layer computed in bfloat16. An empty input never takes oneDNN's layer;
    a single value does."""
    kwargs = {"projections": {"proj_size": 2},
              "bidirectional, 2 layers": {"bidirectional": True, "num_layers": 2, "batch_first": True}}.get(layer, {})
    shape = {"empty batch": (5, 0, 4), "one value": (1, 1, 1)}.get(layer, (5, 2, 4))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    try:
        want = _lstm_under_bfloat16_autocast(ref, layer, kwargs, x)
    except RuntimeError as e:
        if torch.ops.mkldnn._is_mkldnn_bf16_supported() or "LSTM forward propagation primitive" not in str(e):
            raise
        want = _lstm_under_bfloat16_autocast(ref, layer, kwargs, x, whole_in_bfloat16=True)
    got = _lstm_under_bfloat16_autocast(dev, layer, kwargs, x)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1.6e-2)
