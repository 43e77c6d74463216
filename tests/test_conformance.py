"""The fast subset of the conformance sweep (tests/conformance, full run: scripts/conformance.sh).

About forty OpInfo entries across the op families, every dtype they support among float32,
float16, bfloat16, complex64 and int64, forward and forward+backward, on the cpu chip, on sim
and on opencl (where its adapter was built and finds a device: PoCL in CI), compared against
plain CPU in worker processes. Fails on a failing case that
tests/conformance/expected_failures.py does not list, and on a listed case that now passes.
"""
from __future__ import annotations

import os
import sys
import threading

import pytest
from conftest import device_mode_only

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import runner  # noqa: E402

import flagos  # noqa: E402

CHIPS = ("cpu", "sim") + (("opencl",) if flagos.chips.profile("opencl").detect() else ())

FAST_OPS = [
    # elementwise, unary and binary, with type promotion and broadcasting
    "add", "mul", "div.no_rounding_mode", "pow", "abs", "exp", "sigmoid", "where", "clamp",
    "eq", "bitwise_and",
    # reductions and scans
    "sum", "mean", "amax", "argmax", "cumsum", "softmax", "var",
    # linear algebra
    "matmul", "addmm", "bmm", "linalg.norm",
    # shape, view and indexing ops
    "cat", "reshape", "permute", "transpose", "expand", "index_select", "gather", "scatter",
    "masked_fill", "flip", "nonzero",
    # nn.functional
    "nn.functional.conv2d", "nn.functional.linear", "nn.functional.layer_norm",
    "nn.functional.gelu", "nn.functional.embedding", "nn.functional.cross_entropy",
    # factories, copies and complex views
    "zeros_like", "full", "to", "view_as_real", "conj_physical",
    # decompositions that reach a chip whole under inference mode and once went wrong there
    "fft.hfftn", "tensor_split", "flatten", "contiguous",
]


BOGUS = ("no.such.op", "float32", "fwd")


def run_subset():
    import harness
    cases = []
    for key in FAST_OPS:
        op = harness.ops()[key]
        cases.extend((key, d, direction) for d, direction in harness.cases(op))
    results = {}
    errors = []

    def one(chip):
        # An op the worker cannot find kills it (KeyError): the harness's crash path, on cpu.
        todo = [BOGUS, *cases] if chip == "cpu" else cases
        try:
            results.update(runner.run(chip, todo, workers=1, timeout=60))
        except Exception as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    # One worker per chip, the chips at once: the workers' startup (loading op_db) overlaps.
    threads = [threading.Thread(target=one, args=(chip,)) for chip in CHIPS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, results.pop(runner.key_of("cpu", BOGUS))


@pytest.fixture(scope="module")
def subset(monkeypatch_module):
    return run_subset()


@pytest.fixture
def results(subset):
    return subset[0]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("CONFORMANCE_SAMPLES", "3")
    yield mp
    mp.undo()


@device_mode_only
def test_worker_crash_is_recorded(subset):
    results, crash = subset
    assert crash["outcome"] == "crash" and "KeyError" in crash["message"], crash
    # the fresh worker went on with the rest
    assert results[runner.key_of("cpu", ("add", "float32", "fwd"))]["outcome"] == "pass"


def test_judge_is_strict():
    expected = {"a bug": ["*:mul:complex64:bwd", "sim:add:float32:fwd"], "other": ["cpu:sub:*"]}
    results = {"cpu:mul:complex64:bwd": {"outcome": "mismatch"},
               "sim:mul:complex64:bwd": {"outcome": "pass"},
               "sim:add:float32:fwd": {"outcome": "pass"},
               "sim:div:float32:fwd": {"outcome": "crash"},
               "cpu:abs:float32:fwd": {"outcome": "stride"}}
    unexpected, stale = runner.judge(results, expected)
    assert unexpected == ["cpu:abs:float32:fwd", "sim:div:float32:fwd"]
    # `cpu:sub:*` matched nothing that ran: nothing to say about it
    assert stale == ["narrow '*:mul:complex64:bwd' to cpu: it passes on sim",
                     "remove 'sim:add:float32:fwd': it passes"]


@device_mode_only
def test_subset_ran(results):
    assert FAST_OPS and len(results) > 4 * len(FAST_OPS)
    assert sum(r["outcome"] == "pass" for r in results.values()) > len(results) // 2
    for chip in CHIPS:  # every chip swept the same cases
        assert sum(k.startswith(chip + ":") for k in results) == len(results) // len(CHIPS), chip


@device_mode_only
def test_no_unexpected_failure(results):
    unexpected, _ = runner.judge(results, runner.load_expected(), globs=False)
    lines = [f"{k}: {results[k]['outcome']}: {results[k]['message']}" for k in unexpected]
    assert not lines, "failing cases not in tests/conformance/expected_failures.py:\n" + "\n".join(lines)


@device_mode_only
def test_expected_failures_still_fail(results):
    _, stale = runner.judge(results, runner.load_expected(), globs=False)
    assert not stale, "tests/conformance/expected_failures.py:\n" + "\n".join(stale)
