"""`flagos analyze`, run the way a user runs it: `python -m flagos analyze ... -- python script.py`.

The script is a small real model that checks its own results against plain PyTorch on the CPU
(it fails when they differ). Its report is checked against the same workload run in this
process on the suite's chip, and `--target sim` from the cpu chip against a real run on sim.
"""
import json
import os
import subprocess
import sys
import textwrap
from html.parser import HTMLParser

import pytest
import torch
from conftest import CHIP, device_mode_only, run_python, runs_once

import flagos
from flagos.tools import _analyze

pytestmark = device_mode_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""\
    import sys

    import torch
    import torch.nn.functional as F

    import flagos


    def step(model, x, vol):
        h = model(x)
        return h.max(dim=1).values.cumsum(0), F.adaptive_avg_pool3d(vol, 2)


    def workload(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 8))
        x, vol = torch.randn(4, 8), torch.randn(1, 2, 4, 4, 4)
        with torch.no_grad():
            expected = step(model, x, vol)
            model.to(device)
            got = step(model, x.to(device), vol.to(device))
        for g, e in zip(got, expected):
            torch.testing.assert_close(g.cpu(), e, atol=1e-5, rtol=1e-5)
        print("results match plain PyTorch")


    if __name__ == "__main__":
        workload(flagos.device())
        sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    """)


def flagos_command(*args, cwd=None, timeout=240):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "flagos", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("analyze") / "workload.py"
    path.write_text(SCRIPT)
    return path


# Two runs serve every test: cpu with --target sim, and sim (or opencl) with --target cpu (this
# one's script exits with status 3 after its work, and its JSON goes to stdout).
RUNS = {"cpu": ("sim", "0"), "sim": ("cpu", "3"), "opencl": ("cpu", "3")}
_runs = {}


@pytest.fixture(scope="module")
def analyze_run(script):
    """analyze_run(chip) -> (process, analysis, html path), each run once per module."""
    def run(chip):
        if chip not in _runs:
            target, status = RUNS[chip]
            html = script.parent / f"{chip}.html"
            proc = flagos_command("analyze", "--chip", chip, "--target", target, "--json", "-",
                                  "--html", str(html), "--", sys.executable, str(script), status)
            assert proc.returncode == int(status), proc.stdout + proc.stderr
            _runs[chip] = proc, json.loads(proc.stdout), html
        return _runs[chip]
    return run


def test_report_matches_the_same_workload_in_process(analyze_run, script, dev):
    proc, analysis, _ = analyze_run(CHIP)
    # JSON on stdout: the script's own output went to stderr, and its status came through
    assert "results match plain PyTorch" in proc.stderr
    assert analysis["chip"] == CHIP and analysis["status"] == int(RUNS[CHIP][1])
    assert analysis["command"] == [sys.executable, str(script), RUNS[CHIP][1]]

    namespace = {"__name__": "workload"}
    exec(compile(SCRIPT, str(script), "exec"), namespace)
    with flagos.track() as here:
        namespace["workload"](dev)
    expected = {r["op"]: r for r in here.to_dict()["ops"]}
    got = {r["op"]: r for r in analysis["ops"]}
    assert set(got) == set(expected)
    for op, row in got.items():
        assert row["calls"] == expected[op]["calls"], op
        assert (row["fallback_ns"] > 0) == (expected[op]["fallback_ns"] > 0), op
    assert sorted(analysis["totals"]["calls_by_route"].items()) == sorted(
        here.to_dict()["totals"]["calls_by_route"].items())

    # the first call site is the script's own line that called the op
    line = SCRIPT.splitlines().index("    return h.max(dim=1).values.cumsum(0), F.adaptive_avg_pool3d(vol, 2)") + 1
    assert got["aten::max.dim"]["site"] == f"{script}:{line}"


def test_printed_table_and_verdict(analyze_run):
    proc, analysis, _ = analyze_run(CHIP)
    lines = proc.stderr.splitlines()
    header = next(i for i, l in enumerate(lines) if l.startswith("op ") and "first call site" in l)
    rows = {}
    for line in lines[header + 2:]:
        if line.startswith("verdict:"):
            break
        cells = line.split()
        rows[cells[0]] = cells
    assert set(rows) == {r["op"] for r in analysis["ops"]}
    for r in analysis["ops"]:
        cells = rows[r["op"]]
        assert cells[1] == "/".join(k for k in ("override", "native", "fallback") if r["calls"][k])
        assert int(cells[2]) == sum(r["calls"].values()) and int(cells[3]) == r["calls"]["fallback"]
        assert cells[4] == f"{r['fallback_ns'] / 1e6:.2f}"
        assert cells[-1] == r["target"]["route"]
    share = 100 * analysis["totals"]["fallback_time_share"]
    assert f"verdict: fallback share of op time {share:.1f}%" in proc.stderr
    status = int(RUNS[CHIP][1])
    assert f"on chip {CHIP} (exit status {status})" in proc.stderr
    assert analysis["verdict"].startswith(f"fallback share of op time {share:.1f}%")
    assert f"target: {analysis['target']['verdict']}" in proc.stderr


def test_target_sim_from_cpu_predicts_the_fallbacks_of_a_real_sim_run(analyze_run):
    _, predicted, _ = analyze_run("cpu")   # --target sim
    _, real, _ = analyze_run("sim")        # --target cpu
    assert predicted["totals"]["fallback_ops"] == 0  # on cpu itself nothing fell back
    real_fallbacks = {r["op"] for r in real["ops"] if r["calls"]["fallback"]}
    assert real_fallbacks, "the workload is meant to need fallbacks on sim"
    assert set(predicted["target"]["fallback_ops"]) == real_fallbacks
    per_op = {r["op"]: r["target"]["route"] for r in predicted["ops"]}
    assert {op for op, route in per_op.items() if route == "fallback"} == real_fallbacks
    assert predicted["target"]["calls_by_route"]["fallback"] == real["totals"]["calls_by_route"]["fallback"]
    # the verdict names the first ops that would fall back, without their namespace
    short = ", ".join(op.split("::", 1)[1] for op in predicted["target"]["fallback_ops"][:8])
    assert "): " + short in predicted["target"]["verdict"]
    assert predicted["target"]["kind"] == "adapter"
    assert predicted["target"]["source"].endswith("libflagos_sim_adapter.so")
    # and the other way round: the cpu chip has a kernel for everything the sim run used
    assert real["target"]["fallback_ops"] == [] and real["target"]["unknown_ops"] == []


def test_vendor_coverage_files_classify_the_ops_of_a_run(analyze_run):
    """mps and cuda answers come from PyTorch's own dispatch table (checked here in the raw
    native_functions.yaml): the adaptive 3-d pool the script runs has a CUDA kernel, no MPS one."""
    import torchgen
    import yaml

    import flagos.report.coverage

    yaml_path = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "ATen", "native",
                             "native_functions.yaml")
    with open(yaml_path) as f:
        entries = {e["func"].split("(")[0]: e
                   for e in yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))}
    keys = {k.strip() for ks in entries["_adaptive_avg_pool3d"]["dispatch"] for k in ks.split(",")}
    assert "CUDA" in keys and "MPS" not in keys and not any(k.startswith("Composite") for k in keys)

    _, analysis, _ = analyze_run(CHIP)
    ops = [r["op"] for r in analysis["ops"]]
    assert "aten::_adaptive_avg_pool3d" in ops
    for chip, key in (("mps", "MPS"), ("cuda", "CUDA")):
        coverage = flagos.report.coverage.for_chip(chip)
        assert coverage.describe()["dispatch_key"] == key
        assert coverage.describe()["torch"] == torch.__version__.split("+")[0]
        routes = {op: coverage.classify(op) for op in ops}
        assert all(route != "unknown" for route, _ in routes.values())  # all in PyTorch's table
        fell_back = {op for op, (route, _) in routes.items() if route == "fallback"}
        assert fell_back == ({"aten::_adaptive_avg_pool3d"} if chip == "mps" else set()), chip
    assert "no MPS kernel" in flagos.report.coverage.for_chip("mps").classify("aten::_adaptive_avg_pool3d")[1]


@runs_once
def test_coverage_files_are_what_the_generator_writes(tmp_path):
    shipped = json.load(open(os.path.join(ROOT, "flagos", "report", "coverage", "cuda.json")))
    if shipped["torch"] != torch.__version__.split("+")[0]:
        pytest.skip(f"cuda.json comes from PyTorch {shipped['torch']}; this is {torch.__version__}")
    from flagos.report.coverage.generate import main  # `python -m flagos.report.coverage.generate`, here
    assert main(["--out", str(tmp_path), "cuda"]) == 0
    assert json.load(open(tmp_path / "cuda.json")) == shipped
    # byte for byte: regenerating a shipped file changes nothing in version control
    shipped_text = open(os.path.join(ROOT, "flagos", "report", "coverage", "cuda.json")).read()
    assert (tmp_path / "cuda.json").read_text() == shipped_text


EXCERPT = os.path.join(ROOT, "tests", "data", "op_plugin_functions_excerpt.yaml")


@runs_once
def test_op_plugin_coverage_versions_are_read_as_the_file_states_them():
    from flagos.report.coverage.generate import op_plugin_ops
    text = open(EXCERPT).read()
    always = {"aten::abs", "aten::add.Tensor", "aten::_fft_r2c", "aten::_conv_depthwise2d.out",
              "aten::_foreach_norm.Scalar"}
    fake_quant = "aten::_fake_quantize_per_tensor_affine_cachemask_tensor_qparams"
    ops, version, versions = op_plugin_ops(text)
    assert (version, versions[0], len(versions)) == ("v2.10", "v2.1", 10)
    assert ops == always  # custom npu_* ops are torch_npu's own, not aten's
    assert op_plugin_ops(text, "2.2")[0] == always | {"aten::cumsum", fake_quant}   # a comma list
    assert op_plugin_ops(text, "v2.5")[0] == always | {"aten::cumsum"}              # a closed range
    assert op_plugin_ops(text, "2.6")[0] == always
    with pytest.raises(ValueError, match="covers v2.1, .*v2.10, not v2.11"):
        op_plugin_ops(text, "2.11")


@runs_once
def test_op_plugin_coverage_ranges_include_both_ends_and_three_versions_are_a_list():
    """A two-item list is an inclusive range (both ends covered); a bound the file does not list
    counts as its newest version; a list of three or more names exactly those versions."""
    from flagos.report.coverage.generate import op_plugin_ops
    text = textwrap.dedent("""
        all_version: [v2.1, v2.2, v2.3, v2.4]
        official:
          - func: a(Tensor self) -> Tensor
            op_api: [v2.2, v2.3]
          - func: b(Tensor self) -> Tensor
            op_api: [v2.1, v2.3, v2.4]
          - func: c(Tensor self) -> Tensor
            op_api: [v2.9, newest]
    """)
    covered = {v: op_plugin_ops(text, v)[0] for v in ("2.1", "2.2", "2.3", "2.4")}
    assert covered == {"2.1": {"aten::b"}, "2.2": {"aten::a"}, "2.3": {"aten::a", "aten::b"},
                       "2.4": {"aten::b", "aten::c"}}


@runs_once
def test_coverage_generator_on_a_pytorch_without_its_operator_table_names_the_fix(monkeypatch, tmp_path):
    import torchgen

    from flagos.report.coverage.generate import kernel_table
    monkeypatch.setattr(torchgen, "__file__", str(tmp_path / "torchgen" / "__init__.py"))
    with pytest.raises(FileNotFoundError, match=r"native_functions\.yaml is missing: this PyTorch "
                                                r"install does not ship .* install a PyTorch wheel"):
        kernel_table("cuda")


@runs_once
def test_npu_coverage_file_from_op_plugin_names_what_the_list_lacks(tmp_path):
    from flagos.report.coverage import FileCoverage
    from flagos.report.coverage.generate import main
    assert main(["--out", str(tmp_path), "npu", "--op-plugin", EXCERPT,
                 "--op-plugin-source", "the test's excerpt"]) == 0
    table = json.load(open(tmp_path / "npu.json"))
    assert (table["chip"], table["dispatch_key"], table["op_plugin_version"]) == ("npu", "PrivateUse1", "v2.10")
    assert table["source"].startswith("the test's excerpt (Ascend op-plugin")
    assert table["torch"] == torch.__version__.split("+")[0]
    kernel, no_kernel = set(table["kernel"]), set(table["no_kernel"])
    assert {"aten::abs", "aten::add.Tensor", "aten::_fft_r2c"} <= kernel
    # listed only up to v2.5, and PyTorch's own kernels for it are per device: a fallback on npu
    assert "aten::cumsum" in no_kernel and "aten::mm" in no_kernel
    # a decomposition counts as covered, as for cpu/cuda/mps
    assert "aten::linear" in kernel
    cov = FileCoverage("npu", str(tmp_path / "npu.json"))
    assert cov.classify("aten::cumsum")[0] == "fallback" and cov.classify("aten::abs")[0] == "native"
    assert main(["--out", str(tmp_path), "npu", "--op-plugin", EXCERPT, "--op-plugin-version", "3.0"]) == 1


@runs_once
@pytest.mark.parametrize("version, cumsum", [("2.10", "fallback"), ("2.5", "native")])
def test_analyze_target_npu_from_op_plugin_coverage_names_the_ops_it_lacks(script, tmp_path, version, cumsum):
    """`--target ascend` (npu) with an npu.json made from the op-plugin excerpt, found on
    FLAGOS_COVERAGE_PATH: the workload's cumsum, listed for PyTorch 2.1 to 2.5 only, falls back
    at 2.10; addmm, which the excerpt does not list, falls back at both."""
    from flagos.report.coverage.generate import main
    assert main(["--out", str(tmp_path), "npu", "--op-plugin", EXCERPT,
                 "--op-plugin-version", version]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", FLAGOS_COVERAGE_PATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "flagos", "analyze", "--chip", "cpu", "--target",
                           "ascend", "--json", "-", "--", sys.executable, str(script), "0"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    target = json.loads(proc.stdout)["target"]
    assert (target["chip"], target["source"]) == ("npu", str(tmp_path / "npu.json"))
    assert "aten::addmm" in target["fallback_ops"]
    assert ("aten::cumsum" in target["fallback_ops"]) == (cumsum == "fallback")
    assert not {"aten::abs", "aten::add.Tensor"} & set(target["fallback_ops"])


def _npu_wheel(tmp_path, version="2.13.0", functions=True):
    """A file laid out as a torch_npu wheel, holding the test's excerpt of its operator list."""
    import zipfile
    path = tmp_path / f"torch_npu-{version}-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("torch_npu/version.py", f"__version__ = '{version}'\ngit_version = 'abc123'\n")
        if functions:
            wheel.write(os.path.join(ROOT, "tests", "data", "torch_npu_codegen_excerpt.yaml"),
                        "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml")
    return path


@runs_once
def test_npu_coverage_from_a_torch_npu_wheel_reads_its_operator_list(tmp_path):
    from flagos.report.coverage.generate import main, torch_npu_wheel_ops
    ops, version, revision = torch_npu_wheel_ops(str(_npu_wheel(tmp_path)))
    assert (version, revision) == ("2.13.0", "abc123")
    assert ops == {"aten::squeeze", "aten::squeeze.dim", "aten::clone", "aten::add.Tensor", "aten::abs",
                   "aten::new_empty_strided", "aten::npu_gather_backward", "aten::embedding",
                   "aten::_thnn_fused_gru_cell", "aten::int_repr"}   # custom: is torch_npu's own
    out = tmp_path / "out"
    assert main(["--out", str(out), "npu", "--torch-npu-wheel", str(_npu_wheel(tmp_path))]) == 0
    table = json.load(open(out / "npu.json"))
    assert (table["chip"], table["dispatch_key"], table["torch_npu"]) == ("npu", "PrivateUse1", "2.13.0")
    assert "git abc123" in table["source"] and "--torch-npu-wheel torch_npu-2.13.0-" in table["generated_by"]
    kernel, no_kernel = set(table["kernel"]), set(table["no_kernel"])
    assert {"aten::abs", "aten::add.Tensor", "aten::embedding", "aten::linear"} <= kernel   # linear: a decomposition
    assert {"aten::mm", "aten::cumsum", "aten::sub.Tensor"} <= no_kernel                     # not listed
    assert "aten::npu_gather_backward" not in kernel | no_kernel      # not an op of PyTorch's table
    bad = tmp_path / "bad"
    bad.mkdir()
    assert main(["--out", str(out), "npu", "--torch-npu-wheel", str(_npu_wheel(bad, functions=False))]) == 1
    assert main(["--out", str(out), "npu", "--torch-npu-wheel", str(EXCERPT)]) == 1   # not a zip


@runs_once
@pytest.mark.parametrize("chip, listed, not_aten", [
    ("mlu", {"aten::mm", "aten::mm.out", "aten::addmm", "aten::native_group_norm", "aten::group_norm",
             "aten::_fft_r2c"}, "aten::fused_dropout_mlu"),
    ("musa", {"aten::abs", "aten::abs.out", "aten::silu", "aten::gelu", "aten::_fused_rmsnorm_forward"},
     "aten::_fused_rmsnorm_forward"),
])
def test_mlu_and_musa_coverage_from_the_plugins_codegen_lists(tmp_path, chip, listed, not_aten):
    from flagos.report.coverage import FileCoverage
    from flagos.report.coverage.generate import main, vendor_functions_ops
    excerpt = os.path.join(ROOT, "tests", "data", f"{chip}_functions_excerpt.yaml")
    assert vendor_functions_ops(open(excerpt).read()) == listed   # other namespaces left out
    assert main(["--out", str(tmp_path), chip, "--vendor-functions", excerpt,
                 "--vendor-source", "the test's excerpt"]) == 0
    table = json.load(open(tmp_path / f"{chip}.json"))
    assert (table["chip"], table["dispatch_key"]) == (chip, "PrivateUse1")
    assert table["source"].startswith("the test's excerpt (")
    kernel, no_kernel = set(table["kernel"]), set(table["no_kernel"])
    assert listed - {not_aten} <= kernel and "aten::linear" in kernel   # a decomposition
    assert "aten::cumsum" in no_kernel and not_aten not in kernel | no_kernel
    cov = FileCoverage(chip, str(tmp_path / f"{chip}.json"))
    assert cov.classify("aten::cumsum")[0] == "fallback"
    bad = tmp_path / "bad.yaml"
    bad.write_text("aten: 3\n")
    assert main(["--out", str(tmp_path), chip, "--vendor-functions", str(bad)]) == 1


@runs_once
def test_shipped_npu_coverage_comes_from_the_torch_npu_wheel_of_its_pytorch():
    shipped = json.load(open(os.path.join(ROOT, "flagos", "report", "coverage", "npu.json")))
    assert shipped["torch_npu"] == shipped["torch"]   # torch_npu X.Y.Z is built for torch X.Y.Z
    assert shipped["source"].startswith(f"torch_npu {shipped['torch']} wheel from PyPI")
    kernel, no_kernel = set(shipped["kernel"]), set(shipped["no_kernel"])
    assert not kernel & no_kernel and len(kernel) > 2000
    # what a Diffusers UNet spends its time in has NPU kernels; CPU's own attention kernel has not
    assert {"aten::convolution", "aten::native_group_norm", "aten::addmm", "aten::silu",
            "aten::upsample_nearest2d", "aten::_softmax"} <= kernel
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in no_kernel


@runs_once
def test_analyze_target_npu_on_the_ddpm_example_names_what_npu_lacks():
    """The fallback analysis before the card is at hand: the main job's DDPM pipeline, analyzed
    on the cpu chip against the shipped npu.json."""
    proc = flagos_command("analyze", "--chip", "cpu", "--target", "ascend", "--json", "-", "--",
                          sys.executable, os.path.join(ROOT, "examples", "diffusers_pipeline.py"),
                          "--steps", "1", cwd=ROOT, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    target = json.loads(proc.stdout)["target"]
    assert (target["chip"], os.path.basename(target["source"])) == ("npu", "npu.json")
    shipped = json.load(open(os.path.join(ROOT, "flagos", "report", "coverage", "npu.json")))
    ran = {r["op"] for r in json.loads(proc.stdout)["ops"]}
    assert set(target["fallback_ops"]) == ran & set(shipped["no_kernel"])
    # the pipeline's attention (no backward) reaches the chip whole, and npu has it
    assert "aten::scaled_dot_product_attention" in ran - set(target["fallback_ops"])


class _Rows(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows, self._cells, self._text = [], None, None

    def handle_starttag(self, tag, attrs):
        if tag == "tr" and dict(attrs).get("data-op"):
            self._cells = []
        elif tag == "td" and self._cells is not None:
            self._text = []

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "td" and self._text is not None:
            self._cells.append("".join(self._text).strip())
            self._text = None
        elif tag == "tr" and self._cells is not None:
            self.rows.append(self._cells)
            self._cells = None


def test_html_page_of_the_analysis(analyze_run):
    _, analysis, html = analyze_run(CHIP)
    parser = _Rows()
    parser.feed(html.read_text())
    by_op = {cells[0]: cells for cells in parser.rows}
    assert set(by_op) == {r["op"] for r in analysis["ops"]}
    for r in analysis["ops"]:
        assert by_op[r["op"]][2] == str(sum(r["calls"].values()))
        assert by_op[r["op"]][-2] == r["target"]["route"]
    assert analysis["target"]["verdict"] in html.read_text()


@runs_once
def test_cpu_coverage_file_agrees_with_the_live_dispatcher():
    """The file's reading of PyTorch's yaml (structured delegates, ufunc loops, composites)
    against the kernels this process's dispatcher actually holds for CPU."""
    from flagos.report.coverage.generate import dispatcher_table

    shipped = json.load(open(os.path.join(ROOT, "flagos", "report", "coverage", "cpu.json")))
    if shipped["torch"] != torch.__version__.split("+")[0]:
        pytest.skip(f"cpu.json comes from PyTorch {shipped['torch']}; this is {torch.__version__}")
    live = dispatcher_table("cpu")
    both = (set(shipped["kernel"]) | set(shipped["no_kernel"])) & (set(live["kernel"]) | set(live["no_kernel"]))
    assert len(both) > 2500
    assert set(shipped["kernel"]) & both == set(live["kernel"]) & both
    assert "aten::cumsum" in live["kernel"] and "aten::_flash_attention_forward" in live["no_kernel"]
    version = torch.__version__.split("+")[0]  # "2.13.0" of "2.13.0+cpu"
    assert live["torch"] == version and f"(torch {version}), read with" in live["source"]
    with pytest.raises(RuntimeError, match="npu: its kernels are registered by torch_npu, which does "
                                           "not import here .*; run this where torch_npu is installed"):
        dispatcher_table("npu")  # no torch_npu on a test machine


@runs_once
def test_coverage_generator_help_and_whole_schemas_in_vendor_lists(capsys):
    """`--help` opens with what the generator does; a vendor list's entry may be a whole schema,
    of which the op's name is what comes before the parenthesis."""
    from flagos.report.coverage.generate import main, vendor_functions_ops
    with pytest.raises(SystemExit):
        main(["--help"])
    words = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "Write the coverage files of torch-native chips from PyTorch's own operator " \
           "registrations." in words
    listed = vendor_functions_ops("- func: abs(Tensor self) -> Tensor\n- func: mm.out\n- {}\n")
    assert listed == {"aten::abs", "aten::mm.out"}


def test_usage_error_exits_2():
    proc = flagos_command("analyze", "--chip", CHIP)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no command to analyze: give it after '--'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (("--chip", "nochip", "--", "python", "x.py"), "unknown chip 'nochip'"),
    (("--target", "mlu", "--", "python", "x.py"), "coverage files ship for cpu, cuda, mps, npu"),
])
@runs_once
def test_bad_chip_or_target_exits_2_before_running(args, message, capsys):
    from flagos.tools.cli import main  # the command's own entry, in this process
    assert main(["analyze", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_run_without_flagos_gives_no_report(tmp_path, capfd):
    from flagos.tools.cli import main
    quiet = tmp_path / "quiet.py"
    quiet.write_text("print('never imports torch')\n")
    assert main(["analyze", "--chip", CHIP, "--", sys.executable, str(quiet)]) == 1
    out, err = capfd.readouterr()
    assert "left no flagos report" in err and "never imports torch" in out
    failing = tmp_path / "failing.py"
    failing.write_text("raise SystemExit('the script gave up')\n")
    assert main(["analyze", "--chip", CHIP, "--", sys.executable, str(failing)]) == 1
    err = capfd.readouterr().err
    assert "the script gave up" in err
    assert "failed with exit status 1 before flagos wrote its report" in err and "must import" not in err
    killed = tmp_path / "killed.py"
    killed.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert main(["analyze", "--chip", CHIP, "--", sys.executable, str(killed)]) == 1
    assert "was ended by signal 9 before flagos wrote its report" in capfd.readouterr().err
    hung_up = tmp_path / "hung_up.py"  # signal 1: the smallest number a signal has
    hung_up.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGHUP)\n")
    assert main(["analyze", "--chip", CHIP, "--", sys.executable, str(hung_up)]) == 1
    assert "was ended by signal 1 before flagos wrote its report" in capfd.readouterr().err


@runs_once
def test_sim_coverage_follows_the_dtypes_sim_computes_in():
    """An adapter kernel counts only for the dtypes the chip declares native (sim: float32 and
    float16 unless FLAGOS_SIM_DTYPES says more), as the adapter runner applies it."""
    from flagos.report import coverage
    sim = coverage.for_chip("sim")
    assert sim.classify("aten::add.Tensor", ["torch.float32"])[0] == "native"
    if not os.environ.get("FLAGOS_SIM_DTYPES"):
        # sim's add kernel takes float32, float16 and bfloat16 (bits 0-2); the chip computes in two
        assert sim.classify("aten::add.Tensor", ["torch.float16"]) == ("native", "sim kernel for float32, float16")
    if "bfloat16" not in os.environ.get("FLAGOS_SIM_DTYPES", ""):
        route, reason = sim.classify("aten::add.Tensor", ["torch.bfloat16"])
        assert route == "fallback" and "not bfloat16" in reason
    assert sim.classify("aten::add.Tensor", ["torch.int64"])[0] == "fallback"
    # embedding's int64 indices are the one input outside the kernel's dtype mask
    assert sim.classify("aten::embedding", ["torch.float32", "torch.int64"])[0] == "native"
    route, reason = sim.classify("aten::embedding", ["torch.float64", "torch.int64"])
    assert route == "fallback" and "not float64" in reason
    # a kernel the library lists that the runner has no rule for is a fallback, and says so
    listed_only = "aten::flagos_test_only_op"
    sim.kernels[listed_only] = sim.kernels["aten::add.Tensor"]
    assert listed_only not in sim._builders
    route, reason = sim.classify(listed_only, ["torch.float32"])
    assert route == "fallback" and "lists a kernel, but flagos's adapter runner does not call it" in reason
    assert sim.classify("aten::not_in_the_table", ["torch.float32"])[1].startswith("no aten::not_in_the_table kernel in")
    # an adapter with only the .Scalar kernel runs `x + 2` on the chip (the runner's host-scalar rule)
    del sim.kernels["aten::add.Tensor"]
    assert sim.classify("aten::add.Tensor", ["torch.float32"])[0] == "native"


def test_coverage_path_folders_are_searched_in_order_the_first_with_a_chip_wins(tmp_path, monkeypatch):
    from flagos.report import coverage
    folders = {"a": ["npu", "mlu"], "b": ["npu", "musa"], "c": ["vendorx"]}
    for folder, chips in folders.items():
        (tmp_path / folder).mkdir()
        for chip in chips:
            (tmp_path / folder / f"{chip}.json").write_text("{}")
    monkeypatch.setenv("FLAGOS_COVERAGE_PATH", os.pathsep.join(str(tmp_path / f) for f in folders))
    found = coverage.shipped_files()
    where = {chip: os.path.basename(os.path.dirname(path)) for chip, path in found.items()
             if path.startswith(str(tmp_path))}
    assert where == {"npu": "a", "mlu": "a", "musa": "b", "vendorx": "c"}
    assert os.path.dirname(found["cpu"]) == os.path.dirname(coverage.__file__)  # the shipped ones stay


def test_sim_coverage_of_a_machine_with_one_sim_device():
    """The chip's dtypes are read from device 0, the one every machine has."""
    proc = run_python("""
        from flagos.report import coverage
        sim = coverage.for_chip("sim")
        print(sim.classify("aten::mul.Tensor", ["torch.float32"])[0])
    """, env={"FLAGOS_SIM_DEVICES": "1"})
    assert proc.stdout.split() == ["native"]


def test_the_verdict_in_figures_computed_by_hand():
    totals = {"fallback_time_share": 0.25, "fallback_s": 0.5, "fallback_ops": 2, "ops": 7,
              "calls_by_route": {"fallback": 12}, "calls": 40}
    assert _analyze._verdict(totals, 2.0) == (
        "fallback share of op time 25.0% (500.0 ms in fallbacks of 2.00 s tracked; "
        "2 of 7 ops, 12 of 40 calls)")


def test_the_table_in_figures_computed_by_hand():
    def row(op, fallback, native, ns):
        return {"op": op, "calls": {"override": 0, "native": native, "fallback": fallback, "error": 0},
                "fallback_ns": ns, "site": None}

    table = _analyze.coverage_table({"ops": [row("aten::add.Tensor", 0, 4, 0),
                                             row("aten::cumsum", 3, 0, 123_456_789_000)]})
    assert [line.split() for line in table.splitlines()[2:]] == [
        ["aten::cumsum", "fallback", "3", "3", "123456.79", "-"],
        ["aten::add.Tensor", "native", "4", "0", "0.00", "-"]]


def test_a_script_ended_by_a_signal_exits_128_plus_the_signal(tmp_path, capfd):
    """A job that saves its report and is then stopped by SIGTERM: the report is shown, and
    the exit status is 128 + 15 = 143, as a shell gives for it."""
    from flagos.tools.cli import main
    stopped = tmp_path / "stopped.py"
    stopped.write_text(textwrap.dedent("""\
        import os
        import signal

        import torch

        import flagos

        print("sum", (torch.ones(3, device=flagos.device()) * 2).sum().item())
        flagos.fallback_report().save(os.environ["FLAGOS_REPORT"])
        os.kill(os.getpid(), signal.SIGTERM)
        print("still running")
    """))
    assert main(["analyze", "--chip", CHIP, "--", sys.executable, str(stopped)]) == 128 + 15
    out, err = capfd.readouterr()
    assert "sum 6.0" in out and "still running" not in out
    assert f"on chip {CHIP} (ended by signal 15)" in out and "aten::mul.Tensor" in out


class RecordedCoverage:
    """A target chip's coverage with the routes given, recording what it was asked."""
    chip = "target"

    def __init__(self, routes):
        self.routes, self.asked = routes, []

    def classify(self, op, dtypes):
        self.asked.append((op, tuple(dtypes)))
        return self.routes[op], f"{op} by hand"

    def describe(self):
        return {"chip": self.chip, "kind": "by hand"}


def _analysis_of(ops):
    return {"ops": [{"op": f"aten::{op}", "calls": {"override": 0, "native": calls, "fallback": 0, "error": 0},
                     **({"dtypes": ["torch.float16"]} if op.startswith("half") else {})}
                    for op, calls in ops]}


def test_the_target_verdict_lists_eight_fallbacks_then_counts_the_rest(monkeypatch):
    """The --target verdict names the first eight ops that would fall back, counts the others
    and the ops the target's coverage does not know; each op is classified with its dtypes."""
    def classified(ops, routes):
        coverage = RecordedCoverage({f"aten::{op}": route for op, route in routes.items()})
        monkeypatch.setattr(_analyze, "for_chip", lambda chip: coverage)
        analysis = _analysis_of(ops)
        _analyze._classify(analysis, "target")
        return analysis, coverage

    eight = [(f"op{i}", 1) for i in range(8)]
    analysis, coverage = classified(eight + [("half_mm", 2), ("odd", 3)],
                                    {**{op: "fallback" for op, _ in eight}, "half_mm": "native", "odd": "unknown"})
    assert analysis["target"]["verdict"] == ("on target: 8 of 10 ops would fall back (8 of 13 calls): "
                                             "op0, op1, op2, op3, op4, op5, op6, op7; 1 ops not in its coverage")
    assert ("aten::half_mm", ("torch.float16",)) in coverage.asked and ("aten::odd", ()) in coverage.asked
    assert analysis["ops"][8]["target"] == {"route": "native", "reason": "aten::half_mm by hand"}
    assert analysis["target"]["unknown_ops"] == ["aten::odd"]

    nine = [(f"op{i}", 1) for i in range(9)]
    analysis, _ = classified(nine, {op: "fallback" for op, _ in nine})
    assert analysis["target"]["verdict"] == ("on target: 9 of 9 ops would fall back (9 of 9 calls): "
                                             "op0, op1, op2, op3, op4, op5, op6, op7, ... (1 more)")
    analysis, _ = classified([("half_add", 4)], {"half_add": "native"})
    assert analysis["target"]["verdict"] == "on target: 0 of 1 ops would fall back (0 of 4 calls)"


def test_the_command_and_the_report_file_are_read_as_given(tmp_path):
    """`--` before the command is dropped (only it); a script alone runs with this Python; a
    report file that is missing, blank or not JSON reads as no report."""
    assert _analyze._command(["--", "python3", "-c", "pass"]) == ["python3", "-c", "pass"]
    train = tmp_path / "train.py"
    train.write_text("pass\n")
    assert _analyze._command([str(train), "--steps", "2"]) == [sys.executable, str(train), "--steps", "2"]
    with pytest.raises(_analyze.UsageError, match=r"no such script: .*missing\.py$"):
        _analyze._command([str(tmp_path / "missing.py"), "--steps", "2"])
    with pytest.raises(_analyze.UsageError, match="no command to analyze"):
        _analyze._command(["--"])
    for name, text in (("blank.json", " \n"), ("bad.json", "{not json"), ("good.json", '{"ops": []}')):
        (tmp_path / name).write_text(text)
    assert _analyze._read_report(str(tmp_path / "missing.json")) is None
    assert _analyze._read_report(str(tmp_path / "blank.json")) is None
    assert _analyze._read_report(str(tmp_path / "bad.json")) is None
    assert _analyze._read_report(str(tmp_path / "good.json")) == {"ops": []}


class ReportingChild:
    """subprocess.Popen's stand-in: records the command and environment, writes the report a
    flagos run writes at exit, and exits with `status` (its first wait() may be interrupted)."""
    launched = []

    def __init__(self, command, env, stdout=None, stderr=None, status=0, interrupted=False):
        ReportingChild.launched.append((command, env))
        with open(env["FLAGOS_REPORT"], "w") as f:
            f.write(flagos.Report(chip=env["FLAGOS_DEVICE"]).to_json())
        self.status, self.interrupted = status, interrupted

    def wait(self):
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt
        return self.status


def test_analyze_runs_the_command_on_the_chip_it_resolves(monkeypatch):
    """No chip and no FLAGOS_DEVICE: the command runs on "auto" (the best chip here); the
    child's environment names the chip and the report path, keeps a FLAGOS_FALLBACK the caller
    set and drops the alias FLAGOS_DEVICE_BACKEND. Ctrl-C during the run still gives the report."""
    for name in ("FLAGOS_DEVICE", "FLAGOS_DEVICE_BACKEND", "FLAGOS_FALLBACK"):
        monkeypatch.delenv(name, raising=False)
    ReportingChild.launched.clear()
    monkeypatch.setattr(_analyze.subprocess, "Popen", ReportingChild)
    analysis = _analyze.analyze(["python3", "-c", "pass"])
    (command, env), = ReportingChild.launched
    assert command == ["python3", "-c", "pass"] and analysis["status"] == 0
    assert (env["FLAGOS_DEVICE"], env["FLAGOS_FALLBACK"]) == ("auto", "allow")
    assert env["FLAGOS_REPORT"].endswith("report.json")
    monkeypatch.setenv("FLAGOS_FALLBACK", "warn")
    monkeypatch.setenv("FLAGOS_DEVICE", "cpu")
    monkeypatch.setenv("FLAGOS_DEVICE_BACKEND", "sim")  # its alias, which FLAGOS_DEVICE overrides
    monkeypatch.setattr(_analyze.subprocess, "Popen",
                        lambda c, env, stdout, stderr: ReportingChild(c, env, status=130, interrupted=True))
    analysis = _analyze.analyze(["python3", "-c", "pass"])
    assert analysis["status"] == 130 and analysis["chip"] == "cpu"
    env = ReportingChild.launched[-1][1]
    assert (env["FLAGOS_DEVICE"], env["FLAGOS_FALLBACK"]) == ("cpu", "warn")
    assert "FLAGOS_DEVICE_BACKEND" not in env  # the child sees the one chip it runs on


def test_analyze_of_a_command_that_cannot_start_is_a_usage_error(tmp_path):
    missing = str(tmp_path / "no-such-program")
    with pytest.raises(_analyze.UsageError) as raised:
        _analyze.analyze([missing, "--flag"], chip="cpu")
    assert str(raised.value) == f"cannot run {missing!r}: No such file or directory"


def test_the_analysis_table_orders_ties_by_fallback_calls_then_calls():
    def row(op, fallback, native):
        return {"op": f"aten::{op}", "calls": {"override": 0, "native": native, "fallback": fallback, "error": 0},
                "fallback_ns": 0, "site": None}

    analysis = {"ops": [row("a", 0, 5), row("b", 0, 9), row("c", 2, 0), row("d", 1, 0)], "target": None}
    lines = _analyze.coverage_table(analysis).splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["aten::c", "aten::d", "aten::b", "aten::a"]


def test_signal_one_and_an_unwritable_page_are_reported(monkeypatch, tmp_path, capsys):
    """A run ended by signal 1 (SIGHUP) is "ended by signal 1", exit 129; a page or JSON path that
    cannot be written is an error naming the path, the run's table still shown."""
    from flagos.tools.cli import main
    analysis = {"command": ["python3", "job.py"], "status": -1, "chip": "cpu", "ops": [],
                "verdict": "nothing fell back", "target": None}
    monkeypatch.setattr(_analyze, "analyze", lambda *a, **k: dict(analysis))
    assert main(["analyze", "--chip", "cpu", "--", "python3", "job.py"]) == 129
    assert "flagos analyze: python3 job.py on chip cpu (ended by signal 1)" in capsys.readouterr().out
    page = tmp_path / "missing-folder" / "report.html"
    assert main(["analyze", "--chip", "cpu", "--html", str(page), "--", "python3", "job.py"]) == 1
    out, err = capsys.readouterr()
    assert "verdict: nothing fell back" in out
    assert f"flagos analyze: cannot write {page}: No such file or directory; give a writable path" in err


@runs_once
def test_coverage_generator_picks_each_chips_source(tmp_path, capsys):
    """npu, mlu and musa without their file go to their plugin, which a test machine lacks: one
    error line each, exit 1; --from-dispatcher reads this process's dispatcher."""
    from flagos.report.coverage.generate import main
    for chip, plugin in (("npu", "torch_npu"), ("mlu", "torch_mlu"), ("musa", "torch_musa")):
        assert main(["--out", str(tmp_path), chip]) == 1
        assert f"{chip}: its kernels are registered by {plugin}, which does not import here" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "cpu", "--vendor-functions", "unused.yaml"]) == 0  # not a vendor chip
    assert "shipped with PyTorch" in json.load(open(tmp_path / "cpu.json"))["source"]
    assert main(["--out", str(tmp_path), "--from-dispatcher", "cpu"]) == 0
    assert json.load(open(tmp_path / "cpu.json"))["generated_by"].endswith("--from-dispatcher cpu")
    assert not (tmp_path / "npu.json").exists()
