"""The adapter loader refuses what the ABI forbids: a table shorter than the ABI requires, and
an adapter whose init() fails; `auto` moves past both and the process keeps working. Adapters
built for an older minor of the ABI keep loading."""
import pytest
from conftest import device_mode_only, run_python
from test_adapters import MAJOR, MINOR, build, guide_example

import flagos
from flagos.chips.adapter import load

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


def test_adapter_built_for_abi_1_0_loads_and_runs_synchronously(tmp_path):
    """A table of ABI 1.0 (no stream or event entries) keeps loading; its streams and events
    are flagos's synchronous ones."""
    source = variant(".struct_size = sizeof(flagos_adapter),\n    .abi_major = FLAGOS_ADAPTER_ABI_MAJOR,\n"
                     "    .abi_minor = FLAGOS_ADAPTER_ABI_MINOR,",
                     ".struct_size = FLAGOS_ADAPTER_SIZE_1_0,\n    .abi_major = 1,\n    .abi_minor = 0,")
    lib = build(tmp_path, "old", source)
    adapter = load(str(lib))
    assert adapter.abi == (1, 0) and adapter.has_streams is False
    for call, args in (("stream_create", (0, 0)), ("stream_destroy", (0, 1)), ("event_query", (0, 1))):
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
    shutdown() runs once (a chip's contexts and memory are released with it)."""
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
        del first
        gc.collect()
        print("LOG", open({str(log)!r}).read().split())
    """, env={"TOY_SHUTDOWN_LOG": str(log)})
    assert "LOG ['shutdown']" in proc.stdout
