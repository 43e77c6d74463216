"""The adapter loader refuses what the ABI forbids: a table shorter than the ABI requires, and
an adapter whose init() fails; `auto` moves past both and the process keeps working."""
import pytest

import flagos
from flagos.chips.adapter import load
from conftest import device_mode_only, run_python
from test_adapters import build, guide_example

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
                       match=r"cannot use chip adapter .*libflagos_short_adapter\.so: its adapter "
                             r"table is \d+ bytes, shorter than ABI 1\.0 requires"):
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
