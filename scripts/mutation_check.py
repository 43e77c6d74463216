#!/usr/bin/env python3
"""Does the test suite catch a broken flagos? Put one deliberate bug at a time into a scratch
copy of the tree, rebuild, run the tests that should notice it, and report caught / survived.

    python scripts/mutation_check.py              # every mutation (about half an hour on 2 cores)
    python scripts/mutation_check.py --only sub_scalar_adds fp16_truncates
    python scripts/mutation_check.py --list

A mutation is caught only when a test fails (pytest exit status 1). Before the mutations, the
same test selections run on the unmutated copy and must pass, so a failure means the bug.
A mutation whose original text is no longer in its file stops the script before anything
runs: the code changed, and the mutation must be updated with it. Exit status: 0 when every
mutation is caught, 1 when one survives or a run errs, 2 on a drifted mutation.

Runs sequentially, under `nice`, with pytest's `-x -p no:cacheprovider -p no:randomly`; see
docs/testing.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIED = ("setup.py", "pyproject.toml", "README.md", "constraints.txt", "csrc", "flagos", "backends", "tests",
          "docs", "examples", "scripts", "benchmarks")
SIM_ALL = {"FLAGOS_SIM_DTYPES": "float32,float16,bfloat16"}


@dataclass(frozen=True)
class Run:
    """One pytest run: the chip the suite activates, test paths / node ids, and -k."""
    chip: str
    paths: tuple[str, ...]
    k: str = ""
    env: tuple[tuple[str, str], ...] = ()

    def label(self) -> str:
        return f"{self.chip}: {' '.join(self.paths)}" + (f" -k '{self.k}'" if self.k else "")


def cpu(*paths, k=""):
    return Run("cpu", paths, k)


def sim(*paths, k=""):
    return Run("sim", paths, k, tuple(SIM_ALL.items()))


def opencl(*paths, k=""):
    """the opencl chip (PoCL's CPU device in CI), float16 native as the suite's opencl run has it."""
    return Run("opencl", paths, k, (("FLAGOS_OPENCL_FP16", "on"),))


def sim_default(*paths, k=""):
    """sim with its default dtypes (bfloat16 not native)."""
    return Run("sim", paths, k)


@dataclass
class Mutation:
    name: str
    what: str
    edits: list[tuple[str, str, str]]  # (file, original text, replacement)
    runs: list[Run] = field(default_factory=list)


def M(name, what, path, original, replacement, *runs, more=()):
    return Mutation(name, what, [(path, original, replacement), *more], list(runs))


ROUTER, FALLBACK, ADAPTER_LOAD = "csrc/router.c", "csrc/fallback.c", "csrc/adapter_load.c"
KERNELS, SIM = "backends/sim/kernels.c", "backends/sim/sim.c"
ENV_TESTS, POLICY = "tests/test_env.py", "tests/test_policy.py"
COUNTERS, KERNEL_TESTS = "tests/test_fallback_counters.py", "tests/test_sim_kernels.py"
LOADER = "tests/test_adapter_loader.py"
PRECISION = "tests/test_precision_policy.py"
FAST_PATH = "tests/test_sim_fast_path.py"

MUTATIONS = [
    # ---- 16 bugs the suite used to miss, and two claims that had no test ----
    M("fallback_env_ignored", "FLAGOS_FALLBACK=error in the environment behaves as allow",
      "flagos/_activation.py",
      '    _C.set_fallback_policy(_POLICIES[_env.get("FLAGOS_FALLBACK") or "warn"])',
      "    _C.set_fallback_policy(0)",
      cpu(ENV_TESTS, k="fallback_variable")),
    M("device_backend_wins", "FLAGOS_DEVICE_BACKEND wins over FLAGOS_DEVICE",
      "flagos/core/_env.py",
      'return get("FLAGOS_DEVICE") or get("FLAGOS_DEVICE_BACKEND")',
      'return get("FLAGOS_DEVICE_BACKEND") or get("FLAGOS_DEVICE")',
      cpu(ENV_TESTS, k="device_variables")),
    M("policy_after_fallback", "the fallback policy is checked after the fallback ran (torch-native chips)",
      ROUTER,
      "    Py_CLEAR(target);\n    if (check_policy(st, e) < 0)\n        return NULL;\n    if (st->device_mode) {",
      "    Py_CLEAR(target);\n    if (st->device_mode) {",
      cpu(POLICY, k="policy"),
      more=[(ROUTER, "    out = flagos_run_fallback(st, e, args, kwargs, target);\n",
             "    out = flagos_run_fallback(st, e, args, kwargs, target);\n"
             "    if (out != NULL && check_policy(st, e) < 0)\n        Py_CLEAR(out);\n")]),
    M("mixed_devices_on_fallback", "the mixed-device check is skipped on the fallback route",
      ROUTER,
      "            if (flagos_unwrap_call(st, e, args, kwargs, 1, &uargs, &ukwargs) < 0)\n"
      "                goto error;",
      "            if (flagos_unwrap_call(st, e, args, kwargs, 0, &uargs, &ukwargs) < 0)\n"
      "                goto error;",
      cpu(POLICY, k="mixed_devices")),
    M("chip_not_implemented_raises", "a chip kernel's NotImplementedError propagates instead of falling back",
      ROUTER,
      "        !PyErr_ExceptionMatches(PyExc_NotImplementedError))\n        goto error;",
      "        1)\n        goto error;",
      cpu(POLICY, k="not_implemented")),
    M("override_decline_raises", "an override's NotImplementedError is not handed to the chip's kernel",
      ROUTER,
      "    if (out == NULL && route == ROUTE_OVERRIDE &&\n        PyErr_ExceptionMatches(PyExc_NotImplementedError)) {",
      "    if (out == NULL && route == ROUTE_OVERRIDE && 0 &&\n        PyErr_ExceptionMatches(PyExc_NotImplementedError)) {",
      cpu(POLICY, k="override_declining")),
    M("fallback_time_unmeasured", "the fallback's wall time is not measured (torch-native chips)",
      FALLBACK, "    e->fallback_ns += flagos_now_ns() - t0;", "    e->fallback_ns += 0 * (flagos_now_ns() - t0);",
      cpu(COUNTERS, k="fallback_time")),
    M("written_bytes_uncounted", "bytes copied back for written arguments are not counted",
      FALLBACK, "        if (same == 1 && add_bytes(host, &c->e->bytes_to_device) == 0)",
      "        if (same == 1)",
      cpu(COUNTERS, k="bytes")),
    M("sub_scalar_adds", "sim: sub.Scalar adds", KERNELS,
      "static float sub_scalar_fn(float a, float b, const float *s) { (void)b; return a - s[1] * s[0]; }",
      "static float sub_scalar_fn(float a, float b, const float *s) { (void)b; return a + s[1] * s[0]; }",
      sim(KERNEL_TESTS, k="scalar")),
    M("mean_divides_by_numel", "sim: mean.dim divides by the input's numel, not the reduced count",
      KERNELS, "sum / (double)count : NAN;", "sum / (double)in[0].numel : NAN;",
      sim(KERNEL_TESTS, k="reduc or mean")),
    M("softmax_without_max", "sim: softmax without subtracting the row's max", KERNELS,
      "        if (x > max || isnan(x))", "        if (isnan(x))",
      sim(KERNEL_TESTS, k="softmax"),
      more=[(KERNELS, "    float max = -INFINITY;", "    float max = 0.0f;")]),
    M("fp16_truncates", "sim: float32 -> float16 truncates instead of rounding to nearest even",
      KERNELS, "(shift_right_round_even(magnitude, 13) - (112u << 10))",
      "((magnitude >> 13) - (112u << 10))",
      sim(KERNEL_TESTS, k="round_to_nearest")),
    M("short_table_accepted", "the loader accepts a table shorter than the ABI requires", ADAPTER_LOAD,
      "    if (api->struct_size < needed) {", "    if (api->struct_size < needed && 0) {",
      cpu(LOADER, k="shorter")),
    M("sim_devices_ignored", "FLAGOS_SIM_DEVICES is ignored (always 2 devices)", SIM,
      "    int32_t physical[SIM_MAX_DEVICES], n_visible = (int32_t)devices;",
      "    int32_t physical[SIM_MAX_DEVICES], n_visible = SIM_DEFAULT_DEVICES;",
      cpu(ENV_TESTS, k="sim_devices")),
    M("torch_range_unwarned", "no warning for a PyTorch outside the tested range",
      "flagos/_activation.py", "    if not low <= version <= high:",
      "    if False and not low <= version <= high:",
      cpu("tests/test_versions.py", k="torch")),
    M("batch_norm_stats_lost_sim", "sim: the fallback writes back only the first written argument "
      "(BatchNorm's running_var is lost)", "csrc/adapter_fallback.c",
      "        if (PyErr_Occurred() || (v != NULL && write_back_value(",
      "        if (PyErr_Occurred() || (v != NULL && i == 0 && write_back_value(",
      sim(COUNTERS, k="batch_norm")),
    M("init_failure_accepted", "the loader ignores a failed init() of an adapter", ADAPTER_LOAD,
      "    int32_t rc = api->init(&st);\n    if (rc != 0) {",
      "    int32_t rc = api->init(&st);\n    if (rc != 0 && 0) {",
      cpu(LOADER, k="init")),
    M("mode_env_ignored", "FLAGOS_MODE in the environment is ignored", "flagos/_activation.py",
      '    mode = (mode or _env.get("FLAGOS_MODE") or "").lower()', '    mode = (mode or "").lower()',
      cpu(ENV_TESTS, k="mode_variable")),
    # ---- more ----
    M("batch_norm_stats_lost_cpu", "torch-native chips: the fallback writes back only the first "
      "written argument (BatchNorm's running_var is lost)", FALLBACK,
      "    for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(e->write_args); w++) {\n"
      "        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->write_args, w));\n"
      "        PyObject *orig = flagos_argument_value",
      "    for (Py_ssize_t w = 0; w < 1 && w < PyTuple_GET_SIZE(e->write_args); w++) {\n"
      "        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(e->write_args, w));\n"
      "        PyObject *orig = flagos_argument_value",
      cpu(COUNTERS, k="batch_norm")),
    M("fallback_time_unmeasured_sim", "C-ABI chips: the fallback's wall time is not counted",
      "csrc/adapter_fallback.c", "    e->fallback_ns += flagos_now_ns() - t0;",
      "    e->fallback_ns += 0 * (flagos_now_ns() - t0);", sim(COUNTERS, k="fallback_time")),
    M("route_env_ignored", "FLAGOS_ROUTE in the environment is ignored", "flagos/core/_routes.py",
      '    _forced.update(parse_route_spec(_env.get("FLAGOS_ROUTE")))',
      '    parse_route_spec(_env.get("FLAGOS_ROUTE"))',
      cpu(ENV_TESTS, k="route_variable")),
    M("log_level_env_ignored", "FLAGOS_LOG_LEVEL's level is ignored", "flagos/_activation.py",
      '    level = _env.get("FLAGOS_LOG_LEVEL") or "warning"', '    level = "warning"',
      cpu(ENV_TESTS, k="log_level")),
    M("adapter_path_ignored", "FLAGOS_ADAPTER_PATH is not searched", "flagos/chips/adapter.py",
      "    return extra + [PACKAGE_DIR]", "    return [PACKAGE_DIR]",
      cpu(ENV_TESTS, k="adapter_path")),
    M("warns_every_call", "FLAGOS_FALLBACK=warn warns on every call, not once per op", ROUTER,
      "    if (st->fallback_policy == 1 && !(e->flags & OP_WARNED)) {",
      "    if (st->fallback_policy == 1) {",
      cpu(POLICY, k="warn_policy")),
    M("add_ignores_alpha", "sim: add.Tensor ignores alpha", KERNELS,
      "static float add_tensor_fn(float a, float b, const float *s) { return a + s[0] * b; }",
      "static float add_tensor_fn(float a, float b, const float *s) { (void)s; return a + b; }",
      sim(KERNEL_TESTS, k="binary_tensor")),
    M("fast_path_uncounted", "C-ABI chips: an op run by the C hot path is not counted", ROUTER,
      "            if (fast > 0)\n                e->calls[ROUTE_NATIVE]++;",
      "            (void)0;",
      cpu(FAST_PATH, k="counters")),
    M("fast_path_broadcast_keeps_strides", "C-ABI chips: the C hot path broadcasts size-1 dims "
      "with their own strides", "csrc/adapter_fast.c",
      "            t->strides[i] = i < pad || (o->sizes[i - pad] == 1 && shape[i] != 1)",
      "            t->strides[i] = i < pad",
      cpu(FAST_PATH, k="results_of_pytorch")),
    M("bf16_truncates", "sim: float32 -> bfloat16 truncates", KERNELS,
      "    uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);",
      "    uint32_t rounding_bias = 0u * ((bits >> 16) & 1u);",
      sim(KERNEL_TESTS, k="bfloat16_results")),
    M("fp16_subnormals_truncate", "sim: float16 subnormal results truncate", KERNELS,
      "shift_right_round_even(significand, 126u - exponent)", "(significand >> (126u - exponent))",
      sim(KERNEL_TESTS, k="subnormal")),
    M("layer_norm_fixed_eps", "sim: layer_norm ignores its eps", KERNELS,
      "        double rstd = 1.0 / sqrt(variance + eps);", "        double rstd = 1.0 / sqrt(variance + 1e-5 + 0 * eps);",
      sim(KERNEL_TESTS, k="layer_norm")),
    M("addmm_swaps_alpha_beta", "sim: addmm swaps alpha and beta", KERNELS,
      "gemm(&a, &b, &self, args->scalars[1], args->scalars[0], &c,",
      "gemm(&a, &b, &self, args->scalars[0], args->scalars[1], &c,",
      sim(KERNEL_TESTS, k="addmm")),
    M("div_scalar_multiplies", "sim: div.Scalar multiplies", KERNELS,
      "{ (void)b; return a / s[0]; }", "{ (void)b; return a * s[0]; }",
      sim(KERNEL_TESTS, k="scalar")),
    M("generator_reports_host_device", "a flagos generator reports its payload device, not flagos:N",
      "flagos/runtime/_generator.py", "        return self._flagos_device\n", "        return super().device\n",
      cpu("tests/test_generators.py", k="on_the_flagos_device")),
    M("data_setter_keeps_pytorchs", "`.data =` across flagos and the host keeps PyTorch's refusing setter",
      "flagos/integrations/_offload.py", "        take_memory_of(self, new)", "        _BASE_DATA.__set__(self, new)",
      cpu("tests/test_offload.py", k="cpu_parameter_takes_flagos_data")),
    M("compare_floor_ignored", "compare: a cosine under 0.9 passes when the max abs error is small",
      "flagos/tools/_compare.py", '    elif cosine < t["cosine_floor"]:',
      '    elif cosine < t["cosine_floor"] and max_abs > t["max_abs_err"]:',
      cpu("tests/test_cli_compare.py", k="verdict_thresholds")),
    M("metrics_fallback_counts_native", "metrics: every route's counter reports the native calls",
      "flagos/metrics.py", '                    calls.add_metric([row["op"], route], row["calls"][route])',
      '                    calls.add_metric([row["op"], route], row["calls"]["native"])',
      cpu("tests/test_metrics.py", k="reports_its_ops")),
    M("target_ignores_dtypes", "analyze --target: an adapter kernel counts for every dtype",
      "flagos/report/coverage/__init__.py", "        mask &= self.chip_dtypes", "        mask = -1",
      cpu("tests/test_cli_analyze.py", k="dtypes_sim_computes")),
    # ---- eight planted by hand that the suite missed, with the tests that now catch them ----
    M("autocast_bf16_not_upcast", "autocast: float32-policy ops (mse_loss, prod) upcast float16 "
      "only, not bfloat16", "flagos/runtime/_autocast.py",
      "cast = lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t",
      "cast = lambda t: t.float() if t.dtype == torch.float16 else t",
      cpu("tests/test_autocast.py", k="float32_policy")),
    M("generator_not_current_device", 'Generator("flagos") is on flagos:0, not the current '
      "device", "flagos/runtime/_generator.py",
      "    return state.chip_index(state.current if device.index is None else device.index)",
      "    return state.chip_index(device.index or 0)",
      sim("tests/test_generators.py", k="current_device")),
    M("wait_stream_records_on_itself", "wait_stream records its event on its own stream, not the "
      "other one", "flagos/runtime/_streams.py",
      "        self.wait_event(_as_flagos_stream(stream).record_event())",
      "        self.wait_event(self.record_event())",
      cpu("tests/test_streams.py", k="wait_stream_records")),
    M("sim_stream_any_device", "sim: a stream or event handle is accepted on any device", SIM,
      "    if (o == NULL || o->device != device || o->is_event != is_event) {",
      "    if (o == NULL || o->is_event != is_event) {",
      sim("tests/test_streams.py", k="another_device")),
    M("max_memory_one_device_too_many", "get_max_memory accepts the index device_count",
      "flagos/integrations/_libraries.py", "        if not 0 <= index < state.device_count:",
      "        if not 0 <= index <= state.device_count:",
      cpu("tests/test_accelerate.py", k="no_other")),
    M("track_bytes_to_device_unscoped", "track(): bytes_to_device is the running total, not the "
      "scope's", "flagos/report/_report.py",
      '        for k in ("fallback_ns", "bytes_to_host", "bytes_to_device", "downcast_calls",',
      '        for k in ("fallback_ns", "bytes_to_host", "downcast_calls",',
      cpu("tests/test_routes.py", k="track")),
    M("between_devices_unscoped", "track(): bytes_between_devices is the running total, not the "
      "scope's", "flagos/report/_report.py", "                        _transfers.total() - between_before)",
      "                        _transfers.total())",
      sim_default("tests/test_sharding.py", k="bytes_between_devices_are")),
    M("between_devices_to_copy_uncounted", "a .to('flagos:N') across devices is not counted",
      "flagos/runtime/_adapter_ops.py", "        if index != t.device.index:\n            _transfers.add(",
      "        if False:\n            _transfers.add(",
      sim_default("tests/test_sharding.py", k="bytes_between_devices_are")),
    M("compare_drops_reference_only", "compare: modules that ran on the reference only are left "
      "out", "flagos/tools/_compare.py",
      '    keys = chip_rec["order"] + [k for k in ref_rec["order"] if k not in chip_rec["records"]]',
      '    keys = chip_rec["order"]',
      cpu("tests/test_cli_compare.py", k="reference_only")),
    M("analyze_signal_status_negated", "analyze: a command ended by signal N exits 128 - N",
      "flagos/tools/_analyze.py", "    return 128 - status if status < 0 else status",
      "    return 128 + status if status < 0 else status",
      cpu("tests/test_cli_analyze.py", k="signal")),
    # ---- the precision policy (dtype_policy="downcast") ----
    M("downcast_to_the_host", "downcast: a bfloat16 copy to the host is made float16 too", ROUTER,
      "    if (device != NULL && device != Py_None) {\n        PyObject *type",
      "    if (device != NULL && device != Py_None && 0) {\n        PyObject *type",
      sim_default(PRECISION, k="conversions")),
    M("downcast_bytes_uncounted", "downcast: the report counts the calls but not their bytes", ROUTER,
      "    e->downcast_bytes += bytes;\n", "",
      sim_default(PRECISION, k="conversions")),
    M("downcast_stays_on", "activate(dtype_policy='strict') leaves the downcast in place",
      "flagos/_activation.py", "    if to is None:\n        _C.set_downcast(None)\n",
      "    if to is None:\n",
      sim_default(PRECISION, k="switching_back")),
    # ---- survivors of the systematic pass (scripts/mutation_full.sh) the new tests kill ----
    M("empty_chip_name_not_auto", "an empty or blank chip name is not 'auto'", "flagos/chips/names.py",
      '        return Alias(key or "auto")', '        return Alias(key and "auto")',
      cpu("tests/test_chip_names.py", k="empty_name")),
    M("alias_table_writable", "the alias table's entries can be rewritten through a lookup",
      "flagos/chips/names.py", "@dataclass(frozen=True)\nclass Alias:", "@dataclass(frozen=False)\nclass Alias:",
      cpu("tests/test_chip_names.py", k="tables_cannot")),
    M("vendor_plugin_device_mode", "torch_npu's chip runs in device mode though the plugin owns "
      "PrivateUse1", "flagos/chips/npu.py", 'plugin="torch_npu", owns_privateuse1=True',
      'plugin="torch_npu", owns_privateuse1=False',
      cpu("tests/test_chip_profiles.py", k="vendor_plugin_owns")),
    M("complex_op_kwargs_dropped", "complex ops lose their keyword arguments (alpha, dtype)",
      "flagos/runtime/_math_keys.py", "        return fn(*args, **(kwargs or {}))",
      "        return fn(*args, **(kwargs and {}))",
      cpu("tests/test_fidelity.py", k="complex_ops_keep")),
    M("precision_policy_case", "dtype_policy is not lower-cased and stripped", "flagos/core/_precision.py",
      "    policy = value.strip().lower() if isinstance(value, str) else value", "    policy = value",
      cpu(PRECISION, k="as_typed")),
    M("generator_uninstall_clobbers", "leaving flagos puts torch.Generator back over another "
      "library's", "flagos/runtime/_generator.py",
      "    if _saved is not None and torch.Generator is Generator:",
      "    if _saved is not None or torch.Generator is Generator:",
      cpu("tests/test_generators.py", k="someone_else")),
    M("between_devices_starts_at_one", "the bytes-between-devices counter starts at 1",
      "flagos/runtime/_transfers.py", "_lock = threading.Lock()\n_bytes = 0\n",
      "_lock = threading.Lock()\n_bytes = 1\n",
      sim_default("tests/test_sharding.py", k="fresh_process")),
    M("report_fallback_ms_divided", "the report table's fallback milliseconds are 1000 / seconds",
      "flagos/report/_report.py", "{1000 * t['fallback_s']:.2f} ms", "{1000 / (t['fallback_s'] or 1):.2f} ms",
      cpu("tests/test_routes.py", k="built_by_hand")),
    M("load_positional_location_ignored", "torch.load(f, 'cuda') under the redirect ignores the "
      "positional map_location", "flagos/integrations/_redirect.py",
      "        if args:  # map_location and pickle_module", "        if len(args) > 1:  # map_location and pickle_module",
      cpu("tests/test_redirect.py", k="entry_point_runs and load")),
    M("pin_memory_device_argument", "t.pin_memory('flagos') is refused (PyTorch's PrivateUse1 hooks)",
      "flagos/runtime/_pinned.py", 'return device is None or torch.device(device).type == "flagos"',
      'return device is None or torch.device(device).type != "flagos"',
      cpu("tests/test_ecosystem.py", k="pinned_dataloader")),
    M("site_cut_at_last_site_packages", "a call site is cut at the last site-packages, not the first",
      "flagos/report/_sites.py", "        path = path.split(marker, 1)[1]", "        path = path.split(marker)[-1]",
      cpu("tests/test_report_sites.py")),
    M("device_context_swallows_errors", "an error inside `with torch.flagos.device(i)` is swallowed",
      "flagos/runtime/_device_module.py", "        set_device(self.prev)\n        return False",
      "        set_device(self.prev)\n        return True",
      cpu("tests/test_device_module.py", k="propagates")),
    M("exporter_record_without_pid_alive", "top: an exporter record without a pid counts as a live "
      "process (kill(-1, 0))", "flagos/report/_exporters.py",
      "        if isinstance(pid, int) and pid > 0 and _alive(pid):", "        if _alive(int(pid or -1)):",
      cpu("tests/test_exporters.py", k="not_a_live_exporter")),
    M("metrics_port_65535_refused", "flagos metrics refuses port 65535", "flagos/tools/_metrics.py",
      "    if not 0 <= args.port <= 65535:", "    if not 0 <= args.port < 65535:",
      cpu("tests/test_metrics.py", k="65535")),
    M("cache_unremovable_folder_traceback", "flagos cache: a folder it cannot remove ends in a "
      "traceback, not exit 1", "flagos/tools/_cache.py", "    except OSError as e:", "    except ZeroDivisionError as e:",
      cpu("tests/test_cache_dirs.py", k="cannot_be_removed")),
    M("cuda_vendor_from_last_device", "the cuda chip takes its vendor from the last device, not "
      "device 0", "flagos/chips/cuda.py", "torch.cuda.get_device_name(0)", "torch.cuda.get_device_name(-1)",
      cpu("tests/test_chip_names.py", k="nvidias_facts_until")),
    M("cpu_chip_any_index", "the cpu chip's own index check accepts flagos:1", "flagos/chips/cpu.py",
      "        if index != 0:", "        if index == 0:",
      cpu("tests/test_device_module.py", k="index_itself")),
    M("detect_skips_the_vendor_plugin", "a torch-native chip's detect() never imports its vendor "
      "plugin (the plugin registers the device module)", "flagos/chips/base.py",
      "        try:\n            if self.plugin:", "        try:\n            if not self.plugin:",
      cpu("tests/test_chip_profiles.py", k="detect_imports")),
    M("host_memory_in_kib", "host memory read from /proc/meminfo in KiB, not bytes", "flagos/chips/base.py",
      "int(line.split()[1]) * 1024", "int(line.split()[1])",
      cpu("tests/test_chip_profiles.py", k="host_memory")),
    M("attention_groups_heads_unasked", "attention groups key/value heads the caller did not ask to group",
      "flagos/runtime/_attention.py", "is_causal=False, scale=None, enable_gqa=False):",
      "is_causal=False, scale=None, enable_gqa=True):",
      cpu("tests/test_models.py", k="fewer_key_value")),
    M("autocast_widens_to_an_index_type", "autocast's widest-type policy counts an integer index as a type to widen to",
      "flagos/runtime/_autocast.py", "if isinstance(t, torch.Tensor) and _eligible(t)]",
      "if isinstance(t, torch.Tensor) or _eligible(t)]",
      cpu("tests/test_autocast.py", k="widest_type")),
    # survivors of the C pass (scripts/mutation_c.py), 2026-12-03
    M("adapter_never_shut_down", "an Adapter object that goes never calls the adapter's shutdown()",
      "csrc/adapter_load.c", "    if (self->api != NULL && self->api->shutdown != NULL)\n        self->api->shutdown();",
      "    if (0)\n        self->api->shutdown();",
      cpu("tests/test_adapter_loader.py", k="shut_down")),
    M("run_kernel_refuses_16_values", "run_kernel refuses 16 scalars, the most the ABI call takes",
      "csrc/adapter_kernels.c", "    if (ns > MAX_KERNEL_VALUES || ni > MAX_KERNEL_VALUES) {",
      "    if (ns >= MAX_KERNEL_VALUES || ni > MAX_KERNEL_VALUES) {",
      cpu("tests/test_sim_kernel_checks.py", k="up_to_16")),
    # survivors of the sampled pass over the remaining modules, 2026-12-04
    M("bmm_rule_checks_the_wrong_dim", "sim's bmm rule compares the inner dim with the output's, so "
      "a mismatched product reaches the kernel", "flagos/runtime/_adapter_ops.py",
      "or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]):",
      "or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]):",
      sim("tests/test_sim_kernels.py", k="shape_errors")),
    M("dense_order_skips_size_two", "a gapped view with a dim of size 2 taken as dense: elementwise "
      "results keep its gaps", "flagos/runtime/_adapter_ops.py",
      "        if size[i] != 1:\n            if stride[i] != expected:",
      "        if size[i] != 2:\n            if stride[i] != expected:",
      sim("tests/test_sim_kernels.py", k="gapped")),
    M("scope_reports_total_compiled_calls", "track() adds the calls before the scope to its "
      "compiled-graph count", "flagos/report/_report.py",
      "_compile.compiled_calls() - compiled_before", "_compile.compiled_calls() + compiled_before",
      cpu("tests/test_routes.py", k="only_what_ran")),
    M("memory_fraction_refuses_one", "torch.cuda.set_per_process_memory_fraction(1.0) refused",
      "flagos/integrations/_redirect.py", "    if fraction < 0 or fraction > 1:",
      "    if fraction < 0 or fraction >= 1:",
      cpu("tests/test_redirect.py", k="set_per_process_memory_fraction")),
    M("out_resize_kept_in_place", "an out= argument a fallback op shrank keeps its old shape (the "
      "Python runner's write-back)", "flagos/runtime/_adapter_ops.py",
      "if (view.shape != t.shape or view.stride() != t.stride()",
      "if (view.shape != t.shape and view.stride() != t.stride()",
      cpu("tests/test_sim_fidelity.py", k="resized")),
    M("report_page_rows_by_least_time", "the report page lists the ops with the least fallback time "
      "first", "flagos/report/_html.py",
      '    for r in sorted(ops, key=lambda r: (-r["fallback_ns"], -r["calls"]["fallback"],',
      '    for r in sorted(ops, key=lambda r: (r["fallback_ns"], -r["calls"]["fallback"],',
      cpu("tests/test_report_html.py", k="by_hand")),
    M("gpu_utilization_in_percent", "a GPU's utilization reported in percent, not as a fraction",
      "flagos/report/_probe.py", "        return float(query(index)) / 100.0",
      "        return float(query(index))", cpu("tests/test_probe.py", k="fraction")),
    M("analyze_exit_zero_as_a_signal", "flagos analyze says a script that exited 0 was ended by "
      "signal 0", "flagos/tools/_analyze.py",
      '    ended = f"ended by signal {-status}" if status < 0 else',
      '    ended = f"ended by signal {-status}" if status <= 0 else',
      cpu("tests/test_cli_analyze.py", k="printed_table")),
    M("maybe_view_taken_for_a_view", "under inference mode an adapter chip takes reshape, "
      "flatten and contiguous for views (no copy where the layout needs one)",
      "flagos/runtime/_adapter_ops.py",
      "        if flags & _C.OP_DECOMPOSES and (flags & _C.OP_VIEW or route == NATIVE):",
      "        if flags & _C.OP_DECOMPOSES and route == NATIVE and not flags & _C.OP_VIEW:",
      sim("tests/test_fidelity.py", k="maybe_views")),
    M("attention_whole_under_a_mode", "attention goes to the router whole while a dispatch mode "
      "watches (the mode sees the CPU's kernel on host tensors)", "flagos/runtime/_attention.py",
      "    return _dispatch_modes() == 0 and _functorch_level() is None",
      "    return _functorch_level() is None", cpu("tests/test_models.py", k="dispatch_mode")),
    M("decompositions_without_math_keys", "a decomposition reaching a torch-native chip whole "
      "(inference mode) runs without the conjugate and negative keys", "csrc/payload.c",
      "int c = (e->flags & OP_MATH_KEYS) ? 1 : any_complex(st, args, kwargs);",
      "int c = ((e->flags & OP_MATH_KEYS) && 0) ? 1 : any_complex(st, args, kwargs);",
      cpu("tests/test_conformance.py")),
    M("tensor_split_points_refused", "tensor_split's CPU split points are refused as a device "
      "mix-up under inference mode", "flagos/core/_schema.py", '    "aten::tensor_split",\n', "",
      cpu("tests/test_conformance.py")),
    M("timed_out_smoke_child_kept", "flagos diagnose leaves a smoke child past its deadline running",
      "flagos/tools/_smoke.py", "            if kill:\n                self.proc.kill()",
      "            if not kill:\n                self.proc.kill()",
      cpu("tests/test_cli_diagnose.py", k="past_its_deadline")),
    M("kept_host_tensor_still_seen", "a small fallback's host tensor goes back to the pool while an "
      "op still holds a view of it", "csrc/staging.c",
      "uses >= 0 && uses <= base_uses && nbytes <= limit) {", "uses >= 0 && nbytes <= limit) {",
      sim_default("tests/test_fallback_staging.py", k="op_keeps")),
    M("kept_host_tensor_for_written_arguments", "a small fallback that writes its argument takes a "
      "kept host tensor", "csrc/adapter_fallback.c", "g->kept = !c->writes;", "g->kept = 1;",
      sim_default("tests/test_fallback_staging.py", k="writes_or_resizes")),
    M("out_resize_not_synced", "an out= tensor the op resizes keeps its old shape on torch-native chips",
      "flagos/core/_schema.py", "    if writes_out or inplace_view:", "    if inplace_view:",
      cpu("tests/test_fidelity.py", k="resizes_take")),
    M("opencl_device_copy_fails", "every copy between tensors on one OpenCL device reports a "
      "failure", "backends/opencl/memory.c",
      '        if (err != CL_SUCCESS)\n            return ocl_cl_fail(status, err, "clEnqueueCopyBuffer");',
      '        if (err == CL_SUCCESS)\n            return ocl_cl_fail(status, err, "clEnqueueCopyBuffer");',
      opencl("tests/test_opencl.py", k="copies_on_the_device")),
    M("opencl_reset_peak_ignored", "the opencl chip's reset_peak_memory_stats leaves the peak",
      "backends/opencl/memory.c", "    if (rc != OCL_SUCCESS)\n        return rc;\n    ocl.devices[device].peak",
      "    if (rc == OCL_SUCCESS)\n        return rc;\n    ocl.devices[device].peak",
      opencl("tests/test_opencl.py", k="memory_statistics")),
    M("opencl_no_device_chosen", "the opencl adapter finds no device on a machine that has one",
      "backends/opencl/opencl.c",
      "    if (rc == OCL_SUCCESS)\n        rc = choose_devices(", "    if (0)\n        rc = choose_devices(",
      cpu("tests/test_errors.py", k="loader_lists_one")),
    M("stream_block_swallows_errors", "an exception inside `with stream:` never reaches the caller",
      "flagos/runtime/_streams.py", "        set_stream(self._entered.pop())\n        return False",
      "        set_stream(self._entered.pop())\n        return True",
      cpu("tests/test_streams.py", k="lets_an_error_through")),
    M("inductor_default_taken_for_the_users", "Inductor's own default folder in TORCHINDUCTOR_CACHE_DIR "
      "is kept as if the user chose it", "flagos/integrations/_caches.py",
      "    if utils is None:  # Inductor never ran here", "    if True:  # Inductor never ran here",
      cpu("tests/test_cache_dirs.py", k="own_default")),
    M("report_elapsed_added", "the report's elapsed time adds the clock reading at the reset",
      "flagos/report/_report.py", "time.perf_counter() - _since, _chip()", "time.perf_counter() + _since, _chip()",
      cpu("tests/test_routes.py", k="spans_the_time")),
    M("opencl_cat_mixed_dtypes", "the opencl adapter's cat copies inputs of another dtype as if they "
      "were the output's", "backends/opencl/kernels.c",
      '        if (args->inputs[i].dtype != dtype)\n            return unsupported(status, op, "mixed dtypes");\n',
      "", cpu("tests/test_opencl.py", k="fewer_dims")),
    M("swap_in_place_claims_success", "swap_tensors of a non-leaf or a conjugate view does nothing and "
      "says it is done", "flagos/runtime/_tensor.py",
      "not _BASE_COMPATIBLE(t1, t2):\n        return False", "not _BASE_COMPATIBLE(t1, t2):\n        return True",
      cpu("tests/test_offload.py", k="cannot_exchange")),
    M("auto_takes_a_missing_chip", "auto takes the first chip of its order that is not here",
      "flagos/_activation.py", "            if profile.picked_by_auto():", "            if not profile.picked_by_auto():",
      cpu("tests/test_chip_names.py", k="first_chip_in_its_order")),
    M("moved_gradient_dropped", "a gradient that cannot reach its moved parameter is dropped without a word",
      "flagos/runtime/_tensor.py", "                owner._grad.add_(grad)\n",
      "                owner._grad.add_(grad) if owner._grad.shape == grad.shape else None\n",
      cpu("tests/test_offload.py", k="cannot_reach")),
    M("backward_probe_stops_activation", "activation's backward probe lets a route's error out "
      "(activation fails half done)", "flagos/_activation.py",
      "    except Exception as e:  # the probe is flagos's own", "    except RuntimeError as e:  # the probe is flagos's own",
      cpu("tests/test_errors.py", k="registered_after_activation")),
    M("top_loops_by_default", "flagos.tools.top() loops and prints instead of returning one frame",
      "flagos/tools/_top.py", "def top(once: bool = True,", "def top(once: bool = False,",
      cpu("tests/test_cli_top.py", k="python_call")),
    M("compare_floor_inclusive", "compare fails a module whose cosine is exactly the 0.9 floor",
      "flagos/tools/_compare.py", '    elif cosine < t["cosine_floor"]:', '    elif cosine <= t["cosine_floor"]:',
      cpu("tests/test_cli_compare.py", k="thresholds")),
    M("probe_lists_any_library", "the adapter search path lists files that are not libflagos_*.so",
      "flagos/report/_probe.py", 'n.startswith("libflagos_") and n.endswith(".so")',
      'n.startswith("libflagos_") or n.endswith(".so")', cpu("tests/test_cli_diagnose.py", k="broken_adapters")),
    M("launcher_ignores_cpu_flag", "accelerate asked for a CPU run under a launcher still gets flagos's backend",
      "flagos/integrations/_libraries.py", "        if (device is None or cpu or sagemaker_dp",
      "        if (device is None or cpu and sagemaker_dp", cpu("tests/test_accelerate.py", k="launched")),
    M("diffusers_device_map_list_untouched", "Diffusers imported first refuses device_map='flagos'",
      "flagos/integrations/_libraries.py", '    if "flagos" not in names:', '    if "flagos" in names:',
      cpu("tests/test_offload.py", k="came_first")),
    M("collective_writes_its_inputs", "a collective's read-only inputs are written back from their host copies",
      "flagos/integrations/_distributed.py", "        if written and inner is not target:",
      "        if written or inner is not target:", sim("tests/test_distributed.py", k="inputs_alone")),
    M("compare_nan_meets_inf", "compare takes NaN on one side and inf on the other as agreement",
      "flagos/tools/_compare.py", "~(a.isnan() & b.isnan())", "~(a.isnan() | b.isnan())",
      cpu("tests/test_cli_compare.py", k="thresholds")),
    M("smoke_counts_memory_in_use", "diagnose's allocate check reports all memory in use, not its own MiB",
      "flagos/tools/_smoke.py", "    grown = state.chip.memory_allocated(state.current) - before",
      "    grown = state.chip.memory_allocated(state.current) + before",
      sim("tests/test_smoke_checks.py", k="reads_as_measured")),
    M("bench_failed_row_hides_the_rest", "bench's table stops at the first chip that failed",
      "flagos/tools/_bench.py", '            errors.append(r["error"])\n            continue',
      '            errors.append(r["error"])\n            break',
      cpu("tests/test_bench_figures.py", k="every_figure")),
    M("pool_retries_once_too_few", "a failed request is tried once less than `retries` allows",
      "flagos/parallel.py", "if len(tried[job]) <= self.retries and", "if len(tried[job]) < self.retries and",
      cpu("tests/test_parallel_units.py", k="retries_on_itself")),
    M("redirect_int_index_unmapped", "in native mode `.to(0)` and `.cuda(0)` go to PrivateUse1, not the chip's device",
      "flagos/integrations/_redirect.py", "    if isinstance(device, int) and not isinstance(device, bool):",
      "    if isinstance(device, int) and isinstance(device, bool):",
      cpu("tests/test_redirect.py", k="native_mode_entry_points")),
    M("pool_busy_worker_blocks_handout", "a busy worker stops the hand-out: idle workers wait for it",
      "flagos/parallel.py", "if worker.job is not None or not pending:  # failed; a retry on the same worker\n"
      "                    continue",
      "if worker.job is not None or not pending:  # failed; a retry on the same worker\n"
      "                    break",
      cpu("tests/test_parallel_units.py", k="busy_worker")),
    M("pool_timeout_terminate_skipped", "a timed-out worker gets SIGKILL with no SIGTERM first",
      "flagos/parallel.py", "        if process.is_alive():\n            process.terminate()",
      "        if not process.is_alive():\n            process.terminate()",
      cpu("tests/test_parallel_units.py", k="past_the_timeout")),
    M("compile_hook_any_attribute", "every attribute of the device module but `Scheduling` sets up "
      "Inductor (activation imports it)",
      "flagos/integrations/_compile.py", 'if name == "Scheduling":', 'if name != "Scheduling":',
      cpu("tests/test_compile.py", k="imports_nothing")),
    M("compile_moved_graph_not_recompiled", "a graph whose only flagos trace is a device argument "
      "is moved but not recompiled (its code still makes the tensor on flagos)",
      "flagos/integrations/_compile.py", "    if moved or flagos_values:", "    if flagos_values:",
      cpu("tests/test_compile.py", k="moves_each_flagos_device")),
    M("decomposition_counts_bytes", "a decomposition run whole on a C-ABI chip counts bytes moved",
      "flagos/runtime/_adapter_ops.py",
      "self._fresh_view, out)\n            return out, NATIVE, 0, 0, 0, ()",
      "self._fresh_view, out)\n            return out, NATIVE, 0, 0, 4, ()",
      sim("tests/test_fallback_counters.py", k="never_fall_back")),
    M("round_trip_leaks_shapes", "the C round trip keeps its first tensor's shape and strides "
      "(a leak per call)", "csrc/adapter_fallback.c",
      "    for (int i = 0; i < c->n_tensors; i++) {\n        Py_CLEAR(c->t[i].dtype);",
      "    for (int i = 1; i < c->n_tensors; i++) {\n        Py_CLEAR(c->t[i].dtype);",
      cpu("tests/test_sim_fallback_c.py", k="keeps_no_memory")),
    M("sim_matmul_last_tile_row", "sim's matmul leaves out the last tile of rows of every block",
      KERNELS, "for (int64_t r = 0; r < rows; r += TILE_ROWS)",
      "for (int64_t r = 0; r < rows - TILE_ROWS; r += TILE_ROWS)",
      sim("tests/test_sim_kernels.py", k="test_mm_shapes")),
    M("sum_0dim_dims_twice", "the C fast path sums a 0-dim tensor over dims 0 and -1 (PyTorch "
      "raises: a dim named twice)", "csrc/adapter_fast.c",
      "            if (reduced[d]++)", "            if (a->ndim > 0 && reduced[d]++)",
      sim("tests/test_sim_kernels.py", k="unusual")),
    M("check_view_drops_offset", "Buffer.check_view leaves a contiguous view's offset out of its "
      "extent", "csrc/adapter_checks.c",
      "        if (__builtin_add_overflow(n, (uint64_t)offset, &n))",
      "        if (0 && __builtin_add_overflow(n, (uint64_t)offset, &n))",
      cpu("tests/test_sim_kernel_checks.py", k="view_of_a_buffer")),
    M("bool_scalar_on_the_kernel", "the runner takes a bool operand of sub for 1.0 on the kernel "
      "(PyTorch refuses subtraction with a bool)", "flagos/runtime/_adapter_ops.py",
      "    if isinstance(value, (int, float)) and not isinstance(value, (bool, torch.Tensor)):",
      "    if isinstance(value, (int, float)) and not isinstance(value, torch.Tensor):",
      sim("tests/test_sim_kernels.py", k="unusual and bool")),
    M("size_1_broadcast_in_c", "the C fast path keeps a broadcast over a size-1 dim at a stride of "
      "its own (TensorIterator gives the result's size-1 dim another stride)", "csrc/adapter_fast.c",
      "            !canonical_strides(ops, n_ops))", "            !canonical_strides(ops, n_ops) && 0)",
      sim("tests/test_sim_kernels.py", k="size_1")),
    M("deepcopy_copies_views_apart", "deepcopy copies each view's memory on its own, so copies of "
      "views of one tensor no longer share memory", "flagos/runtime/_tensor.py",
      "    copied = memo.get(key)\n    if copied is None:",
      "    copied = None\n    if copied is None:",
      cpu("tests/test_fidelity.py", k="deepcopy")),
    M("round_trip_merges_an_empty_view", "the Python round trip merges an empty view's offset into "
      "its buffer's region (more bytes moved)", "flagos/runtime/_adapter_ops.py",
      "            if span is None or span[2] <= span[1]:",
      "            if span is None or span[2] < span[1]:",
      cpu("tests/test_sim_fidelity.py", k="runner and moves_each")),
    M("round_trip_spans_an_empty_view_after", "the Python round trip takes an empty view after a "
      "non-empty one of its buffer into the buffer's region (more bytes moved)", "flagos/runtime/_adapter_ops.py",
      "            if t.numel() == 0:  # touches no byte", "            if t.numel() == -1:  # touches no byte",
      cpu("tests/test_sim_fidelity.py", k="runner and moves_each")),
    M("copy_between_overlapping_views", "copy_ between two views of one buffer that overlap in "
      "part copies instead of raising PyTorch's overlap error", "flagos/runtime/_adapter_ops.py",
      "            if _overlaps_in_part(dst, src):", "            if False and _overlaps_in_part(dst, src):",
      sim("tests/test_fidelity.py", k="views_of_one_tensor")),
    M("fill_of_an_expanded_view_refused", "fill_ of an expanded view goes through copy_, which refuses "
      "to write one element twice (PyTorch's fill_ writes it)", "flagos/runtime/_adapter_ops.py",
      "        if t.is_contiguous():\n            return self.copy_(func, (t, torch.full(",
      "        if True:\n            return self.copy_(func, (t, torch.full(",
      sim("tests/test_fidelity.py", k="fill_and_zero")),
    M("kernel_call_counts_bytes", "a call the runner runs on the chip's kernel reports a byte moved "
      "to the host", "flagos/runtime/_adapter_ops.py",
      "            if out is not NotImplemented:\n                return out, NATIVE, 0, 0, 0, ()",
      "            if out is not NotImplemented:\n                return out, NATIVE, 1, 0, 0, ()",
      cpu("tests/test_sim_fidelity.py", k="move_no_bytes")),
    M("set_to_a_tensor_copies", "t.set_(source) on a C-ABI chip takes the host round trip, which gives "
      "t a copy instead of source's memory", "flagos/runtime/_adapter_ops.py",
      '    "aten::set_.source_Tensor": Runner.set_,\n', "",
      sim("tests/test_fidelity.py", k="set_to_another")),
    M("share_memory_of_a_buffer", "share_memory_() of a C-ABI chip's tensor shares its meta stand-in "
      "storage as host memory (and fails)", "flagos/runtime/_tensor.py",
      "        if not isinstance(self._payload, torch.Tensor):\n            return self",
      "        if False:\n            return self",
      sim("tests/test_fidelity.py", k="share_memory")),
    M("copy_copy_copies_the_values", "copy.copy of a flagos tensor copies its values (through the host) "
      "instead of sharing its memory", "flagos/runtime/_tensor.py",
      "    def __copy__(self):", "    def _unused_copy(self):",
      cpu("tests/test_fidelity.py", k="copy_copy")),
    M("runner_stages_over_the_threshold", "the runner's round trip stages a region from one byte "
      "over the staging threshold on, not from the threshold itself", "flagos/runtime/_adapter_ops.py",
      "            if stage and n >= _C.STAGING_MIN_BYTES:",
      "            if stage and n > _C.STAGING_MIN_BYTES:",
      sim("tests/test_fallback_staging.py", k="stages_large")),
    M("upload_makes_results_contiguous", "a host result with gaps (new_empty_strided's) comes to "
      "the chip contiguous, not laid out as on the CPU", "flagos/runtime/_adapter_ops.py",
      "        host = _physical(host)\n        if stride is not None and",
      "        host = _physical(host).contiguous()\n        if stride is not None and",
      sim("tests/test_sim_fidelity.py", k="layouts_and_result")),
    M("c_stages_over_the_threshold", "the C round trip stages a copy from one byte over the "
      "staging threshold on, not from the threshold itself", "csrc/staging.c",
      "    if (nbytes < FLAGOS_STAGING_MIN_BYTES || init_torch() < 0)",
      "    if (nbytes <= FLAGOS_STAGING_MIN_BYTES || init_torch() < 0)",
      cpu("tests/test_fallback_staging.py", k="threshold"),
      more=[("csrc/staging.c", "        return nbytes < FLAGOS_STAGING_MIN_BYTES ? Py_NewRef(Py_None) : NULL;",
             "        return nbytes <= FLAGOS_STAGING_MIN_BYTES ? Py_NewRef(Py_None) : NULL;")]),
    M("save_copies_each_view", "torch.save writes each flagos tensor as a copy of its own, not the "
      "memory it shares with others once", "flagos/runtime/_tensor.py",
      "            host = _storage.host_view_for_save(self)", "            host = None",
      sim("tests/test_device.py", k="save_writes")),
    M("parameter_saved_as_a_tensor", "a flagos Parameter is saved as a plain tensor (it loads as "
      "one, and a saved module loses its parameters)", "flagos/runtime/_tensor.py",
      "        if isinstance(self, torch.nn.Parameter):  # a Parameter loads as one",
      "        if False:  # a Parameter loads as one", cpu("tests/test_device.py", k="save_writes")),
    M("lstm_gates_swapped", "the fused LSTM cell of a chip without one mixes up its input and "
      "forget gates", "flagos/runtime/_sequences.py",
      "    cy = forgetgate * cx + ingate * cellgate",
      "    cy = ingate * cx + forgetgate * cellgate",
      cpu("tests/test_sequence_models.py", k="rnns_match_cpu and lstm and not gru and no_grad")),
    M("gru_hidden_bias_outside_reset", "the fused GRU cell adds the hidden bias of the new gate "
      "outside the reset gate's product", "flagos/runtime/_sequences.py",
      "    newgate = (i_new + resetgate * h_new).tanh()",
      "    newgate = (i_new + resetgate * (h_new - hidden_bias.chunk(3)[2]) + hidden_bias.chunk(3)[2]).tanh()",
      sim("tests/test_sequence_models.py", k="rnns_match_cpu and gru-no_grad")),
    M("batch_sizes_on_the_chip", "a packed sequence's batch sizes come back on flagos (PackedSequence "
      "refuses them)", "flagos/core/_schema.py",
      "    if packet_name(name) in HOST_SECOND_OUTPUT_OPS:", "    if False:",
      cpu("tests/test_sequence_models.py", k="packed and GRU and no_grad")),
    M("ctc_lengths_as_tensors", "ctc_loss with host length tensors takes PyTorch's path for tensor "
      "subclasses (a mixed-device division)", "flagos/runtime/_sequences.py",
      '        _ctc_lib.impl("ctc_loss.Tensor", ctc_loss, "AutogradPrivateUse1")', "        pass",
      cpu("tests/test_sequence_models.py", k="ctc and host and mean and grad")),
    M("quantized_result_uploaded", "a quantized result on a C-ABI chip reaches the upload (a "
      "DLPack BufferError instead of the way out)", "flagos/runtime/_adapter_ops.py",
      "    if t.is_quantized:", "    if False:", sim("tests/test_fidelity.py", k="quantized")),
    M("nested_tensor_from_a_mask", "nn.TransformerEncoder's nested tensor reaches the router "
      "(PyTorch's internal error instead of the way out)", "flagos/core/_schema.py",
      "    if packet_name(name) in NESTED_OPS:", "    if False:",
      cpu("tests/test_sequence_models.py", k="transformer_encoder")),
    M("ctc_bool_lengths_accepted", "ctc_loss takes boolean or complex length tensors as lengths "
      "(CPU says they must be integral)", "flagos/runtime/_sequences.py",
      "        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:",
      "        if lengths.is_floating_point() or lengths.is_complex() and lengths.dtype == torch.bool:",
      cpu("tests/test_sequence_models.py", k="not_integers")),
    M("lazy_parameter_initialized_on_move", "a lazy module's uninitialized parameter moved to flagos "
      "comes out an empty initialized tensor (its first forward never gives it a shape)",
      "flagos/integrations/_lazy_params.py",
      "        result.__class__ = _on_flagos(cls)\n", "        pass\n",
      cpu("tests/test_module_kinds.py", k="lazy_module_moved and module.to")),
    M("scripted_slots_left_on_the_host", "a scripted module's .to() leaves its C++ slots holding "
      "the host tensors", "flagos/integrations/_offload.py",
      "            self._c.setattr(name, param)", "            pass",
      cpu("tests/test_module_kinds.py", k="scripted")),
    M("user_subclass_refused", "a tensor subclass of the program cannot hold a flagos tensor "
      "(PyTorch's as_subclass)", "flagos/runtime/_tensor.py",
      "        if issubclass(FlagosTensor, cls):  # torch.Tensor, FlagosTensor: PyTorch's own answer",
      "        if True:",
      cpu("tests/test_fidelity.py", k="subclasses_of_the_program")),
    M("legacy_load_reads_before_the_bytes", "a legacy-format checkpoint of flagos tensors is "
      "moved before its bytes are read (PyTorch's own rebuild)", "flagos/runtime/_storage.py",
      "    torch._utils._rebuild_device_tensor_from_cpu_tensor = _rebuild_device_tensor",
      "    pass", cpu("tests/test_device.py", k="either_format and legacy")),
    M("efficient_zeros_kept", "forward-mode AD's efficient zero tensors become payloads that hold "
      "no memory", "flagos/runtime/_payload_rules.py",
      "        kernels.update(PAYLOAD_KERNELS)", "        pass",
      cpu("tests/test_models.py", k="forward_mode_gradients_through")),
    M("trainer_batches_on_the_host", "transformers' TrainingArguments.device stays the host while "
      "the Trainer's accelerate puts the model on flagos", "flagos/integrations/_libraries.py",
      '    "transformers.training_args": _transformers_training_args,', "",
      cpu("tests/test_accelerate.py", k="trainer")),
    M("data_parallel_host_inputs_refused", "nn.DataParallel's scatter of a host input to flagos "
      "devices takes PyTorch's missing CUDA function", "flagos/integrations/_data_parallel.py",
      '    return (isinstance(first, torch.Tensor) and first.device.type == "cpu"',
      '    return (isinstance(first, torch.Tensor) and first.device.type == "meta"',
      sim("tests/test_module_kinds.py", k="data_parallel")),
    M("dlpack_exports_the_wrapper", "a flagos tensor's DLPack export is the wrapper, which owns no "
      "memory", "flagos/runtime/_tensor.py",
      "        return self.dlpack_source().__dlpack__(**kwargs)",
      "        return torch.Tensor.__dlpack__(self, **kwargs)",
      cpu("tests/test_ecosystem.py", k="dlpack")),
    M("memoryless_tensor_recurses", "a plain tensor on the flagos device (PyTorch's import of the "
      "wrapper's capsule) is copied to the payload device without end", "csrc/payload.c",
      "    if (i >= 0 && Py_TYPE(t) == (PyTypeObject *)st->tensor_type) {",
      "    if (i >= 0 && Py_TYPE(t) == (PyTypeObject *)st->wrapper_type) {",
      cpu("tests/test_ecosystem.py", k="capsule")),
    M("no_deferring_to_dispatch_subclasses", "flagos routes an op that holds another tensor "
      "subclass with its own __torch_dispatch__ instead of answering NotImplemented",
      "csrc/module.c", "    if (PyTuple_Check(types) && PyTuple_GET_SIZE(types) > 1) {",
      "    if (PyTuple_Check(types) && PyTuple_GET_SIZE(types) > 99) {",
      cpu("tests/test_fidelity.py", k="dispatch_subclass or jagged")),
    M("current_device_of_the_process", "the current device is the process's, not each thread's: "
      "a thread serving flagos:1 moves the others", "flagos/core/_state.py",
      "        self._thread.index = index", "        type(self._thread).index = index",
      cpu("tests/test_multi_device.py", k="each_threads")),
    M("flagos_frames_traced_until_a_flagos_tensor", "Dynamo traces flagos's own frames in a "
      "compilation over host tensors (its guards ask flagos's torch.accelerator for the stream "
      "without end)", "flagos/integrations/_libraries.py",
      '    "torch._dynamo.trace_rules": _tracing.skip_flagos_frames,\n', "",
      cpu("tests/test_compile.py", k="host_model_beside")),
    M("flex_attention_backward_allowed_on_the_cpu_chip", "flex_attention's device check reads "
      "the payloads without their requires_grad: the cpu chip runs a backward the CPU refuses",
      "flagos/integrations/_flex_attention.py",
      "    return payload.new_empty(0).requires_grad_(tensor.requires_grad)",
      "    return payload.new_empty(0)",
      cpu("tests/test_flex_attention.py", k="payload_devices_rule")),
    M("flex_attention_autocast_uncast", "under torch.autocast(\"flagos\") flex_attention runs in "
      "float32 where PyTorch casts query, key and value", "flagos/integrations/_flex_attention.py",
      "        query, key, value = (cast_for_autocast(t, device_type, dtype) for t in (query, key, value))\n",
      "", cpu("tests/test_flex_attention.py", k="autocast")),
    M("accelerate_fp16_scaler_of_cuda", "accelerate's fp16 on flagos gets CUDA's GradScaler, which "
      "turns itself off without CUDA (no loss scaling)", "flagos/integrations/_libraries.py",
      "        return torch.amp.GradScaler(device.type, **kwargs)",
      "        return torch.amp.GradScaler(\"cuda\", **kwargs)",
      cpu("tests/test_accelerate.py", k="fp16")),
    M("oom_text_libraries_miss", "a C-ABI chip's out-of-memory error lacks the \" out of memory.\" "
      "that accelerate's batch-size search looks for", "csrc/adapter_checks.c",
      '"%s device %d out of memory.%s %s (code %d): %s. Free tensors you no "',
      '"%s device %d is out of memory%s %s (code %d): %s. Free tensors you no "',
      cpu("tests/test_accelerate.py", k="find_executable")),
    M("legacy_cuda_type_on_the_host", "torch.cuda.FloatTensor(data) under the redirect stays on "
      "the host", "flagos/integrations/_redirect.py",
      "        return getattr(torch, cls.__name__)(*args).to(target)  # the host type, then the chip",
      "        return getattr(torch, cls.__name__)(*args)",
      cpu("tests/test_redirect.py", k="gan or LongTensor")),
    M("process_group_without_a_name", "the flagos process group keeps no name: DeviceMesh, "
      "DTensor and FSDP2 find none (\"ProcessGroup name not set\")", "flagos/integrations/_distributed.py",
      "        self._name = name\n", "        self._name = None\n",
      cpu("tests/test_distributed.py", k="mesh")),
    M("collective_results_left_registered", "a functional collective's host result on a C-ABI chip "
      "is never waited on: the work registry keeps it to the end of the process",
      "flagos/runtime/_adapter_ops.py", "                torch.ops._c10d_functional.wait_tensor(t)\n",
      "                pass\n", sim("tests/test_distributed.py", k="mesh")),
    M("subclass_result_uploaded_as_is", "a host result that is a wrapper subclass (DTensor's "
      "AsyncCollectiveTensor) is uploaded as if it had memory", "flagos/runtime/_adapter_ops.py",
      "        host = host.clone()  # through the subclass's own dispatch: a plain tensor\n",
      "        pass\n", sim("tests/test_distributed.py", k="mesh")),
    M("stand_in_storage_unguarded", "a C-ABI chip's stand-in storage read or resized gives "
      "PyTorch's \"Trying to resize storage that is not resizable\"", "flagos/runtime/_storage.py",
      '        return storage.device.type == "meta" and storage.data_ptr() != 0',
      '        return storage.device.type == "meta" and storage.data_ptr() == 0',
      sim("tests/test_ecosystem.py", k="storage_names")),
    M("library_kernel_for_the_device_not_called", "a kernel registered for the flagos device "
      "through torch.library is not called (the op takes the chip's kernel or the fallback)",
      "flagos/core/_routes.py",
      "        override = _device_kernel_for(name)\n", "",
      cpu("tests/test_routes.py", k="torch_library or only_a_kernel or come_before")),
    M("library_kernel_given_payloads", "the device's own kernel is called with the chip's "
      "tensors instead of the flagos tensors", "csrc/router.c",
      "    *on_device = route == ROUTE_OVERRIDE && device_kernel;",
      "    *on_device = 0;",
      cpu("tests/test_routes.py", k="torch_library or only_a_kernel")),
    M("whole_op_always_decomposed", "silu_backward and the like decomposed above flagos even "
      "when no gradient of them is needed", "flagos/runtime/_whole_ops.py",
      "        if _needs_gradient(args, kwargs):", "        if True:",
      cpu("tests/test_fidelity.py", k="whole_as_on_cpu")),
    M("decomposed_views_keep_autograd_state", "the views a decomposition makes under inference "
      "mode on a C-ABI chip are returned as made, with autograd's view metadata",
      "flagos/runtime/_adapter_ops.py",
      "                out = pytree.tree_map_only(FlagosTensor, self._fresh_view, out)\n",
      "                pass\n",
      sim("tests/test_fidelity.py", k="parameter_under_inference")),
    M("shallow_copy_asks_equal_keys", "a C-ABI chip answers _has_compatible_shallow_copy_type by "
      "dispatch keys, refusing an inference tensor for a normal one", "flagos/runtime/_adapter_ops.py",
      '    "aten::_has_compatible_shallow_copy_type": Runner.shallow_copy_compatible,\n', "",
      sim("tests/test_fidelity.py", k="first_runs_under_inference")),
    M("cpu_lstm_layer_not_autocast", "nn.LSTM under the CPU's autocast policy runs its cells in "
      "float32 where the CPU's oneDNN layer gives bfloat16", "flagos/runtime/_autocast.py",
      '    if source == "AutocastCPU":', "    if False:",
      cpu("tests/test_autocast.py", k="lstm")),
    M("autocast_lower_policy_keeps_float32", "autocast's lower-precision ops (linear, conv) "
      "leave float32 inputs uncast, so the module runs in float32 where CPU's runs in the "
      "autocast dtype", "flagos/runtime/_autocast.py",
      "cast = lambda t: t.to(target) if t.dtype == torch.float32 else t",
      "cast = lambda t: t.to(target) if t.dtype == torch.float64 else t",
      sim("tests/test_module_db.py", k="autocast and (Linear or Conv2d)")),
    M("gather_outputs_read_to_host", "all_gather_into_tensor copies its output's old contents "
      "to the host before overwriting them", "flagos/integrations/_distributed.py",
      "group._allgather_base(moved.one(output, True, read=False)",
      "group._allgather_base(moved.one(output, True, read=True)",
      sim("tests/test_distributed.py", k="copies_its_inputs")),
    M("route_of_unknown_op_raises", "route_of an op no library has defined yet raises "
      "PyTorch's 'does not exist' instead of answering its route", "flagos/core/_routes.py",
      "    except RuntimeError:  # not an operator the dispatcher knows by that name",
      "    except ValueError:  # not an operator the dispatcher knows by that name",
      cpu("tests/test_routes.py", k="no_library_has_defined")),
    M("dlpack_host_copy_only_without_copy_flag", "a C-ABI chip's tensor exported to the host "
      "with copy=True is refused, and with copy=False copied anyway", "flagos/runtime/_tensor.py",
      'and kwargs.get("copy") is not False):', 'and kwargs.get("copy") is not True):',
      sim("tests/test_ecosystem.py", k="dlpack_exports")),
    M("whole_ops_decomposed_without_gradients", "ops CPU runs whole are decomposed under grad "
      "mode even when no input requires a gradient", "flagos/runtime/_whole_ops.py",
      "isinstance(t, torch.Tensor) and t.requires_grad for t in",
      "isinstance(t, torch.Tensor) or t.requires_grad for t in",
      cpu("tests/test_fidelity.py", k="reach_the_chip_whole")),
    M("dlpack_import_aliases_when_copy_asked", "torch.from_dlpack(t, device=t.device, copy=True) "
      "of a C-ABI chip's tensor shares its memory", "flagos/integrations/_dlpack.py",
      "return tensor.detach().clone() if copy else tensor.detach()",
      "return tensor.detach()",
      sim("tests/test_ecosystem.py", k="dlpack_exports")),
    M("lstm_autocast_empty_batch_takes_onednn", "an LSTM on an empty batch under bfloat16 "
      "autocast takes oneDNN's layer, which the CPU never does for it", "flagos/runtime/_autocast.py",
      "and not projections and input.numel() != 0 and input.dtype == torch.float32):",
      "and not projections and input.numel() != -1 and input.dtype == torch.float32):",
      cpu("tests/test_autocast.py", k="lstm_under")),
    M("analyze_signal_one_read_as_exit_status", "a script ended by signal 1 before its report "
      "is said to have failed with exit status -1", "flagos/tools/_analyze.py",
      'how = f"was ended by signal {-status}" if status < 0 else',
      'how = f"was ended by signal {-status}" if status < -1 else',
      cpu("tests/test_cli_analyze.py", k="without_flagos_gives_no_report")),
    M("conj_view_saved_without_its_bit", "a conjugate view saved from flagos writes its memory "
      "without the conjugate bit", "flagos/runtime/_tensor.py",
      "        if not (self.is_neg() or self.is_conj() or _tracing.compiling()):",
      "        if not (self.is_neg() or self.is_conj() and _tracing.compiling()):",
      cpu("tests/test_device.py", k="negative_views")),
    M("refusal_names_the_keyset", "the sparse layouts' refusal is registered with the keyset, "
      "so its message names the keyset instead of the op", "flagos/runtime/_registration.py",
      "        _factory_lib.fallback(_sparse_unsupported, dispatch_key=key, with_keyset=False)",
      "        _factory_lib.fallback(_sparse_unsupported, dispatch_key=key, with_keyset=True)",
      cpu("tests/test_fidelity.py", k="sparse_tensors_get")),
    M("weights_only_allowlist_stale", "a weights_only load before activation keeps PyTorch's "
      "rebuild in flagos's stead", "flagos/runtime/_storage.py",
      '    if hasattr(allowed, "cache_clear"):', '    if not hasattr(allowed, "cache_clear"):',
      cpu("tests/test_device.py", k="weights_only_load_of")),
    M("exit_drain_forgets_earlier_threads", "a drain waits only for its own thread, not for one an "
      "earlier drain left in the engine (an abort at exit)", "flagos/integrations/_engine_exit.py",
      "    for waiting in _workers:", "    for waiting in [worker]:",
      cpu("tests/test_backward_errors.py", k="gives_up_after")),
    M("short_table_read_as_whole", "a table too short to hold its ABI version is read as a "
      "whole table", ADAPTER_LOAD,
      "    if (api == NULL || api->struct_size < offsetof(flagos_adapter, abi_minor)",
      "    if (api == NULL && api->struct_size < offsetof(flagos_adapter, abi_minor)",
      cpu("tests/test_adapter_loader.py", k="entry_point_without and not NULL")),
    M("guard_type_takes_arguments", "the device guard's type_() accepts positional or keyword "
      "arguments alone", "csrc/guard.c",
      "    if (PyTuple_GET_SIZE(args) != 0 || (kwargs",
      "    if (PyTuple_GET_SIZE(args) != 0 && (kwargs",
      cpu("tests/test_backward_errors.py", k="cyclic_collector")),
    M("router_trusts_a_device_index", "an op on a flagos tensor naming flagos:N past the chip's "
      "devices reads past the device table", "csrc/payload.c",
      "    if (i < 0 || i >= PyTuple_GET_SIZE(st->chip_devices)) {", "    if (0) {",
      sim("tests/test_errors.py", k="nonexistent_device_index")),
    M("fork_hooks_pile_up", "each activation registers another fork hook (they cannot be "
      "removed)", "flagos/_activation.py",
      "        _fork_hook_registered = True", "        _fork_hook_registered = False",
      cpu("tests/test_errors.py", k="fork_hook")),
]


# ---- the scratch tree ----------------------------------------------------------------------

def sh(cmd, cwd, env=None, quiet=True) -> subprocess.CompletedProcess:
    return subprocess.run(["nice", "-n", "10", *cmd], cwd=cwd, env=env, text=True,
                          capture_output=quiet)


def make_scratch() -> str:
    work = tempfile.mkdtemp(prefix="flagos-mutants-")
    for item in COPIED:
        src = os.path.join(ROOT, item)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(work, item),
                            ignore=shutil.ignore_patterns("*.so", "__pycache__", "build"))
        elif os.path.exists(src):
            shutil.copy2(src, work)
    return work


def build(work: str) -> subprocess.CompletedProcess:
    return sh([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], work)


def built_libraries(work: str) -> list[str]:
    out = []
    for folder in ("flagos", os.path.join("flagos", "adapters")):
        out += [os.path.join(folder, f) for f in os.listdir(os.path.join(work, folder)) if f.endswith(".so")]
    return out


def check_edits(work: str) -> list[str]:
    """Every mutation's original text occurs exactly once: else the code drifted."""
    problems = []
    for m in MUTATIONS:
        for path, original, _ in m.edits:
            text = open(os.path.join(work, path)).read()
            n = text.count(original)
            if n != 1:
                problems.append(f"{m.name}: {path}: original text found {n} times (expected once):\n"
                                f"    {original!r}")
    return problems


def test_env(work: str, run: Run) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    env.update(PYTHONPATH=work, FLAGOS_TEST_CHIP=run.chip, **dict(run.env))
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a restored module must never run from a mutant's .pyc
    return env


def pytest_run(work: str, run: Run) -> tuple[int, str, float]:
    # the order pytest collects: the baseline and every mutant run the same tests in one order
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           *run.paths]
    if run.k:
        cmd += ["-k", run.k]
    t0 = time.monotonic()
    proc = sh(cmd, work, test_env(work, run))
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, tail[-1] if tail else "", time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip running the selections on the unmutated tree first")
    parser.add_argument("--keep", action="store_true", help="keep the scratch tree")
    opts = parser.parse_args()
    chosen = [m for m in MUTATIONS if not opts.only or m.name in opts.only]
    if opts.list:
        for m in MUTATIONS:
            print(f"{m.name:30} {m.what}\n{'':30} " + "; ".join(r.label() for r in m.runs))
        return 0
    if opts.only and len(chosen) != len(opts.only):
        unknown = set(opts.only) - {m.name for m in MUTATIONS}
        sys.exit(f"unknown mutation(s): {', '.join(sorted(unknown))} (see --list)")

    started = time.monotonic()
    work = make_scratch()
    try:
        problems = check_edits(work)
        if problems:
            print("The code drifted from these mutations; update scripts/mutation_check.py:",
                  *problems, sep="\n", file=sys.stderr)
            return 2
        b = build(work)
        if b.returncode != 0:
            print(b.stdout, b.stderr, file=sys.stderr)
            sys.exit("the unmutated scratch tree does not build")
        probe = sh([sys.executable, "-c", "import flagos._C as c; print(c.__file__)"], work,
                   test_env(work, Run("cpu", ())))
        if not probe.stdout.startswith(work):
            sys.exit(f"flagos._C does not come from the scratch tree: {probe.stdout}{probe.stderr}")
        pristine = {lib: open(os.path.join(work, lib), "rb").read() for lib in built_libraries(work)}

        if not opts.no_baseline:
            for run in dict.fromkeys(r for m in chosen for r in m.runs):
                rc, last, secs = pytest_run(work, run)
                print(f"baseline  {run.label()}: {last} ({secs:.0f} s)", flush=True)
                if rc != 0:
                    sys.exit(f"baseline failed (exit {rc}): the unmutated tree must pass {run.label()}")

        results = []
        for m in chosen:
            t0 = time.monotonic()
            originals = {}
            for path, original, replacement in m.edits:
                full = os.path.join(work, path)
                originals.setdefault(full, open(full).read())
                text = open(full).read()
                with open(full, "w") as f:
                    f.write(text.replace(original, replacement, 1))
            status, detail = "survived", ""
            try:
                if any(p.endswith((".c", ".h")) for p, _, _ in m.edits):
                    b = build(work)
                    if b.returncode != 0:
                        status, detail = "error", "build failed: " + (b.stderr or b.stdout)[-300:]
                if status != "error":
                    for run in m.runs:
                        rc, last, _ = pytest_run(work, run)
                        if rc == 1:
                            status, detail = "caught", f"{run.label()}: {last}"
                            break
                        if rc != 0:
                            status, detail = "error", f"{run.label()}: pytest exit {rc}: {last}"
                            break
                        detail = f"{run.label()}: {last}"
            finally:
                for full, text in originals.items():
                    with open(full, "w") as f:
                        f.write(text)
                for lib, data in pristine.items():  # back to the unmutated build, newer than its sources
                    with open(os.path.join(work, lib), "wb") as f:
                        f.write(data)
            secs = time.monotonic() - t0
            results.append((m, status, secs, detail))
            print(f"{status:8}  {m.name:30} {secs:5.0f} s  {detail}", flush=True)
    finally:
        if opts.keep:
            print(f"scratch tree kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    total = time.monotonic() - started
    caught = sum(1 for _, s, _, _ in results if s == "caught")
    print(f"\n{caught} of {len(results)} mutations caught in {total / 60:.1f} min "
          f"({time.strftime('%Y-%m-%d %H:%M %Z')})\n")
    print("| mutation | bug | result | seconds |\n|---|---|---|---|")
    for m, status, secs, _ in results:
        print(f"| `{m.name}` | {m.what} | {status} | {secs:.0f} |")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
