"""The precision policy: supports_dtype/preferred_dtype, and dtype_policy="downcast", which runs
bfloat16 work in float16 on a chip whose bfloat16 is not native (sim), and changes nothing on a
chip where it is (cpu). The sim tests run in the sim run of the suite (FLAGOS_TEST_CHIP=sim,
scripts/test.sh's CHIP_TESTS)."""
import warnings

import numpy as np
import pytest
import torch
from conftest import CHIP, device_mode_only, run_python, runs_once

import flagos
import flagos.report._html

pytestmark = device_mode_only

on_sim = pytest.mark.skipif(CHIP != "sim", reason="bfloat16 is native on cpu: runs in the sim run")
on_cpu = pytest.mark.skipif(CHIP != "cpu", reason="the cpu chip's bfloat16 is native: runs in the cpu run")

# The DDPM pipeline made float16 by the downcast against the same pipeline made float16 on the
# CPU: the weights are the same numbers, only the kernels differ (sim's float16 kernels against
# PyTorch's CPU ones). 4e-3 is 4 float16 ulps at 1.0; measured: 9.8e-4 (one ulp).
DDPM_ATOL = 4e-3


@pytest.fixture
def downcast():
    """dtype_policy="downcast" for one test; strict again after it, whatever happens."""
    flagos.activate(CHIP, dtype_policy="downcast")
    flagos.reset_report()
    try:
        yield
    finally:
        flagos.activate(CHIP, dtype_policy="strict")


def downcast_warnings(record):
    return [w for w in record if issubclass(w.category, flagos.DowncastWarning)]


def bf16_fallbacks(report):
    return [r["op"] for r in report.rows if r["calls"]["fallback"] and "torch.bfloat16" in r["dtypes"]]


# ---- what the chip runs natively ------------------------------------------------------------

def test_supports_dtype_and_preferred_dtype_follow_the_chip():
    native = flagos.info()["native_dtypes"]
    assert flagos.supports_dtype(torch.float32) and flagos.supports_dtype("float32")
    assert flagos.supports_dtype(torch.bfloat16) == ("bfloat16" in native)
    assert flagos.supports_dtype(torch.float16) == ("float16" in native)
    # opencl: float16 where the device has cl_khr_fp16 (PoCL's CPU device has not); a
    # torch-native accelerator: bfloat16 where its devices have it (cuda from Ampere on)
    opencl = torch.float16 if "float16" in native else torch.float32
    accelerator = torch.bfloat16 if "bfloat16" in native else torch.float16
    expected = {"cpu": torch.bfloat16, "sim": torch.float16, "opencl": opencl}.get(CHIP, accelerator)
    assert flagos.preferred_dtype() == expected
    if CHIP in ("cpu", "sim"):
        assert flagos.supports_dtype(torch.bfloat16) == (CHIP == "cpu")  # sim's bf16 is not native
    with pytest.raises(flagos.ConfigError, match="not a torch dtype"):
        flagos.supports_dtype("bf17")


@runs_once
def test_sim_without_native_float16_prefers_and_downcasts_to_float32():
    proc = run_python("""
        import warnings, torch, flagos
        flagos.activate("sim", dtype_policy="downcast")
        assert not flagos.supports_dtype(torch.float16) and flagos.preferred_dtype() == torch.float32
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            x = torch.ones(3, device=flagos.device()).to(torch.bfloat16)
        assert x.dtype == torch.float32, x.dtype
        print([str(w.message) for w in record])
        print(flagos.info()["downcast_to"])
    """, env={"FLAGOS_SIM_DTYPES": "float32", "FLAGOS_FALLBACK": "allow"})
    assert "running bfloat16 work in float32" in proc.stdout
    assert proc.stdout.strip().endswith("float32")


# ---- strict (the default) ---------------------------------------------------------------------

def test_strict_is_the_default_and_keeps_bfloat16(dev):
    assert flagos.info()["dtype_policy"] == "strict" and flagos.info()["downcast_to"] is None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        x = torch.randn(4, 4, device=dev).to(torch.bfloat16)
        z = torch.zeros(3, dtype=torch.bfloat16, device=dev)
        m = torch.nn.Linear(4, 4).to(dev, dtype=torch.bfloat16)
    assert x.dtype == z.dtype == m.weight.dtype == torch.bfloat16
    assert not downcast_warnings(record)
    report = flagos.fallback_report()
    assert report.downcast_calls == report.downcast_bytes == 0 and report.downcast_to is None
    assert "downcast" not in str(report)


# ---- the cpu chip: bfloat16 is native, downcast changes nothing --------------------------------

@on_cpu
def test_downcast_is_a_no_op_where_bfloat16_is_native(dev, downcast):
    assert flagos.info()["dtype_policy"] == "downcast" and flagos.info()["downcast_to"] is None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        x = torch.randn(4, 4, device=dev).to(torch.bfloat16)
        z = torch.zeros(3, dtype=torch.bfloat16, device=dev)
        with torch.autocast("flagos", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(torch.randn(2, 4, device=dev), torch.randn(4, 4, device=dev))
    assert x.dtype == z.dtype == y.dtype == torch.bfloat16
    assert not downcast_warnings(record)
    assert flagos.fallback_report().to_dict()["totals"]["downcast_calls"] == 0


# ---- sim: bfloat16 is not native, downcast runs it in float16 ---------------------------------

@on_sim
def test_downcast_conversions_factories_and_autocast_run_in_float16(dev, downcast):
    torch.manual_seed(0)
    host = torch.randn(8, 16)
    x = host.to(dev)
    flagos.reset_report()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        converted = x.to(torch.bfloat16)                               # _to_copy: 8*16*2 bytes
        also = x.bfloat16()                                            # _to_copy: 256
        zeros = torch.zeros(5, dtype=torch.bfloat16, device=dev)       # empty: 10
        full = torch.full((2, 3), 1.5, dtype=torch.bfloat16, device=dev)  # empty (full = empty + fill_): 12
        moved = host.bfloat16().to(dev)                                # empty_strided: 256
        to_host = x.to("cpu", torch.bfloat16)                          # another device: left alone
        lin = torch.nn.Linear(16, 4)
        lin_ref = torch.nn.Linear(16, 4)
        lin_ref.load_state_dict(lin.state_dict())
        lin.to(dev, dtype=torch.bfloat16)                              # weight 128, bias 8
        with torch.autocast("flagos", dtype=torch.bfloat16):
            out = torch.nn.functional.linear(x, x[:4])                 # casts x (256) and x[:4] (128)
    assert len(downcast_warnings(record)) == 1, [str(w.message) for w in record]
    message = str(downcast_warnings(record)[0].message)
    assert message.startswith("bfloat16 is not native on sim: running bfloat16 work in float16")
    for t in (converted, also, zeros, full, moved, lin.weight, lin.bias, out):
        assert t.dtype == torch.float16 and t.device.type == "flagos"
    assert to_host.dtype == torch.bfloat16 and to_host.device.type == "cpu"
    # the values are the float32 ones rounded once, to float16 (not through bfloat16)
    assert torch.equal(converted.cpu(), host.half()) and torch.equal(moved.cpu(), host.bfloat16().half())
    assert torch.equal(full.cpu(), torch.full((2, 3), 1.5, dtype=torch.float16))
    assert torch.equal(lin.weight.cpu(), lin_ref.weight.detach().half())
    torch.testing.assert_close(out.cpu(), torch.nn.functional.linear(host.half(), host[:4].half()),
                               atol=1e-2, rtol=1e-3)
    report = flagos.fallback_report()
    assert not bf16_fallbacks(report)
    calls = {r["op"]: r["downcast_calls"] for r in report.rows if r["downcast_calls"]}
    assert calls == {"aten::_to_copy": 4, "aten::empty.memory_format": 2, "aten::empty_strided": 3}
    assert report.downcast_calls == 9
    assert report.downcast_bytes == 256 + 256 + 10 + 12 + 256 + 128 + 8 + 256 + 128
    totals = report.to_dict()["totals"]
    assert (totals["downcast_calls"], totals["downcast_bytes"]) == (9, report.downcast_bytes)
    assert report.to_dict()["downcast_to"] == "float16"
    assert "9 calls made float16 instead of bfloat16" in str(report)
    page = flagos.report._html.render(report.to_dict())
    assert f"9 calls made float16 instead of bfloat16, {report.downcast_bytes / 1e6:.3f} MB" in page
    flagos.reset_report()
    assert flagos.fallback_report().downcast_calls == flagos.fallback_report().downcast_bytes == 0
    with flagos.track() as scope:
        torch.ones(4, dtype=torch.bfloat16, device=dev)
    assert (scope.downcast_calls, scope.downcast_bytes) == (1, 8)


@on_sim
def test_downcast_rewrites_the_dtype_argument_of_a_reduction(dev, downcast):
    """sum(dtype=torch.bfloat16) asks for its result's dtype by keyword: under the downcast it
    runs and returns float16 on the chip, as the factories do, never bfloat16 on the fallback."""
    torch.manual_seed(0)
    host = torch.randn(8, 16)
    x = host.to(dev)
    flagos.reset_report()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flagos.DowncastWarning)
        total, rows = x.sum(dtype=torch.bfloat16), x.sum(1, dtype=torch.bfloat16)
    assert total.dtype == rows.dtype == torch.float16
    torch.testing.assert_close(total.cpu(), host.sum(dtype=torch.float16), atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(rows.cpu(), host.sum(1, dtype=torch.float16), atol=5e-2, rtol=1e-2)
    assert not bf16_fallbacks(flagos.fallback_report())


@on_sim
def test_switching_back_to_strict_restores_bfloat16(dev, downcast):
    x = torch.ones(4, device=dev)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert x.to(torch.bfloat16).dtype == torch.float16
        flagos.activate(CHIP)                                   # no policy named: it stays
        assert x.to(torch.bfloat16).dtype == torch.float16
        flagos.activate(CHIP, dtype_policy="strict")
        assert flagos.info()["dtype_policy"] == "strict"
        assert x.to(torch.bfloat16).dtype == torch.bfloat16
        assert torch.zeros(2, dtype=torch.bfloat16, device=dev).dtype == torch.bfloat16
        flagos.activate(CHIP, dtype_policy="downcast")          # on again: said again, once
        assert x.to(torch.bfloat16).dtype == torch.float16
        assert x.to(torch.bfloat16).dtype == torch.float16
    assert len(downcast_warnings(record)) == 2
    assert flagos.fallback_report().downcast_calls == 4


@on_sim
def test_ddpm_pipeline_in_bfloat16_under_downcast_matches_the_float16_cpu_run(dev, downcast):
    pytest.importorskip("diffusers")
    import models

    reference = models.run_ddpm(models.ddpm_pipeline().to(torch.float16))
    flagos.reset_report()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pipe = models.ddpm_pipeline().to(dev, torch.bfloat16)
        images = models.run_ddpm(pipe)
    assert len(downcast_warnings(record)) == 1
    tensors = [t for t in (*pipe.unet.parameters(), *pipe.unet.buffers()) if t.is_floating_point()]
    assert {t.dtype for t in tensors} == {torch.float16} and pipe.dtype == torch.float16
    report = flagos.fallback_report()
    assert report.rows and not bf16_fallbacks(report), bf16_fallbacks(report)
    # every floating-point weight was made float16 as it came to the device, and nothing else
    assert report.downcast_calls == len(tensors) > 0
    assert report.downcast_bytes == sum(t.numel() * 2 for t in tensors)
    np.testing.assert_allclose(images, reference, atol=DDPM_ATOL, rtol=0)


@on_sim
def test_from_pretrained_in_bfloat16_lands_in_float16(dev, downcast, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    import models

    models.ddpm_pipeline().save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flagos.DowncastWarning)
        warnings.simplefilter("ignore", FutureWarning)  # newer diffusers name it `dtype`
        on_host = diffusers.DDPMPipeline.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
        expected = {k: v.half() for k, v in on_host.unet.state_dict().items()}
        pipe = diffusers.DDPMPipeline.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).to(dev)
    got = pipe.unet.state_dict()
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert value.dtype == torch.float16 and torch.equal(value.cpu(), expected[name]), name


# ---- bad values ---------------------------------------------------------------------------------

def test_a_bad_dtype_policy_is_a_config_error_and_changes_nothing(dev):
    with pytest.raises(flagos.ConfigError, match=r"dtype_policy='fast' is not valid; use one of: strict, downcast"):
        flagos.activate(CHIP, dtype_policy="fast")
    assert flagos.info()["dtype_policy"] == "strict"
    assert torch.ones(2, device=dev).to(torch.bfloat16).dtype == torch.bfloat16


def test_the_policy_is_read_as_typed_whatever_its_case_and_spaces(dev):
    try:
        assert flagos.activate(CHIP, dtype_policy=" Downcast ")["dtype_policy"] == "downcast"
        assert flagos.info()["dtype_policy"] == "downcast"
    finally:
        flagos.activate(CHIP, dtype_policy="STRICT")
    assert flagos.info()["dtype_policy"] == "strict"


@runs_once
def test_dtype_policy_from_the_environment():
    bad = run_python("""
        import flagos
        try:
            flagos.activate("sim")
        except flagos.ConfigError as e:
            print("ConfigError:", e)
        print(flagos.info()["active"])
    """, env={"FLAGOS_DTYPE_POLICY": "foo"})
    assert "ConfigError: FLAGOS_DTYPE_POLICY='foo' is not valid; use one of: strict, downcast" in bad.stdout
    assert bad.stdout.strip().endswith("False")  # nothing was activated
    good = run_python("""
        import torch, flagos
        flagos.activate("sim")
        print(flagos.info()["dtype_policy"], torch.ones(2, device="flagos").to(torch.bfloat16).dtype)
    """, env={"FLAGOS_DTYPE_POLICY": "Downcast", "FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_DEVICES": "1"})
    assert good.stdout.strip().endswith("downcast torch.float16")  # on a machine with one card


@runs_once
def test_downcast_in_native_mode_on_a_chip_without_native_bfloat16_is_refused():
    proc = run_python("""
        import torch, flagos
        cpu = flagos.chips.profile("cpu")
        cpu.native_dtypes = tuple(d for d in cpu.native_dtypes if d != "bfloat16")
        try:
            flagos.activate("cpu", mode="native", dtype_policy="downcast")
        except flagos.ConfigError as e:
            print("ConfigError:", e)
        print(flagos.info()["active"])
        flagos.activate("cpu", mode="native")
        print(flagos.info()["dtype_policy"], flagos.preferred_dtype())
    """)
    assert "ConfigError: dtype_policy='downcast' works in device mode" in proc.stdout
    assert "Use mode='device'" in proc.stdout
    assert proc.stdout.strip().endswith("False\nstrict torch.float16")
