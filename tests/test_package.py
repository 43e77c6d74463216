"""`import flagos` itself: it loads only what activation needs, and its names load on first use."""
import json

import pytest
from conftest import run_python

import flagos


def test_import_loads_nothing_until_a_name_is_used():
    proc = run_python("""
        import json, sys
        import flagos
        before = sorted(m for m in sys.modules if m.startswith("flagos"))
        flagos.parallel
        flagos.chips
        activate = flagos.activate
        after = sorted(m for m in sys.modules if m.startswith("flagos"))
        print(json.dumps([before, after, activate.__module__]))
    """)
    before, after, module = json.loads(proc.stdout.splitlines()[-1])
    assert "flagos._activation" not in before and "flagos.parallel" not in before
    assert "flagos.chips" not in before
    assert {"flagos.parallel", "flagos.chips", "flagos._activation"} <= set(after)
    assert module == "flagos._activation"


def test_a_name_flagos_does_not_have_is_an_attribute_error():
    assert not hasattr(flagos, "no_such_name")
    with pytest.raises(AttributeError, match="module 'flagos' has no attribute 'no_such_name'"):
        _ = flagos.no_such_name
    assert "activate" in dir(flagos) and "no_such_name" not in dir(flagos)
    for name in ("errors", "chips", "metrics", "parallel"):
        assert getattr(flagos, name).__name__ == f"flagos.{name}"
