"""The opencl chip (backends/opencl) on this machine's OpenCL devices (PoCL's CPU device in CI),
against plain PyTorch on CPU with the same seed.

The cpu run starts one pytest process on opencl for this file and for test_sim_kernels.py,
whose kernel cases (every op of the kernel table, contiguous, transposed, offset, broadcast,
expanded, 0-dim and empty, extreme values) run on whichever C-ABI chip the process has, with
FLAGOS_OPENCL_FP16=on so that the float16 kernels run on a device without cl_khr_fp16 too;
bfloat16, which the chip does not have, is skipped there with the reason. Skipped with a reason when the adapter was not built or no OpenCL device exists.
"""
import json
import os
import re

import models
import pytest
import torch
from conftest import CHIP, assert_close, device_mode_only, run_pytest, run_python
from torch.utils.dlpack import to_dlpack

import flagos

OPENCL = flagos.chips.profile("opencl")
AVAILABLE = OPENCL.detect()
WHY = "" if AVAILABLE else OPENCL.why_unavailable()
pytestmark = [device_mode_only,
              pytest.mark.skipif(not AVAILABLE, reason=f"no opencl chip here: {WHY}")]
on_opencl = pytest.mark.skipif(CHIP != "opencl", reason="runs in the opencl process (below)")
# Tests that start processes of their own run once, from the cpu run.
from_cpu = pytest.mark.skipif(CHIP != "cpu", reason="starts its own processes: runs in the cpu run")
HERE = os.path.dirname(os.path.abspath(__file__))


@from_cpu
def test_opencl_in_an_opencl_process(tmp_path):
    # float16 native even without cl_khr_fp16 (PoCL): the half kernels are tested too
    proc = run_pytest([__file__, os.path.join(HERE, "test_sim_kernels.py")],
                      env={"FLAGOS_TEST_CHIP": "opencl", "FLAGOS_CACHE_DIR": str(tmp_path),
                           "FLAGOS_OPENCL_FP16": "on"})
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    assert re.fullmatch(r"\d+ passed(, \d+ skipped)? in .*", summary), summary
    assert int(summary.split()[0]) > 600, summary  # float32 and float16 cases ran


# ---- the device ------------------------------------------------------------------------

@on_opencl
def test_device_names_platform_and_driver():
    info = [d for d in flagos.list_devices() if d.chip == "opencl"]
    assert info and all(re.fullmatch(r".+ \(.+, driver .+\)", d.name) for d in info), info
    assert "float32" in info[0].native_dtypes
    assert OPENCL.total_memory(0) > 0


@on_opencl
def test_memory_statistics_are_exact(dev):
    m = torch.flagos
    m.synchronize()
    m.empty_cache()
    base, reserved = m.memory_allocated(), m.memory_reserved()
    assert reserved == base  # nothing cached after empty_cache
    m.reset_peak_memory_stats()
    a = torch.empty(1000, device=dev)           # 4000 bytes: the 4096-byte size class
    b = torch.empty(3 * 2**20 + 5, device=dev)  # 1 MiB steps above 1 MiB
    big = 4 * (3 * 2**20 + 5)
    big_class = -(-big // 2**20) * 2**20
    assert m.memory_allocated() == base + 4096 + big_class
    assert m.max_memory_allocated() == base + 4096 + big_class
    del b
    assert m.memory_allocated() == base + 4096
    assert m.memory_reserved() == base + 4096 + big_class  # kept for reuse
    c = torch.empty(3 * 2**20 + 100, device=dev)  # same class: the cached buffer comes back
    assert m.memory_reserved() == base + 4096 + big_class
    del a, c
    free, total = m.mem_get_info()
    assert total == OPENCL.total_memory(0) and free == total - m.memory_reserved()
    m.empty_cache()
    assert m.memory_allocated() == base and m.memory_reserved() == base
    assert m.max_memory_allocated() == base + 4096 + big_class
    m.reset_peak_memory_stats()  # the peak comes down to what is allocated now
    assert m.max_memory_allocated() == base


@on_opencl
def test_out_of_memory_raises_and_the_next_allocation_works(dev):
    total = OPENCL.total_memory(0)
    with pytest.raises(torch.OutOfMemoryError, match="opencl"):
        torch.empty(total // 4 + 1024, device=dev)  # float32: more than the device holds
    x = torch.arange(6.0).to(dev)
    assert torch.equal((x * 2).cpu(), torch.arange(6.0) * 2)


@on_opencl
def test_streams_and_events_order_work(dev):
    torch.manual_seed(0)
    a = torch.randn(64, 64)
    x = a.to(dev)
    s = torch.flagos.Stream()
    start, end = torch.flagos.Event(enable_timing=True), torch.flagos.Event(enable_timing=True)
    done = torch.flagos.Event()
    start.record()
    y = x @ x
    done.record()
    s.wait_event(done)
    with torch.flagos.stream(s):
        z = torch.relu(y) + 1   # on s, after y (the wait)
    end.record(s)
    end.synchronize()
    assert end.query() and s.query()
    assert start.elapsed_time(end) >= 0
    assert_close(z, torch.relu(a @ a) + 1, atol=1e-4)


# ---- errors and the program cache ---------------------------------------------------------

@from_cpu
def test_bad_opencl_devices_value_is_a_clear_error():
    for value, words in (("bogus", "is not valid"), ("99", "is not valid"), ("0,0", "is not valid")):
        proc = run_python("import flagos; flagos.activate('opencl')", check=False,
                          env={"FLAGOS_OPENCL_DEVICES": value})
        assert proc.returncode != 0
        assert f"FLAGOS_OPENCL_DEVICES='{value}' {words}" in proc.stderr, proc.stderr[-2000:]
        assert "Segmentation" not in proc.stderr and "Traceback" in proc.stderr


@from_cpu
def test_no_opencl_device_is_one_clear_line(tmp_path):
    """No OpenCL driver (the ICD loader finds no platform: an empty OCL_ICD_VENDORS folder):
    FLAGOS_DEVICE=opencl stops `import torch` with the fix; auto and diagnose move on."""
    env = {"OCL_ICD_VENDORS": str(tmp_path)}
    proc = run_python("import torch", check=False, env={**env, "FLAGOS_DEVICE": "opencl"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "found no device" in proc.stderr and "pocl-opencl-icd" in proc.stderr, proc.stderr
    proc = run_python("""
        import flagos
        print(flagos.chips.profile('opencl').detect(), flagos.activate('auto')['chip'])
    """, env=env)
    assert proc.stdout.split()[-2:] == ["False", "cpu"], proc.stdout


@from_cpu
def test_bad_fp16_value_is_a_clear_error():
    proc = run_python("import flagos; flagos.activate('opencl')", check=False,
                      env={"FLAGOS_OPENCL_FP16": "yes"})
    assert "FLAGOS_OPENCL_FP16='yes' is not valid; use auto" in proc.stderr, proc.stderr[-2000:]


@from_cpu
def test_visible_devices_pick_among_the_opencl_devices_as_sim_honours_them():
    """FLAGOS_VISIBLE_DEVICES picks among the devices FLAGOS_OPENCL_DEVICES chose: an index
    that exists is flagos:0; a repeated index or one past them is a clear error."""
    code = "import torch, flagos; flagos.activate('opencl'); print(torch.flagos.device_count())"
    env = {"FLAGOS_OPENCL_DEVICES": "0"}
    assert run_python(code, env={**env, "FLAGOS_VISIBLE_DEVICES": "0"}).stdout.split()[-1] == "1"
    for value in ("0,0", "1", "0,x"):
        proc = run_python(code, check=False, env={**env, "FLAGOS_VISIBLE_DEVICES": value})
        assert proc.returncode != 0
        assert f"FLAGOS_VISIBLE_DEVICES='{value}' is not valid for opencl" in proc.stderr, proc.stderr[-2000:]
        assert "Segmentation" not in proc.stderr


@from_cpu
def test_opencl_devices_all_and_an_index_are_accepted():
    code = "import torch, flagos; flagos.activate('opencl'); print(torch.flagos.device_count())"
    every = int(run_python(code, env={"FLAGOS_OPENCL_DEVICES": "all"}).stdout.split()[-1])
    assert every >= 1
    assert run_python(code, env={"FLAGOS_OPENCL_DEVICES": "0"}).stdout.split()[-1] == "1"


@from_cpu
def test_auto_does_not_pick_an_opencl_cpu_device():
    proc = run_python("""
        import flagos
        chip = flagos.chips.profile('opencl')
        cpu_only = all(chip.device_type(i) & 2 for i in range(chip.device_count()))
        flagos.activate('auto')
        print(cpu_only, flagos.info()['chip'])
    """)
    cpu_only, picked = proc.stdout.split()[-2:]
    if cpu_only == "True":
        assert picked == "cpu"
    else:
        assert picked in ("cuda", "xpu", "mps", "opencl")


PROGRAM_STATS = """
    import torch, flagos
    flagos.activate('opencl')
    x = torch.arange(8.0).to(flagos.device())
    assert torch.equal((x * 3).cpu(), torch.arange(8.0) * 3)
    import json
    print(json.dumps(flagos.chips.profile('opencl').program_stats()))
"""


def _stats(env):
    return json.loads(run_python(PROGRAM_STATS, env=env).stdout.strip().splitlines()[-1])


@from_cpu
def test_program_cache_is_used_by_the_next_process_and_a_corrupt_file_is_rebuilt(tmp_path):
    env = {"FLAGOS_CACHE_DIR": str(tmp_path)}
    first = _stats(env)
    assert first == {"from_cache": 0, "built": 1, "written": 1}, first
    files = list((tmp_path / "opencl").glob("*.bin"))
    assert len(files) == 1
    assert _stats(env) == {"from_cache": 1, "built": 0, "written": 0}
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: the checksum no longer matches
    files[0].write_bytes(bytes(data))
    assert _stats(env) == {"from_cache": 0, "built": 1, "written": 1}
    files[0].write_bytes(files[0].read_bytes()[:100])  # a truncated file
    assert _stats(env) == {"from_cache": 0, "built": 1, "written": 1}
    assert _stats(env) == {"from_cache": 1, "built": 0, "written": 0}


@from_cpu
def test_unwritable_cache_folder_is_no_cache(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert _stats({"FLAGOS_CACHE_DIR": str(blocked)}) == {"from_cache": 0, "built": 1, "written": 0}


# ---- the table's ops run on the chip ------------------------------------------------------

@from_cpu
def test_the_adapter_broadcasts_an_operand_of_fewer_dims_and_refuses_mixed_dtypes_in_cat():
    """The ABI directly (flagos itself describes every operand at the output's rank, sends
    a kernel one dtype and a device that exists, so only another caller of the adapter meets
    these): an operand of fewer dims broadcasts from the right, as in PyTorch; cat refuses
    inputs of mixed dtypes; every kernel refuses a device the adapter does not have."""
    adapter = OPENCL.adapter
    index = {name: i for i, (name, _) in enumerate(adapter.kernels())}
    codes = {torch.float32: 0, torch.float16: 1}  # the ABI's dtype codes

    def on_device(t):
        buffer = adapter.alloc_tensor(0, tuple(t.shape), None, t.element_size())
        buffer.write(to_dlpack(t.contiguous()), 0)
        return (buffer, 0, codes[t.dtype], tuple(t.shape), torch.empty(t.shape).stride()), buffer

    x, y = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([10.0, 20.0, 30.0])
    (dx, _), (dy, _), (dout, out_buffer) = on_device(x), on_device(y), on_device(torch.zeros(2, 3))
    adapter.run_kernel(index["aten::add.Tensor"], 0, [dx, dy], [dout], (1.0,), ())
    adapter.synchronize(0)
    out = torch.empty(2, 3)
    out_buffer.read(to_dlpack(out), 0)
    assert torch.equal(out, x + y)
    (single, _), (half, _), (joined, _) = (on_device(torch.ones(2, 2)), on_device(torch.ones(2, 2).half()),
                                           on_device(torch.zeros(4, 2)))
    with pytest.raises(NotImplementedError, match="aten::cat: mixed dtypes"):
        adapter.run_kernel(index["aten::cat"], 0, [single, half], [joined], (), (0,))
    count = len(flagos.list_devices("opencl"))
    for op, ints in [("aten::cat", (0,)), ("aten::neg", ())]:   # a device that does not exist
        for device in (count, -1):
            with pytest.raises(flagos.DeviceError, match=rf"opencl device {device} does not exist"):
                adapter.run_kernel(index[op], device, [single], [single], (), ints)


def _native(report, op):
    row = report.op(op)
    return row is not None and row["calls"]["native"] > 0 and row["calls"]["fallback"] == 0


@on_opencl
def test_copies_on_the_device_match_cpu(dev):
    """Copies between chip tensors stay on the device (clEnqueueCopyBuffer); between dense
    views of one buffer that overlap in part PyTorch's error is raised, as on CPU; between
    overlapping views PyTorch cannot tell apart (gapped ones), which OpenCL's copy refuses,
    the copy goes through the host, reading the source before writing."""
    x = torch.arange(24, dtype=torch.float32)
    fx = x.to(dev)
    assert torch.equal(fx.clone().cpu(), x)
    into = torch.zeros(24, device=dev)
    into[4:12].copy_(fx[:8])
    assert torch.equal(into.cpu(), torch.cat([torch.zeros(4), x[:8], torch.zeros(12)]))
    shifted, fshifted = x.clone(), fx.clone()
    with pytest.raises(RuntimeError) as on_cpu:
        shifted[1:13].copy_(shifted[:12])
    with pytest.raises(RuntimeError, match=re.escape(str(on_cpu.value))):
        fshifted[1:13].copy_(fshifted[:12])  # dense, overlapping in part: refused
    grid, fgrid = x.clone().view(4, 6), fx.clone().view(4, 6)
    grid[1:, :3].copy_(grid[:3, 1:4].clone())
    fgrid[1:, :3].copy_(fgrid[:3, 1:4])  # gapped views overlapping: through the host
    assert torch.equal(fgrid.cpu(), grid)
    if torch.flagos.device_count() > 1:  # another device of the chip: through the host
        assert torch.equal(fx.to("flagos:1").cpu(), x)


@on_opencl
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_float32_and_float64_ops_run_on_the_chip(dev, dtype):
    if str(dtype).split(".")[1] not in flagos.info()["native_dtypes"]:
        pytest.skip(f"{dtype} is not native on this OpenCL device")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, generator=g, dtype=dtype)
    b = torch.randn(7, 3, generator=g, dtype=dtype)
    c = torch.randn(3, generator=g, dtype=dtype)
    w, bias = torch.randn(7, generator=g, dtype=dtype), torch.randn(7, generator=g, dtype=dtype)

    def run(a, b, c, w, bias):
        t = a.t().contiguous().t()[1:]          # a strided view at an offset
        return (torch.addmm(c, a, b), torch.bmm(a[None], b[None]), torch.softmax(a, 1),
                torch.nn.functional.layer_norm(a, (7,), w, bias), a.sum(0), a.mean(1),
                torch.nn.functional.gelu(t, approximate="tanh"), torch.nn.functional.silu(t),
                torch.sigmoid(t) * torch.tanh(t) - torch.exp(-t.abs()) / (t.abs() + 1))

    ref = run(a, b, c, w, bias)
    with flagos.track() as report:
        out = run(*(t.to(dev) for t in (a, b, c, w, bias)))
    for o, r in zip(out, ref):
        assert_close(o, r, atol=1e-5, rtol=1e-5)
    for op in ("aten::addmm", "aten::bmm", "aten::_softmax", "aten::native_layer_norm",
               "aten::sum.dim_IntList", "aten::mean.dim", "aten::gelu", "aten::silu",
               "aten::sigmoid", "aten::tanh", "aten::exp", "aten::neg", "aten::div.Tensor"):
        assert _native(report, op), f"{op}:\n{report}"


@on_opencl
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_conv_group_norm_upsample_embedding_cat_run_on_the_chip(dev, dtype):
    """The UNet's and BERT's ops beyond the elementwise ones, float64 included (the float32
    and float16 cases of every layout are in tests/test_sim_kernels.py)."""
    if str(dtype).split(".")[1] not in flagos.info()["native_dtypes"]:
        pytest.skip(f"{dtype} is not native on this OpenCL device")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 9, 11, generator=g, dtype=dtype)
    w = torch.randn(4, 3, 3, 3, generator=g, dtype=dtype)
    bias = torch.randn(4, generator=g, dtype=dtype)
    gw, gb = torch.randn(6, generator=g, dtype=dtype), torch.randn(6, generator=g, dtype=dtype)
    table = torch.randn(10, 5, generator=g, dtype=dtype)
    ids = torch.tensor([[3, 0, 9], [9, 1, 2]])
    F = torch.nn.functional

    def run(x, w, bias, gw, gb, table, ids):
        v = x[:, :, 1:, 2:]                     # a strided view at an offset
        return (F.conv2d(v, w, bias, stride=(2, 1), padding=1, dilation=(1, 2), groups=2),
                F.conv2d(x, w.repeat(1, 2, 1, 1)),
                F.group_norm(v, 3, gw, gb, eps=1e-6), F.group_norm(x, 2),
                F.interpolate(v, scale_factor=2.0, mode="nearest"),
                F.interpolate(x, size=(4, 17), mode="nearest"),
                F.embedding(ids, table), torch.cat([v, x[:, :, :8, :9]], 1),
                torch.cat([table.t(), table[:, :2].t()], 0))

    ref = run(x, w, bias, gw, gb, table, ids)
    with flagos.track() as report:
        out = run(*(t.to(dev) for t in (x, w, bias, gw, gb, table, ids)))
    for o, r in zip(out, ref):
        assert_close(o, r, atol=1e-5, rtol=1e-5)
    for op in ("aten::convolution", "aten::native_group_norm", "aten::upsample_nearest2d",
               "aten::embedding", "aten::cat"):
        assert _native(report, op), f"{op}:\n{report}"


@on_opencl
def test_declined_convolution_and_bad_embedding_index_give_cpus_answer(dev):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, 4, 5, 5, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    with flagos.track() as report:
        out = torch.nn.functional.conv_transpose2d(x.to(dev), w.to(dev), stride=2)
    assert_close(out, torch.nn.functional.conv_transpose2d(x, w, stride=2), atol=1e-5, rtol=1e-5)
    assert report.op("aten::convolution")["calls"]["fallback"] == 1, str(report)
    table = torch.randn(4, 3, generator=g)
    with pytest.raises(IndexError, match="index out of range in self"):
        torch.nn.functional.embedding(torch.tensor([1, 4]).to(dev), table.to(dev))
    good = torch.nn.functional.embedding(torch.tensor([3, 0]).to(dev), table.to(dev))
    assert torch.equal(good.cpu(), table[[3, 0]])


# ---- real models ----------------------------------------------------------------------------

@on_opencl
def test_unet2d_matches_cpu(dev):
    """A small seeded Diffusers UNet2DModel: float32 on the chip within 1e-4 of the CPU."""
    unet = models.ddpm_pipeline().unet.eval()
    g = torch.Generator().manual_seed(3)
    sample = torch.randn(2, 3, 16, 16, generator=g)
    with torch.no_grad():
        ref = unet(sample, 10).sample
        mine = unet.to(dev)
        with flagos.track() as report:
            out = mine(sample.to(dev), 10).sample
    assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert _native(report, "aten::silu") and report.calls("native") > 50, str(report)
    for op in ("aten::native_group_norm", "aten::upsample_nearest2d"):
        assert _native(report, op), f"{op}:\n{report}"
    # convolutions too, but those of channels_last inputs, which flagos leaves to the CPU
    conv = report.op("aten::convolution")["calls"]
    assert conv["native"] > conv["fallback"], str(report)


@on_opencl
def test_bert_matches_cpu(dev):
    """A tiny transformers BERT from its config: logits within 1e-4, ops of the table native."""
    ids, mask, labels = models.bert_batch()
    ref_model, model = models.bert().eval(), models.bert().eval().to(dev)
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask).logits
        with flagos.track() as report:
            out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
    assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for op in ("aten::addmm", "aten::native_layer_norm", "aten::gelu", "aten::embedding"):
        assert _native(report, op), f"{op}:\n{report}"


@from_cpu
def test_auto_leaves_an_opencl_cpu_device_to_the_cpu_chip():
    """FLAGOS_DEVICE=auto picks opencl only for a device that is not a CPU: on a CPU device
    (PoCL's here) the cpu chip runs the same host faster."""
    types = [OPENCL.device_type(i) for i in range(OPENCL.device_count())]
    if not types or not all(t & 2 for t in types):  # CL_DEVICE_TYPE_CPU
        pytest.skip(f"an OpenCL device that is not a CPU here (types {types})")
    assert not OPENCL.picked_by_auto()
