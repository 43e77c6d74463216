"""The adapter loader refuses what the ABI forbids: a table shorter than the ABI requires, and
an adapter whose init() fails; `auto` moves past both and the process keeps working. Adapters
built for an older minor of the ABI keep loading."""
import os

import pytest
import torch
from conftest import device_mode_only, run_python
from test_adapters import MAJOR, MINOR, build, guide_example

import flagos
from flagos import _activation
from flagos.chips import adapter
from flagos.chips.adapter import load
from flagos.errors import ChipNotFoundError

pytestmark = device_mode_only

OK_INIT = "static int32_t toy_init(flagos_status *st) { return ok(st); }"
FAILING_INIT = ('static int32_t toy_init(flagos_status *st) '
                '{ return fail(st, TOY_ERROR_LOST, "no card in slot 3"); }')


def variant(old: str, new: str) -> str:
    source = guide_example()
    assert source.count(old) == 1, old  # the guide changed: update this test with it
    return source.replace(old, new)


@pytest.mark.parametrize("size", ["offsetof(flagos_adapter, n_kernels)",
                                  "offsetof(flagos_adapter, kernels)",
                                  "sizeof(flagos_adapter) - 1"])
def test_adapter_table_shorter_than_the_abi_is_refused(tmp_path, size):
    source = variant(".struct_size = sizeof(flagos_adapter),",
                     f".struct_size = {size},\n").replace("#include <stdlib.h>",
                                                          "#include <stddef.h>\n#include <stdlib.h>")
    lib = build(tmp_path, "short", source)
    with pytest.raises(flagos.errors.AdapterError,
                       match=rf"cannot use chip adapter .*libflagos_short_adapter\.so: its adapter "
                             rf"table is \d+ bytes, shorter than ABI {MAJOR}\.{MINOR} requires"):
        load(str(lib))


@pytest.mark.parametrize("entry", ["return NULL;", "return (const flagos_adapter *)&no_table;"])
def test_an_entry_point_without_a_table_is_refused(tmp_path, entry):
    """flagos_adapter_get() returning NULL, or a table too short to hold its own ABI version:
    refused with the reason (the short one is not read past its size), and the process keeps
    working."""
    source = variant("    return &toy_adapter;", f"    {entry}").replace(
        "const flagos_adapter *flagos_adapter_get(void)",
        "static const size_t no_table[2] = {sizeof(size_t), 0};\nconst flagos_adapter *flagos_adapter_get(void)")
    lib = build(tmp_path, "tableless", source, strict=False)
    with pytest.raises(flagos.errors.AdapterError,
                       match=r"cannot use chip adapter .*libflagos_tableless_adapter\.so: "
                             r"flagos_adapter_get\(\) returned no adapter table"):
        load(str(lib))
    assert (torch.ones(2) + 1).tolist() == [2.0, 2.0]


def test_adapter_built_for_abi_1_0_loads_and_runs_synchronously(tmp_path):
    """A table of ABI 1.0 (no stream or event entries) keeps loading; its streams and events
    are flagos's synchronous ones."""
    source = variant(".struct_size = sizeof(flagos_adapter),\n    .abi_major = FLAGOS_ADAPTER_ABI_MAJOR,\n"
                     "    .abi_minor = FLAGOS_ADAPTER_ABI_MINOR,",
                     ".struct_size = FLAGOS_ADAPTER_SIZE_1_0,\n    .abi_major = 1,\n    .abi_minor = 0,")
    lib = build(tmp_path, "old", source)
    adapter = load(str(lib))
    assert adapter.abi == (1, 0) and adapter.has_streams is False
    for call, args in (("stream_create", (0, 0)), ("stream_destroy", (0, 1)), ("set_stream", (0, 1)),
                       ("stream_synchronize", (0, 1)), ("stream_query", (0, 1)),
                       ("stream_wait_event", (0, 1, 1)), ("event_create", (0, 0)),
                       ("event_destroy", (0, 1)), ("event_record", (0, 1, 0)),
                       ("event_synchronize", (0, 1)), ("event_query", (0, 1)),
                       ("event_elapsed_ms", (0, 1, 2))):
        with pytest.raises(RuntimeError, match="chip adapter toy has no stream/event entries"):
            getattr(adapter, call)(*args)
    proc = run_python("""
        import torch, flagos
        flagos.activate("old")
        d = flagos.device()
        s = torch.flagos.Stream()
        start, end = torch.flagos.Event(enable_timing=True), torch.flagos.Event(enable_timing=True)
        start.record()
        with torch.flagos.stream(s):
            y = (torch.arange(4.0).to(d) * 2).relu()
            end.record()
        end.synchronize()
        s.synchronize()
        assert s.query() and end.query() and end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
        torch.accelerator.synchronize()
        print("OK", y.cpu().tolist())
    """, env={"FLAGOS_ADAPTER_PATH": str(tmp_path), "FLAGOS_FALLBACK": "allow"})
    assert "OK [0.0, 2.0, 4.0, 6.0]" in proc.stdout


def test_adapter_with_part_of_the_stream_entries_is_refused(tmp_path):
    extra = ("static int32_t half_create(int32_t d, int32_t p, flagos_stream *s, flagos_status *st)"
             " { (void)d; (void)p; *s = 1; return ok(st); }\n")
    source = variant("    .synchronize = toy_synchronize,\n",
                     "    .synchronize = toy_synchronize,\n    .stream_create = half_create,\n")
    source = source.replace("static const flagos_kernel toy_kernels[]",
                            extra + "static const flagos_kernel toy_kernels[]")
    lib = build(tmp_path, "half", source)
    with pytest.raises(flagos.errors.AdapterError,
                       match=r"libflagos_half_adapter\.so: it fills some of the optional stream/event "
                             r"entries but not 'event_elapsed_ms'; fill all of them or none"):
        load(str(lib))


def test_adapter_whose_init_fails_is_refused_with_its_message(tmp_path):
    lib = build(tmp_path, "noinit", variant(OK_INIT, FAILING_INIT))
    with pytest.raises(flagos.errors.AdapterError,
                       match=r"libflagos_noinit_adapter\.so: its init\(\) failed "
                             r"\(TOY_ERROR_LOST, code 3\): no card in slot 3"):
        load(str(lib))


def test_auto_moves_past_an_adapter_whose_init_fails(tmp_path):
    build(tmp_path, "noinit", variant(OK_INIT, FAILING_INIT))
    proc = run_python("""
        import torch, flagos
        print("CHIP", flagos.activate("auto")["chip"])
        print("SUM", (torch.ones(3, device="flagos") * 2).sum().item())
    """, env={"FLAGOS_ADAPTER_PATH": str(tmp_path)})
    assert "CHIP cpu" in proc.stdout and "SUM 6.0" in proc.stdout
    assert "chip noinit skipped" in proc.stderr and "no card in slot 3" in proc.stderr


def test_an_adapter_is_shut_down_once_when_its_object_goes(tmp_path):
    """One Adapter object per library, however often it is loaded; when it goes, the adapter's
    shutdown() runs once (a chip's contexts and memory are released with it) and the library
    is closed (no longer mapped into the process)."""
    shutdown = ('#include <stdio.h>\n'
                'static void toy_shutdown(void)\n{\n'
                '    const char *path = getenv("TOY_SHUTDOWN_LOG");\n'
                '    FILE *f = path != NULL ? fopen(path, "a") : NULL;\n'
                '    if (f != NULL) {\n        fputs("shutdown\\n", f);\n        fclose(f);\n    }\n}\n')
    source = variant("    .synchronize = toy_synchronize,\n",
                     "    .synchronize = toy_synchronize,\n    .shutdown = toy_shutdown,\n")
    source = source.replace("static const flagos_kernel toy_kernels[]",
                            shutdown + "static const flagos_kernel toy_kernels[]")
    lib = build(tmp_path, "bye", source)
    log = tmp_path / "shutdown.log"
    proc = run_python(f"""
        import gc, os
        from flagos import _C
        first = _C.load_adapter({str(lib)!r})
        assert _C.load_adapter({str(lib)!r}) is first
        assert not os.path.exists({str(log)!r})
        mapped = lambda: {str(lib)!r} in open("/proc/self/maps").read()
        assert mapped()
        del first
        gc.collect()
        print("LOG", open({str(log)!r}).read().split(), "MAPPED", mapped())
    """, env={"TOY_SHUTDOWN_LOG": str(log)})
    assert "LOG ['shutdown'] MAPPED False" in proc.stdout


# Every stream/event entry of ABI 1.1; the two creates "succeed" without giving a handle.
HANDLELESS = """
static int32_t s_create(int32_t d, int32_t p, flagos_stream *s, flagos_status *st)
{ (void)d; (void)p; (void)s; return ok(st); }
static int32_t s_handle(int32_t d, flagos_stream s, flagos_status *st) { (void)d; (void)s; return ok(st); }
static int32_t s_query(int32_t d, flagos_stream s, int32_t *done, flagos_status *st)
{ (void)d; (void)s; *done = 1; return ok(st); }
static int32_t s_wait(int32_t d, flagos_stream s, flagos_event e, flagos_status *st)
{ (void)d; (void)s; (void)e; return ok(st); }
static int32_t e_create(int32_t d, uint32_t f, flagos_event *e, flagos_status *st)
{ (void)d; (void)f; (void)e; return ok(st); }
static int32_t e_handle(int32_t d, flagos_event e, flagos_status *st) { (void)d; (void)e; return ok(st); }
static int32_t e_record(int32_t d, flagos_event e, flagos_stream s, flagos_status *st)
{ (void)d; (void)e; (void)s; return ok(st); }
static int32_t e_query(int32_t d, flagos_event e, int32_t *done, flagos_status *st)
{ (void)d; (void)e; *done = 1; return ok(st); }
static int32_t e_elapsed(int32_t d, flagos_event a, flagos_event b, double *ms, flagos_status *st)
{ (void)d; (void)a; (void)b; *ms = 0.0; return ok(st); }
"""
STREAM_ENTRIES = """    .stream_create = s_create,
    .stream_destroy = s_handle,
    .set_stream = s_handle,
    .stream_synchronize = s_handle,
    .stream_query = s_query,
    .stream_wait_event = s_wait,
    .event_create = e_create,
    .event_destroy = e_handle,
    .event_record = e_record,
    .event_synchronize = e_handle,
    .event_query = e_query,
    .event_elapsed_ms = e_elapsed,
"""


def test_a_create_that_succeeds_without_a_handle_is_an_adapter_error(tmp_path):
    source = variant("    .synchronize = toy_synchronize,\n",
                     "    .synchronize = toy_synchronize,\n" + STREAM_ENTRIES)
    source = source.replace("static const flagos_kernel toy_kernels[]",
                            HANDLELESS + "static const flagos_kernel toy_kernels[]")
    adapter = load(str(build(tmp_path, "nohandle", source)))
    assert adapter.has_streams is True
    for call in ("stream_create", "event_create"):
        with pytest.raises(flagos.errors.AdapterError,
                           match=rf"{call}\(\) on device 0 returned success and handle 0"):
            getattr(adapter, call)(0, 0)
    assert adapter.stream_query(0, 1) is True and adapter.event_elapsed_ms(0, 1, 2) == 0.0


def test_sim_reads_its_configuration_again_after_its_last_user_shut_it_down():
    """When its Adapter object goes, the library is shut down and unloaded; loaded again in the
    same process sim starts afresh: nothing allocated, its environment read again."""
    proc = run_python("""
        import gc, os
        from flagos import _C
        from flagos.chips import adapter
        path = adapter.find_library("sim")
        first = _C.load_adapter(path)
        buffer = first.alloc(0, 1024)
        print("FIRST", first.props(0)["total_memory"], first.memory_info(0)["allocated"] > 0)
        del buffer, first
        gc.collect()
        os.environ["FLAGOS_SIM_MEMORY"] = "64M"
        again = _C.load_adapter(path)
        print("AGAIN", again.props(0)["total_memory"], again.memory_info(0)["allocated"])
    """, env={"FLAGOS_SIM_MEMORY": "32M"})
    assert f"FIRST {32 << 20} True" in proc.stdout, proc.stdout
    assert f"AGAIN {64 << 20} 0" in proc.stdout, proc.stdout


def test_adapters_on_the_search_path_are_named_once_each(tmp_path, monkeypatch):
    """FLAGOS_ADAPTER_PATH's folders in order: an adapter found in two folders is one chip,
    `libflagos_<name>.so` and `libflagos_<name>_adapter.so` both name <name>, and a file whose
    name is no chip name is passed over."""
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, files in ((first, ("libflagos_npu2_adapter.so", "libflagos_bad-name.so")),
                          (second, ("libflagos_npu2_adapter.so", "libflagos_toy.so"))):
        folder.mkdir()
        for name in files:
            (folder / name).write_bytes(b"")
    monkeypatch.setenv("FLAGOS_ADAPTER_PATH", os.pathsep.join([str(first), "", str(second)]))
    assert adapter.discovered_names() == ["npu2", "toy"]


def test_an_adapter_is_detected_when_it_has_a_device(tmp_path, monkeypatch):
    """detect() (what `auto` and `flagos diagnose` ask): an adapter that loads and counts one
    device is there; one that counts none is not."""
    one = "static int32_t toy_device_count(int32_t *count, flagos_status *st)\n{\n    *count = 1;"
    build(tmp_path, "onecard", variant(one, one))
    build(tmp_path, "nocard", variant(one, one.replace("*count = 1;", "*count = 0;")))
    monkeypatch.setenv("FLAGOS_ADAPTER_PATH", str(tmp_path))
    onecard = adapter.AdapterChip("onecard")
    assert onecard.detect() is True
    assert adapter.AdapterChip("nocard").detect() is False
    # asked for by name, the one without a device is refused before anything is set up
    assert _activation._pick_chip("onecard").name == "onecard"
    with pytest.raises(ChipNotFoundError, match="^chip 'nocard': its adapter reports no devices$"):
        _activation._pick_chip("nocard")
    # the library's own name and ABI name its code; synchronize() without a device waits for each
    assert onecard.architecture() == f"toy-abi{MAJOR}.{MINOR}"

    class Recorded:
        def __init__(self, inner):
            self.inner, self.synchronized = inner, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def synchronize(self, index):
            self.synchronized.append(index)
            return self.inner.synchronize(index)

    onecard._adapter = recorded = Recorded(onecard.adapter)
    onecard.synchronize()
    onecard.synchronize(0)
    assert recorded.synchronized == [0, 0]
