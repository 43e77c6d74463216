"""`flagos compare` run as a user runs it, and `flagos.compare(...)` from Python: a deliberately
wrong override kernel on sim is found at the first module that uses its op."""
import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import CHIP, device_mode_only, runs_once

import flagos
from flagos.tools import _compare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A user's model file: two transformer-style blocks; the second function also registers, on sim,
# a GELU kernel that is wrong (ReLU) the way a buggy vendor kernel would be.
MODEL_FILE = textwrap.dedent('''
    from collections import OrderedDict

    import torch
    from torch import nn

    import flagos


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.proj = nn.Linear(width, width)
            self.ffn = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                     nn.Linear(2 * width, width))

        def forward(self, x):
            x = x + self.proj(self.norm(x))
            return x + self.ffn(x)


    def build(batch=2):
        model = nn.Sequential(OrderedDict(
            embed=nn.Linear(8, 16), blocks=nn.Sequential(Block(16), Block(16)),
            head=nn.Linear(16, 4)))
        return model.eval(), (torch.randn(batch, 8),)


    def wrong_gelu(x, *args, **kwargs):
        return torch.relu(x)


    def build_with_wrong_gelu(batch=2):
        flagos.register_kernel("aten::gelu", wrong_gelu, chip="sim")
        return build(batch)
''')
EXECUTION_ORDER = ["embed#0", "blocks.0.norm#0", "blocks.0.proj#0", "blocks.0.ffn.0#0",
                   "blocks.0.ffn.1#0", "blocks.0.ffn.2#0", "blocks.0.ffn#0", "blocks.0#0",
                   "blocks.1.norm#0", "blocks.1.proj#0", "blocks.1.ffn.0#0", "blocks.1.ffn.1#0",
                   "blocks.1.ffn.2#0", "blocks.1.ffn#0", "blocks.1#0", "blocks#0", "head#0",
                   "(model)#0"]


def run_flagos(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "flagos", *args], env=full_env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(MODEL_FILE)
    return str(path)


@runs_once
def test_wrong_kernel_names_the_first_module_that_uses_it(model_file, tmp_path):
    out = tmp_path / "compare.json"
    proc = run_flagos("compare", f"{model_file}:build_with_wrong_gelu", "--chip", "sim",
                      "--ref", "cpu", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert (data["chip"], data["ref"], data["passed"]) == ("sim", "cpu", False)
    assert data["chip_run"]["override_ops"] == ["aten::gelu"]
    assert data["ref_run"]["override_ops"] == []  # registered for sim only
    names = [r["name"] for r in data["modules"]]
    assert names == EXECUTION_ORDER
    first = data["first_failure"]
    assert (first["name"], first["module"], first["call"], first["type"]) == \
        ("blocks.0.ffn.1#0", "blocks.0.ffn.1", 0, "GELU")
    # GELU vs ReLU on the same inputs: far apart by both measures
    assert first["cosine"] < 0.99 and first["max_abs_err"] > 1e-3
    before = data["modules"][:names.index("blocks.0.ffn.1#0")]
    assert before and all(r["passed"] and r["cosine"] > 0.9999 for r in before)
    assert "first failing module in execution order: blocks.0.ffn.1 (GELU, call 0)" in proc.stdout


@runs_once
def test_same_model_without_the_wrong_kernel_passes(model_file):
    proc = run_flagos("compare", f"{model_file}:build", "--chip", "sim", "--json", "-")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert (data["chip"], data["ref"], data["passed"], data["failed"]) == \
        ("sim", "torch-cpu", True, 0)
    assert [r["name"] for r in data["modules"]] == EXECUTION_ORDER
    assert data["chip_run"]["override_ops"] == []
    for row in data["modules"]:  # sim's kernels against plain PyTorch, float32 tolerances
        assert row["cosine"] > 0.99999 and row["max_abs_err"] < 1e-5, row


def _torch_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))
    return model.eval(), torch.randn(5, 6)


@device_mode_only
def test_python_api_in_this_process_catches_nan_on_one_side():
    model, x = _torch_model()
    flagos.register_kernel("aten::gelu", lambda t, *a, **k: t * float("nan"), chip=CHIP)
    try:
        data = flagos.compare(model, (x,), chip=CHIP, ref="torch-cpu")
    finally:
        flagos.unregister_kernel("aten::gelu", chip=CHIP)
    assert data["passed"] is False and data["chip"] == CHIP
    first = data["first_failure"]
    assert first["module"] == "1" and first["reason"].startswith("NaN/inf on one side only")
    assert first["nonfinite_chip"] == 5 * 12 and first["nonfinite_ref"] == 0
    # the user's model is not moved or changed by the comparison
    assert next(model.parameters()).device.type == "cpu"
    assert flagos.compare(model, (x,), chip=CHIP, ref="torch-cpu")["passed"] is True


@device_mode_only
def test_python_api_with_a_workload_name_takes_the_documented_defaults():
    data = flagos.compare("mlp", chip=CHIP)
    assert (data["passed"], data["ref"], data["dtype"], data["upcast"], data["batch"], data["seed"]) == \
        (True, "torch-cpu", "float32", False, 1, 0)


def test_python_api_runs_another_chip_in_a_child():
    other = "cpu" if CHIP == "sim" else "sim"
    model, x = _torch_model()
    data = flagos.compare(model, {"input": x}, chip=other, ref="torch-cpu", upcast=True)
    assert data["passed"] is True and (data["chip"], data["ref_dtype"]) == (other, "float64")
    assert [r["name"] for r in data["modules"]] == ["0#0", "1#0", "2#0", "(model)#0"]
    # against a float64 reference, float32 is off by rounding only
    assert all(0 < r["max_abs_err"] < 1e-5 for r in data["modules"])


@runs_once
def test_the_command_line_defaults_are_the_ones_its_help_names():
    parser = argparse.ArgumentParser()
    _compare.add_arguments(parser)
    args = parser.parse_args(["mlp"])
    assert (args.chip, args.ref, args.dtype, args.batch, args.seed, args.show, args.upcast, args.json) == \
        ("auto", "torch-cpu", "float32", 1, 0, 20, False, None)
    helps = {a.dest: a.help for a in parser._actions}
    assert "(default 1)" in helps["batch"] and "(default 20" in helps["show"] and "(default float32)" in helps["dtype"]


@runs_once
def test_verdict_thresholds():
    ref = torch.linspace(-1, 1, 1000)
    # max abs err over 1e-3 alone is not a failure while the cosine stays at or above 0.99
    close = _compare.judge([ref + 2e-3 * torch.sin(ref * 50)], [ref])
    assert close["cosine"] > 0.999 and close["max_abs_err"] > 1e-3 and close["passed"], close
    # the relative error's denominator is at least 1e-6: a reference of 0 does not divide by 0
    assert _compare.judge([torch.tensor([1e-6, 2.0])], [torch.tensor([0.0, 2.0])])["max_rel_err"] == pytest.approx(1.0)
    # cosine < 0.99 alone is not a failure while max abs err stays under 1e-3 (tiny values)
    tiny = _compare.judge([ref * 1e-4 + 3e-5 * torch.sin(ref * 50)], [ref * 1e-4])
    assert 0.9 < tiny["cosine"] < 0.99 and tiny["passed"], tiny
    # both at once is
    both = _compare.judge([ref + 0.2 * torch.sin(ref * 50)], [ref])
    assert both["cosine"] < 0.99 and both["max_abs_err"] > 1e-3 and not both["passed"]
    # cosine below 0.9 alone, max abs err above 1 alone (large values)
    assert "< 0.9" in _compare.judge([-ref], [ref])["reason"]
    flipped_tiny = _compare.judge([-ref * 1e-5], [ref * 1e-5])  # however small the error
    assert flipped_tiny["max_abs_err"] < 1e-3 and "< 0.9" in flipped_tiny["reason"]
    big = _compare.judge([ref * 1000 + 2], [ref * 1000])
    assert big["cosine"] > 0.999 and big["reason"] == "max abs err 2 > 1.0"
    # every threshold is a limit the verdict still passes at (float64 values that hit it exactly)
    unit = 2.0 ** -20
    at_floor = _compare.judge([torch.tensor([9.0, 3, 3, 1], dtype=torch.float64) * unit],
                              [torch.tensor([10.0, 0, 0, 0], dtype=torch.float64) * unit])
    assert at_floor["cosine"] == 0.9 and at_floor["passed"], at_floor
    at_ceiling = _compare.judge([torch.tensor([1000.0, 2000.0], dtype=torch.float64)],
                                [torch.tensor([999.0, 2000.0], dtype=torch.float64)])
    assert at_ceiling["max_abs_err"] == 1.0 and at_ceiling["passed"], at_ceiling
    at_cosine = _compare.judge([torch.tensor([99.0, 14, 1, 1, 1], dtype=torch.float64) / 1024],
                               [torch.tensor([100.0, 0, 0, 0, 0], dtype=torch.float64) / 1024])
    assert at_cosine["cosine"] == 0.99 and 1e-3 < at_cosine["max_abs_err"] < 1 and at_cosine["passed"], at_cosine
    at_abs = _compare.judge([torch.tensor([1e-3, 3e-3], dtype=torch.float64)],
                            [torch.tensor([0.0, 3e-3], dtype=torch.float64)])
    assert at_abs["max_abs_err"] == 1e-3 and 0.9 < at_abs["cosine"] < 0.99 and at_abs["passed"], at_abs
    # rounding can put the cosine of equal (or opposite) vectors past 1: it is kept to [-1, 1]
    g = torch.Generator().manual_seed(0)
    vec = torch.randn(1000, generator=g)
    assert float((vec.double() ** 2).sum()) / float(vec.double().norm()) ** 2 > 1  # past 1 unclamped
    assert _compare.judge([vec], [vec.clone()])["cosine"] == 1.0
    assert _compare.judge([-vec], [vec])["cosine"] == -1.0
    # zero vectors: the same only if both are zero
    zeros = torch.zeros(4)
    assert _compare.judge([zeros], [zeros.clone()])["cosine"] == 1.0
    assert _compare.judge([zeros], [zeros + 1e-5])["reason"] == "cosine 0.0000 < 0.9"
    # nothing finite on both sides (NaN in the same places): no error to measure
    nan = torch.full((3,), float("nan"))
    assert {k: v for k, v in _compare.judge([nan], [nan.clone()]).items() if k != "shapes"} == {
        "cosine": 1.0, "max_abs_err": 0.0, "max_rel_err": 0.0, "rmse": 0.0, "nonfinite_chip": 3,
        "nonfinite_ref": 3, "passed": True, "reason": None}
    # NaN where the reference has NaN too is agreement; shapes that differ are not
    both_nan = torch.tensor([float("nan"), 1.0])
    assert _compare.judge([both_nan], [both_nan.clone()])["passed"]
    assert _compare.judge([ref[:10]], [ref[:11]]) == {
        "shapes": [[10]], "cosine": None, "max_abs_err": None, "max_rel_err": None, "rmse": None,
        "nonfinite_chip": 0, "nonfinite_ref": 0, "passed": False, "reason": "shapes differ: [[10]] vs ref [[11]]"}
    # the relative error divides by the reference's magnitude; rmse over the elements
    two = _compare.judge([torch.tensor([1.0, 2.0])], [torch.tensor([1.0, 4.0])])
    assert (two["max_rel_err"], two["rmse"]) == (0.5, pytest.approx(2 ** 0.5))
    # an infinity is agreement only where the reference has the same one
    inf = float("inf")
    assert _compare.judge([torch.tensor([inf, 1.0])], [torch.tensor([inf, 1.0])])["passed"]
    assert _compare.judge([torch.tensor([inf, 1.0])], [torch.tensor([-inf, 1.0])])["reason"] == \
        "NaN/inf on one side only (more on ref)"
    # NaN against inf is no agreement, whichever side has which
    for a, b in ((float("nan"), inf), (inf, float("nan")), (float("nan"), -inf)):
        verdict = _compare.judge([torch.tensor([a, 1.0])], [torch.tensor([b, 1.0])])
        assert not verdict["passed"] and verdict["reason"].startswith("NaN/inf on one side only"), (a, b)
    assert _compare.judge([torch.tensor([float("nan"), 1.0])], [torch.tensor([float("nan"), 1.0])])["passed"]
    # NaN on one side fails, and the figures describe the elements finite on both sides
    one_sided = _compare.judge([torch.tensor([1.0, float("nan"), 3.0])], [torch.tensor([1.0, 2.0, 3.5])])
    assert not one_sided["passed"] and one_sided["reason"].startswith("NaN/inf on one side only")
    assert (one_sided["nonfinite_chip"], one_sided["nonfinite_ref"], one_sided["max_abs_err"]) == (1, 0, 0.5)


def test_the_table_shows_the_rows_from_the_first_failure():
    rows = [{"module": str(i), "passed": i != 2, "cosine": 1.0} for i in range(5)]
    assert [r["module"] for r in _compare._shown(rows, 1)] == ["2"]
    assert [r["module"] for r in _compare._shown(rows, 2)] == ["2", "3"]
    assert _compare._shown(rows, 0) == rows and _compare._shown(rows, 5) == rows
    # all passed: the lowest cosines, a row without one (nothing finite on both sides) lowest
    # of all, below even a cosine of -1 seen before it
    rows = [{"module": m, "passed": True, "cosine": c} for m, c in (("a", -1.0), ("b", None), ("c", 1.0))]
    assert [r["module"] for r in _compare._shown(rows, 1)] == ["b"]
    assert [r["module"] for r in _compare._shown(rows, 2)] == ["a", "b"]


@runs_once
def test_a_chip_that_fails_is_exit_1_with_the_error_in_the_json(tmp_path):
    out = tmp_path / "compare.json"
    proc = run_flagos("compare", "mlp", "--chip", "sim", "--json", str(out),
                      env={"FLAGOS_SIM_FAIL_DEVICE": "0"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert (data["model"], data["passed"]) == ("mlp", False) and "sim" in data["error"]
    assert f"flagos compare: {data['error']}" in proc.stderr


@runs_once
def test_usage_errors():
    proc = run_flagos("compare", "no_such_model", "--chip", "sim")
    assert proc.returncode == 2 and "use one of mlp, cnn, bert, unet, ddpm" in proc.stderr
    model, x = _torch_model()
    with pytest.raises(ValueError, match="inputs are needed"):
        flagos.compare(model)
    with pytest.raises(ValueError, match="unknown chip 'gpu0'.*torch-cpu"):
        flagos.compare(model, (x,), chip="gpu0")
    with pytest.raises(ValueError, match="batch must be at least 1, not 0"):
        flagos.compare("mlp", batch=0)
    unpicklable = torch.nn.Sequential(torch.nn.Linear(6, 3))
    unpicklable.hook = lambda: None  # a lambda cannot be pickled for the other process
    with pytest.raises(ValueError, match="the model cannot be pickled for the other process"):
        flagos.compare(unpicklable, (x,))


# A model with a module that runs on the host only (a check a chip's fast path skips): the
# outputs agree, but the chip's run left a module out.
SKIPPING_MODEL = textwrap.dedent('''
    import torch
    from torch import nn


    class HostOnlyCheck(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.check, self.head = nn.Linear(6, 8), nn.Identity(), nn.Linear(8, 3)

        def forward(self, x):
            x = self.embed(x)
            if x.device.type == "cpu":
                x = self.check(x)
            return self.head(x)


    def build(batch=2):
        return HostOnlyCheck().eval(), (torch.randn(batch, 6),)
''')


@device_mode_only
def test_a_module_that_ran_on_the_reference_only_fails(tmp_path):
    path = tmp_path / "skipping_model.py"
    path.write_text(SKIPPING_MODEL)
    data = flagos.compare(f"{path}:build", chip=CHIP, ref="torch-cpu")
    names = [r["name"] for r in data["modules"]]
    assert names == ["embed#0", "head#0", "(model)#0", "check#0"]  # the chip's order, then the ref's
    assert data["passed"] is False and data["failed"] == 1
    first = data["first_failure"]
    assert (first["name"], first["type"], first["reason"]) == \
        ("check#0", "Identity", "ran on the reference only")
    assert all(r["passed"] for r in data["modules"] if r["name"] != "check#0")


class _Twice(torch.nn.Module):
    """One Linear called twice, and an in-place ReLU after it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.lin(self.lin(x)))


@runs_once
def test_each_call_of_a_module_is_recorded_apart_and_before_later_in_place_ops():
    torch.manual_seed(0)
    model, x = _Twice(), torch.randn(4, 3)
    records, order, types = {}, [], {}
    handles = _compare._hook_every_module(model, records, order, types)
    with torch.no_grad():
        out = model(x)
    for h in handles:
        h.remove()
    assert order == ["lin#0", "lin#1", "act#0", "(model)#0"]
    assert types == {"lin#0": "Linear", "lin#1": "Linear", "act#0": "ReLU", "(model)#0": "_Twice"}
    with torch.no_grad():
        first = model.lin(x)
        second = model.lin(first)
    torch.testing.assert_close(records["lin#0"][0], first)
    torch.testing.assert_close(records["lin#1"][0], second)  # negatives kept: copied before the ReLU
    assert (second < 0).any() and torch.equal(records["(model)#0"][0], out)


@device_mode_only
def test_fallbacks_before_a_comparison_are_not_counted_in_it(dev):
    """The chip run lists the ops that fell back in it, not what this process ran before."""
    flagos.set_route("aten::neg", "fallback")
    try:
        torch.neg(torch.ones(2, device=dev))
    finally:
        flagos.set_route("aten::neg", "auto")
    assert "aten::neg" in [r["op"] for r in flagos.fallback_report().rows if r["calls"]["fallback"]]
    model, x = _torch_model()
    data = flagos.compare(model, (x,), chip=CHIP, ref="torch-cpu")
    assert data["passed"] and "aten::neg" not in data["chip_run"]["fallback_ops"]


@runs_once
def test_rows_follow_the_chips_order_and_fail_a_call_one_side_made_alone():
    one = [torch.ones(2)]
    chip = {"order": ["a#0", "extra#0", "(model)#0"], "records": {"a#0": one, "extra#0": one, "(model)#0": one},
            "types": {"a#0": "Linear", "extra#0": "Dropout", "(model)#0": "Net"}}
    ref = {"order": ["a#0", "skipped#0", "(model)#0"], "records": {"a#0": one, "skipped#0": one, "(model)#0": one},
           "types": {"a#0": "Linear", "skipped#0": "GELU", "(model)#0": "Net"}}
    rows = _compare._rows(chip, ref)
    assert [(r["name"], r["module"], r["call"], r["type"], r["passed"], r.get("reason")) for r in rows] == [
        ("a#0", "a", 0, "Linear", True, None),
        ("extra#0", "extra", 0, "Dropout", False, "ran on the chip only"),
        ("(model)#0", "(model)", 0, "Net", True, None),
        ("skipped#0", "skipped", 0, "GELU", False, "ran on the reference only")]


def _row(name, typ, cosine, max_abs):
    blank = cosine is None  # no element finite on both sides
    return {"name": name, "module": name.split("#")[0], "call": 0, "type": typ, "cosine": cosine,
            "max_abs_err": max_abs, "max_rel_err": None if blank else 2e-3, "rmse": None if blank else 5e-5,
            "passed": True, "reason": None}


@runs_once
def test_the_report_of_a_passing_comparison_shows_the_lowest_cosines_first_seen():
    rows = [_row("a#0", "Linear", 0.9999, 1e-4), _row("b#0", "Flatten", None, None),
            _row("c#0", "GELU", 0.99, 0.5), _row("(model)#0", "Net", 1.0, 0.0)]
    data = {"model": "Net", "chip": "sim", "ref": "torch-cpu", "dtype": "float32", "upcast": True, "failed": 0,
            "passed": True, "compared": 4, "first_failure": None, "modules": rows,
            "chip_run": {"fallback_ops": ["aten::gelu"], "override_ops": []}}
    assert _compare.format_result(data, 2) == textwrap.dedent("""\
        compare Net: sim (float32) vs torch-cpu (float64)

        2 of 4 module calls, with the lowest cosine (--show 0 for all):
        module  type     cosine    max abs err  max rel err  rmse   verdict
        ------  -------  --------  -----------  -----------  -----  -------
        b#0     Flatten  -         -            -            -      ok
        c#0     GELU     0.990000  0.5          0.002        5e-05  ok

        ops that fell back to the CPU on sim: aten::gelu
        4 module calls compared, 0 failed
        PASS""")
    every = _compare.format_result(data, 4)  # every row shown: no line saying which
    assert "module calls, with" not in every and len(every.split("\n")) == 8 + 4
    many = _compare.format_result({**data, "modules": rows * 6})  # 20 rows by default
    assert "\n20 of 24 module calls" in many and len(many.split("\n")) == 9 + 20
    nothing = _compare.format_result({**data, "modules": [], "compared": 0, "passed": False, "upcast": False,
                                      "chip_run": {}})
    assert nothing.startswith("compare Net: sim (float32) vs torch-cpu\n")
    assert nothing.endswith("0 module calls compared, 0 failed\nFAIL: no module produced a tensor")
