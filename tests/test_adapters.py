"""The adapter ABI: the guide's example adapter runs a model; broken adapters fail clearly."""
import os
import pathlib
import re
import subprocess

import pytest
from conftest import device_mode_only, run_python

import flagos
from flagos import _C
from flagos.chips.adapter import load

pytestmark = device_mode_only

ROOT = pathlib.Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "csrc" / "include"
MAJOR, MINOR = _C.ADAPTER_ABI_MAJOR, _C.ADAPTER_ABI_MINOR


def guide_example() -> str:
    """The complete example adapter from docs/adapters.md, as printed there."""
    text = (ROOT / "docs" / "adapters.md").read_text()
    blocks = re.findall(r"```c\n(.*?)```", text, re.S)
    return next(b for b in blocks if "flagos_adapter_get(void)\n{" in b)


def build(tmp_path, name: str, source: str, strict: bool = True) -> pathlib.Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    lib = tmp_path / f"libflagos_{name}_adapter.so"
    flags = ["-Wall", "-Wextra", "-Werror"] if strict else ["-w"]
    subprocess.run(["cc", "-std=c11", *flags, "-fPIC", "-shared", f"-I{INCLUDE}", str(src),
                    "-o", str(lib)], check=True)
    return lib


def test_guide_example_runs_a_model_with_the_rest_falling_back(tmp_path):
    build(tmp_path, "toy", guide_example())
    proc = run_python("""
        import torch, flagos
        info = flagos.activate("toy")
        assert info["chip"] == "toy" and info["devices"] == ["toy accelerator"]
        # a chip found on FLAGOS_ADAPTER_PATH has no profile of its own: its library names the vendor
        assert flagos.chips.profile("toy").vendor == "example"
        torch.manual_seed(0)
        w = torch.randn(8, 16)
        head = torch.nn.Linear(16, 4)

        def model(x, w):
            h = torch.relu(x @ w)            # mm and relu: toy kernels
            return head(h + h)               # add: toy kernel; linear's addmm: CPU fallback

        x = torch.randn(5, 8)
        with torch.no_grad():
            ref = model(x, w)
            d = flagos.device()
            head.to(d)
            out = model(x.to(d), w.to(d)).cpu()
            # toy's mm takes contiguous operands only: a transposed one is declined and falls back
            declined = (x.to(d) @ w.t().contiguous().to(d).t()).cpu()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(declined, x @ w, atol=1e-5, rtol=1e-5)
        report = flagos.fallback_report()
        for op in ("aten::relu", "aten::add.Tensor"):
            assert report.op(op)["calls"] == {"override": 0, "native": 1, "fallback": 0}, op
        assert report.op("aten::mm")["calls"] == {"override": 0, "native": 1, "fallback": 1}
        assert report.op("aten::addmm")["calls"] == {"override": 0, "native": 0, "fallback": 1}
        print(report)
        print("OK", torch.flagos.memory_allocated() > 0)
    """, env={"FLAGOS_ADAPTER_PATH": str(tmp_path), "FLAGOS_FALLBACK": "allow"})
    assert "OK True" in proc.stdout


def test_wrong_abi_major(tmp_path):
    source = guide_example().replace(".abi_major = FLAGOS_ADAPTER_ABI_MAJOR,",
                                     ".abi_major = FLAGOS_ADAPTER_ABI_MAJOR + 1,")
    lib = build(tmp_path, "future", source)
    with pytest.raises(flagos.errors.AdapterError,
                       match=rf"{re.escape(str(lib))}: it was built for adapter ABI {MAJOR + 1}\."
                             rf"{MINOR}, and this flagos speaks {MAJOR}\.{MINOR}; rebuild it"):
        load(str(lib))


def test_missing_entry_point(tmp_path):
    lib = build(tmp_path, "empty", "int flagos_not_an_adapter = 1;\n")
    with pytest.raises(flagos.errors.AdapterError, match=r"it exports no flagos_adapter_get\(\)"):
        load(str(lib))


def test_missing_required_function(tmp_path):
    source = guide_example().replace("    .alloc = toy_alloc,\n", "")
    lib = build(tmp_path, "noalloc", source, strict=False)
    with pytest.raises(flagos.errors.AdapterError, match=r"has no 'alloc' entry point \(required\)"):
        load(str(lib))


def test_library_that_does_not_load(tmp_path):
    lib = tmp_path / "libflagos_junk_adapter.so"
    lib.write_text("not an ELF file")
    with pytest.raises(flagos.errors.AdapterError, match=r"libflagos_junk_adapter\.so: the library does not load"):
        load(str(lib))


def test_auto_moves_past_a_broken_adapter(tmp_path):
    source = guide_example().replace(".abi_major = FLAGOS_ADAPTER_ABI_MAJOR,",
                                     ".abi_major = FLAGOS_ADAPTER_ABI_MAJOR + 1,")
    build(tmp_path, "future", source)
    proc = run_python("""
        import flagos
        print("CHIP", flagos.activate("auto")["chip"])
    """, env={"FLAGOS_ADAPTER_PATH": str(tmp_path)})
    assert "CHIP cpu" in proc.stdout
    assert "chip future skipped" in proc.stderr and f"adapter ABI {MAJOR + 1}.{MINOR}" in proc.stderr
    named = run_python("""
        import flagos
        try:
            flagos.activate("future")
        except flagos.errors.AdapterError as e:
            print("ERR", e)
    """, env={"FLAGOS_ADAPTER_PATH": str(tmp_path)})
    assert "ERR cannot use chip adapter" in named.stdout and f"ABI {MAJOR + 1}.{MINOR}" in named.stdout


def test_missing_adapter_names_the_search_path():
    proc = run_python("""
        import flagos
        try:
            flagos.activate("nosuchchip")
        except flagos.ConfigError as e:
            print("ERR", e)
    """, env={"FLAGOS_ADAPTER_PATH": "/nonexistent"})
    assert "unknown chip 'nosuchchip'" in proc.stdout and "sim" in proc.stdout


def test_abi_constants_match_the_header():
    header = (INCLUDE / "flagos" / "adapter.h").read_text()
    major = int(re.search(r"#define FLAGOS_ADAPTER_ABI_MAJOR (\d+)", header).group(1))
    minor = int(re.search(r"#define FLAGOS_ADAPTER_ABI_MINOR (\d+)", header).group(1))
    assert (_C.ADAPTER_ABI_MAJOR, _C.ADAPTER_ABI_MINOR) == (major, minor) == (1, 1)
    assert os.path.isfile(ROOT / "flagos" / "adapters" / "libflagos_sim_adapter.so")


def test_one_adapter_object_per_library(tmp_path):
    lib = build(tmp_path, "twice", guide_example())
    first = _C.load_adapter(str(lib))
    again = _C.load_adapter(os.fsencode(str(tmp_path) + "/./" + lib.name))  # other spelling, bytes
    assert again is first  # init() ran once; its buffers stay valid while either name is used
    buf = again.alloc(0, 16)
    assert first.memory_info(0)["allocated"] == 16
    del buf
    assert first.memory_info(0)["allocated"] == 0


# ---- adapters that give broken answers: each is checked, none crashes flagos ----------------

NULL_NAMES = "static const char *null_name(int32_t code) { (void)code; return NULL; }\n"


def broken(tmp_path, name: str, *edits: tuple[str, str], extra: str = ""):
    """The guide's adapter with some lines replaced, loaded."""
    source = guide_example()
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    source = source.replace("static const flagos_kernel toy_kernels[]", extra + "static const flagos_kernel toy_kernels[]")
    return load(str(build(tmp_path, name, source, strict=False)))


def relu_args(adapter):
    x, y = adapter.alloc(0, 16), adapter.alloc(0, 16)
    return [(x, 0, 0, (4,), (1,))], [(y, 0, 0, (4,), (1,))], (), ()


def test_error_name_returning_null_on_init_failure(tmp_path):
    with pytest.raises(flagos.errors.AdapterError,
                       match=r"its init\(\) failed \(unnamed error, code 2\): init refused"):
        broken(tmp_path, "nullinit",
               ("static int32_t toy_init(flagos_status *st) { return ok(st); }",
                "static int32_t toy_init(flagos_status *st) { return fail(st, 2, \"init refused\"); }"),
               (".error_name = toy_error_name,", ".error_name = null_name,"),
               extra=NULL_NAMES)


def test_error_name_returning_null_on_kernel_failure(tmp_path):
    adapter = broken(tmp_path, "nullkernel",
                     ("return fail(st, FLAGOS_STATUS_UNSUPPORTED, \"toy relu: contiguous float32 only\");\n"
                      "    for", "return fail(st, FLAGOS_STATUS_UNSUPPORTED, \"toy relu\");\n"
                      "    if (x) return fail(st, TOY_ERROR_INVALID, \"relu broke\");\n    for"),
                     (".error_name = toy_error_name,", ".error_name = null_name,"),
                     extra=NULL_NAMES)
    with pytest.raises(flagos.DeviceError, match=r"kernel aten::relu failed \(unnamed error, code 2\): "
                                                 r"relu broke") as info:
        adapter.run_kernel(0, 0, *relu_args(adapter))
    assert info.value.code == 2 and info.value.code_name == "unnamed error"
    assert adapter.error_name(7) == "unnamed error"


def test_kernel_failing_without_filling_its_status(tmp_path):
    adapter = broken(tmp_path, "mute",
                     ("return fail(st, FLAGOS_STATUS_UNSUPPORTED, \"toy relu: contiguous float32 only\");\n"
                      "    for", "return fail(st, FLAGOS_STATUS_UNSUPPORTED, \"toy relu\");\n"
                      "    if (x) return TOY_ERROR_LOST; /* status left as it was */\n    for"))
    with pytest.raises(flagos.DeviceError, match=r"kernel aten::relu failed \(TOY_ERROR_LOST, code 3\): "
                                                 r"the adapter gave no message") as info:
        adapter.run_kernel(0, 0, *relu_args(adapter))
    assert info.value.code == 3 and info.value.code_name == "TOY_ERROR_LOST"
    assert info.value.hint.startswith("the device is in a failed state")


def test_absurd_device_count_is_refused(tmp_path):
    adapter = broken(tmp_path, "many", ("*count = 1;", "*count = 2147483647;"))
    with pytest.raises(flagos.errors.AdapterError,
                       match=r"device_count\(\) reported 2147483647 devices; flagos drives 0 to 64"):
        adapter.device_count()
    negative = broken(tmp_path, "negative", ("*count = 1;", "*count = -2;"))
    with pytest.raises(flagos.errors.AdapterError, match=r"reported -2 devices"):
        negative.device_count()


def test_zero_buffer_handle_is_a_failed_allocation(tmp_path):
    adapter = broken(tmp_path, "zerohandle", ("*out = i + 1;", "*out = nbytes == 12 ? 0 : i + 1;"))
    with pytest.raises(flagos.errors.AdapterError, match=r"alloc\(\) of 12 bytes on device 0 returned "
                                                         r"success and buffer 0"):
        adapter.alloc(0, 12)
    buf = adapter.alloc(0, 16)  # the adapter keeps working
    assert buf.handle != 0 and buf.nbytes == 16


def test_kernel_table_entries_need_names_and_functions(tmp_path):
    with pytest.raises(flagos.errors.AdapterError, match=r"kernel 1 of its kernel table has no op name"):
        broken(tmp_path, "noname", ('{"aten::add.Tensor", toy_add,', '{NULL, toy_add,'))


def test_buffer_copies_outside_the_buffer_never_reach_the_adapter(tmp_path):
    import torch
    from torch.utils.dlpack import to_dlpack

    adapter = broken(tmp_path, "ranges")
    buf = adapter.alloc(0, 16)
    with pytest.raises(RuntimeError, match=r"a copy from host of 16 bytes at offset 8 is outside "
                                           r"the 16-byte buffer"):
        buf.write(to_dlpack(torch.ones(4)), 8)
    with pytest.raises(ValueError, match="non-negative"):
        buf.read(to_dlpack(torch.ones(1)), -4)
    with pytest.raises(RuntimeError, match="a device copy of 16 bytes at offset 2"):
        buf.copy_from(adapter.alloc(0, 32), 2, 0, 16)
    with pytest.raises(ValueError, match="adapter copies take host tensors with storage"):
        buf.write(to_dlpack(torch._efficientzerotensor(4)), 0)
    with pytest.raises(ValueError, match="a kernel tensor lies outside its buffer"):
        adapter.run_kernel(0, 0, [(buf, 2, 0, (4,), (1,))], [(buf, 0, 0, (4,), (1,))], (), ())


def test_error_name_takes_a_code_and_refuses_anything_else(tmp_path):
    adapter = broken(tmp_path, "errname")
    assert isinstance(adapter.error_name(2), str)
    with pytest.raises(TypeError):
        adapter.error_name("2")
    with pytest.raises(OverflowError):
        adapter.error_name(2 ** 40)
