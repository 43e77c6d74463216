"""Which tests run against a mutant of each source file: the one place that maps flagos's
Python modules (scripts/mutation_full.sh) and C files (scripts/mutation_c.py) to test
selections.

Every Python file under flagos/ and every C file under csrc/ and backends/ needs an entry:
both scripts stop before running anything when a file has none (`unmapped()`), so a new module
gets its tests named here. A selection is one or more pytest runs (`cpu(...)` or `sim(...)`,
with an optional -k); a mutant is killed when any of them fails. Keep the selections to the
tests that exercise the file: every surviving mutant pays for the whole selection.
"""
from __future__ import annotations

import glob
import os

from mutation_check import ROOT, SIM_ALL, Run, cpu, opencl, sim, sim_default

__all__ = ["TESTS", "Run", "cpu", "sim", "tests_for", "unmapped", "source_files"]

T = "tests/test_"
ROUTES, POLICY, COUNTERS = T + "routes.py", T + "policy.py", T + "fallback_counters.py"
DEVICE, ERRORS, FIDELITY = T + "device.py", T + "errors.py", T + "fidelity.py"
ENV, ENV_DOCS, VERSIONS = T + "env.py", T + "env_docs.py", T + "versions.py"
SIM_TESTS, SIM_FIDELITY, KERNELS = T + "sim.py", T + "sim_fidelity.py", T + "sim_kernels.py"
STREAMS, MULTI, NATIVE = T + "streams.py", T + "multi_device.py", T + "native_mode.py"
ADAPTERS, LOADER, AUTOLOAD = T + "adapters.py", T + "adapter_loader.py", T + "autoload.py"
ANALYZE, BENCH, COMPARE = T + "cli_analyze.py", T + "cli_bench.py", T + "cli_compare.py"
DEVICES, DIAGNOSE, TOP = T + "cli_devices.py", T + "cli_diagnose.py", T + "cli_top.py"
METRICS, HTML, ECOSYSTEM = T + "metrics.py", T + "report_html.py", T + "ecosystem.py"
GENERATORS, OFFLOAD, ACCELERATE = T + "generators.py", T + "offload.py", T + "accelerate.py"
AUTOCAST, COMPILE, BACKWARD = T + "autocast.py", T + "compile.py", T + "backward_errors.py"
MODELS, KERNEL_CHECKS = T + "models.py", T + "sim_kernel_checks.py"
CHIP_NAMES, CHIP_PROFILES, PACKAGE = T + "chip_names.py", T + "chip_profiles.py", T + "package.py"
DISTRIBUTED, SEQUENCES, MODULE_KINDS = T + "distributed.py", T + "sequence_models.py", T + "module_kinds.py"

TESTS: dict[str, list[Run]] = {
    # ---- the Python package ----
    "flagos/__init__.py": [cpu(DEVICE, ERRORS, PACKAGE)],
    "flagos/__main__.py": [cpu(DEVICES)],
    # the layers' __init__ files hold a docstring only: nothing to mutate, listed to say so
    "flagos/core/__init__.py": [cpu(DEVICE)],
    "flagos/runtime/__init__.py": [cpu(DEVICE)],
    "flagos/integrations/__init__.py": [cpu(DEVICE)],
    "flagos/report/__init__.py": [cpu(DEVICE)],
    "flagos/runtime/_adapter_ops.py": [sim(SIM_TESTS, COUNTERS, SIM_FIDELITY, ROUTES, KERNELS,
                                           T + "fallback_staging.py", T + "sim_fallback_c.py"),
                                       sim(T + "sharding.py", k="bytes_between"),
                                       # the kernel cases again with the C fast path off (tests/conftest.py)
                                       Run("sim", (KERNELS,), "", (*SIM_ALL.items(), ("FLAGOS_TEST_RUNNER_ONLY", "1"))),
                                       sim(MODELS, k="inference_mode"),
                                       sim(DISTRIBUTED, k="mesh"),
                                       sim(FIDELITY, k="inference_mode or views_of_one_tensor or fill_and_zero or set_to"),
                                       sim(POLICY, k="declining"),
                                       sim(ECOSYSTEM, k="capsule"), sim(ERRORS, k="meta_tensors"),
                                       sim(SEQUENCES, k="inference or packed")],
    "flagos/runtime/_attention.py": [cpu(T + "attention_backends.py"), cpu(MODELS, k="attention"),
                                     cpu(COMPILE, k="attention"), sim(MODELS, k="attention")],
    "flagos/runtime/_autocast.py": [cpu(AUTOCAST), sim(AUTOCAST)],
    "flagos/_autoload.py": [cpu(AUTOLOAD, CHIP_NAMES)],
    "flagos/integrations/_backward_errors.py": [cpu(BACKWARD), cpu(MULTI, k="engine or backward"), sim(MULTI, k="engine or backward")],
    "flagos/integrations/_engine_exit.py": [cpu(BACKWARD, k="exit"), sim(BACKWARD, k="exit")],
    "flagos/integrations/_compile.py": [cpu(COMPILE)],
    "flagos/runtime/_device_module.py": [cpu(DEVICE, MULTI, T + "device_module.py"), sim(STREAMS)],
    "flagos/core/_env.py": [cpu(ENV_DOCS, ENV, ERRORS)],
    "flagos/core/_callers.py": [cpu(ROUTES, k="unwritable"), cpu(T + "cache_dirs.py", k="unusable")],
    # sim with its default dtypes: the policy acts where bfloat16 is not native
    "flagos/core/_precision.py": [cpu(T + "precision_policy.py"), sim_default(T + "precision_policy.py")],
    "flagos/report/_exporters.py": [cpu(TOP, T + "exporters.py")],
    "flagos/runtime/_generator.py": [cpu(GENERATORS), sim(GENERATORS)],
    "flagos/runtime/_storage.py": [cpu(ERRORS, k="storage"), cpu(DEVICE, T + "redirect.py", k="load or save"),
                                   sim(ERRORS, k="storage"), sim(DEVICE, k="load or save"),
                                   sim(FIDELITY, k="subclasses_of_the_program"),  # pickle outside a save
                                   sim(ECOSYSTEM, k="storage_names")],
    "flagos/runtime/_sequences.py": [cpu(SEQUENCES), sim(SEQUENCES)],
    "flagos/runtime/_whole_ops.py": [cpu(FIDELITY, k="whole_as_on_cpu or double_backward_decomposes or channel_shuffle or reach_the_chip_whole or dispatchers"),
                                     sim(FIDELITY, k="whole_as_on_cpu or double_backward_decomposes or channel_shuffle or reach_the_chip_whole or dispatchers")],
    "flagos/integrations/_libraries.py": [cpu(ACCELERATE, OFFLOAD), cpu(DISTRIBUTED, k="accelerate or ddp"),
                                          cpu(COMPILE, k="host_model_beside"),
                                          cpu(T + "flex_attention.py", k="grouped"),
                                          sim(ECOSYSTEM, ACCELERATE)],
    "flagos/integrations/_caches.py": [cpu(T + "cache_dirs.py")],
    "flagos/parallel.py": [cpu(T + "parallel_units.py", T + "parallel.py"), sim(T + "parallel_units.py", T + "parallel.py")],
    "flagos/runtime/_transfers.py": [cpu(T + "sharding.py"), sim(T + "sharding.py")],
    "flagos/tools/_cache.py": [cpu(T + "cache_dirs.py", k="cli or python_call")],
    "flagos/integrations/_distributed.py": [cpu(DISTRIBUTED, k="not recipe"), sim(DISTRIBUTED, k="not recipe")],
    "flagos/runtime/_math_keys.py": [cpu(FIDELITY), sim(SIM_FIDELITY, FIDELITY)],
    "flagos/runtime/_native_mode.py": [cpu(NATIVE)],
    "flagos/integrations/_redirect.py": [cpu(T + "redirect.py"), sim(T + "redirect.py")],
    "flagos/integrations/_offload.py": [cpu(OFFLOAD, MODULE_KINDS), sim(OFFLOAD, MODULE_KINDS),
                                        cpu(FIDELITY, k="first_runs_under_inference"),
                                        sim(FIDELITY, k="first_runs_under_inference")],
    "flagos/integrations/_lazy_params.py": [cpu(MODULE_KINDS), sim(MODULE_KINDS)],
    "flagos/integrations/_data_parallel.py": [cpu(MODULE_KINDS, k="data_parallel"), sim(MODULE_KINDS, k="data_parallel")],
    "flagos/integrations/_dlpack.py": [cpu(ECOSYSTEM, k="dlpack"), sim(ECOSYSTEM, k="dlpack")],
    "flagos/integrations/_flex_attention.py": [cpu(T + "flex_attention.py"), sim(T + "flex_attention.py")],
    "flagos/runtime/_payload_rules.py": [cpu(CHIP_PROFILES, k="payload_rules"), cpu(MODELS, k="forward_mode")],
    "flagos/runtime/_pinned.py": [cpu(ECOSYSTEM, k="pin"), sim(ECOSYSTEM, k="pin")],
    "flagos/runtime/_registration.py": [cpu(DEVICE, ERRORS, NATIVE), cpu(FIDELITY, k="sparse or quantized or flagos_scalars"),
                                        cpu(SEQUENCES, k="transformer"),
                                        sim(STREAMS, k="accelerator"), cpu(STREAMS, k="release_gives")],
    "flagos/report/_report.py": [cpu(ROUTES, COUNTERS, HTML), sim_default(T + "precision_policy.py", k="downcast")],
    "flagos/report/_html.py": [cpu(HTML)],
    "flagos/core/_routes.py": [cpu(ROUTES, POLICY), cpu(ENV, k="route"), cpu(ERRORS, k="environment")],
    "flagos/_activation.py": [cpu(DEVICE, ERRORS, VERSIONS, ENV, CHIP_NAMES, CHIP_PROFILES),
                              cpu(LOADER, k="detected_when_it_has_a_device"),
                              cpu(T + "precision_policy.py", k="from_the_environment or native_mode or "
                                                                 "switching_back or bad_dtype_policy"),
                              cpu(NATIVE, k="deactivate or default_mode"),
                              cpu(T + "redirect.py", k="installing_again"),
                              cpu(COMPILE, k="report_counts or layout_and_bits"),
                              # what activation installs in device mode for the libraries
                              cpu(ACCELERATE, k="partial_state_and_accelerator_pick_flagos"),
                              cpu(ECOSYSTEM, k="dlpack_exports")],
    "flagos/core/_schema.py": [cpu(ROUTES, POLICY, COUNTERS, FIDELITY, BACKWARD, SEQUENCES),
                               sim(COUNTERS, FIDELITY, SEQUENCES),
                               sim_default(T + "precision_policy.py"), cpu(T + "conformance.py")],
    "flagos/runtime/_streams.py": [sim(STREAMS), cpu(STREAMS)],
    "flagos/runtime/_iterator_layout.py": [cpu(T + "iterator_layout.py"),
                                           sim(KERNELS, k="layout or gapped or size_1 or broadcast")],
    "flagos/runtime/_tensor.py": [cpu(DEVICE, FIDELITY, OFFLOAD, MODULE_KINDS), sim(DEVICE, SIM_FIDELITY, OFFLOAD, MODULE_KINDS),
                                  sim(FIDELITY, k="deepcopy or copy_copy or share_memory"),
                                  cpu(COMPILE, k="flatten or cached_graphs or report_counts or layout_and_bits "
                                                 "or before_activation or compile_logs or fake_copies or tracer_fakes"),
                                  sim(COMPILE, k="inner_tensors"), cpu(ECOSYSTEM, k="storage_names or dlpack or capsule"),
                                  sim(ECOSYSTEM, k="storage_names or dlpack or capsule")],
    "flagos/runtime/_user_subclasses.py": [cpu(FIDELITY, k="subclasses_of_the_program"),
                                           sim(FIDELITY, k="subclasses_of_the_program")],
    "flagos/runtime/_tracing.py": [cpu(COMPILE), cpu(DEVICE, k="print"), sim(COMPILE)],
    "flagos/runtime/_guard_errors.py": [cpu(BACKWARD)],
    "flagos/core/_state.py": [cpu(DEVICE, MULTI, VERSIONS, AUTOLOAD, T + "device_module.py"), cpu(ERRORS, k="fork"), sim(MULTI)],
    "flagos/report/_sites.py": [cpu(HTML, ANALYZE, T + "report_sites.py")],
    "flagos/errors.py": [cpu(ERRORS)],
    "flagos/metrics.py": [cpu(METRICS)],
    "flagos/chips/__init__.py": [cpu(DEVICE, ERRORS, CHIP_PROFILES, LOADER)],
    "flagos/chips/adapter.py": [cpu(LOADER, ADAPTERS, T + "opencl.py"), cpu(ERRORS, k="fork")],
    "flagos/chips/base.py": [cpu(DEVICE, ERRORS, CHIP_PROFILES, T + "device_module.py"), sim(DEVICE),
                             cpu(T + "redirect.py", k="entry_points_and_deactivate")],
    "flagos/chips/cpu.py": [cpu(DEVICE, ERRORS, T + "device_module.py")],
    "flagos/chips/cuda.py": [cpu(CHIP_NAMES, ERRORS, DIAGNOSE, CHIP_PROFILES)],
    "flagos/chips/names.py": [cpu(CHIP_NAMES, ERRORS)],
    "flagos/chips/mlu.py": [cpu(ERRORS, DIAGNOSE, CHIP_PROFILES)],
    "flagos/chips/mps.py": [cpu(ERRORS, DIAGNOSE, CHIP_PROFILES), cpu(T + "device_module.py", k="mps")],
    "flagos/chips/musa.py": [cpu(ERRORS, DIAGNOSE, CHIP_PROFILES)],
    "flagos/chips/npu.py": [cpu(ERRORS, DIAGNOSE, CHIP_PROFILES)],
    "flagos/chips/xpu.py": [cpu(ERRORS, DIAGNOSE, CHIP_PROFILES)],
    "flagos/chips/sim.py": [sim(SIM_TESTS, MULTI)],
    "flagos/chips/opencl.py": [cpu(T + "opencl.py", ERRORS)],
    "flagos/report/coverage/__init__.py": [cpu(ANALYZE)],
    "flagos/report/coverage/generate.py": [cpu(ANALYZE, k="coverage")],
    "flagos/tools/__init__.py": [cpu(DEVICES)],
    "flagos/tools/cli.py": [cpu(DEVICES, DIAGNOSE)],
    "flagos/tools/_analyze.py": [cpu(ANALYZE)],
    "flagos/tools/_bench.py": [cpu(T + "bench_figures.py", BENCH)],
    "flagos/tools/_childrun.py": [cpu(BENCH, COMPARE)],
    "flagos/tools/_common.py": [cpu(DEVICES, ANALYZE, T + "cli_common.py")],
    "flagos/tools/_compare.py": [cpu(COMPARE)],
    "flagos/tools/_devices.py": [cpu(DEVICES)],
    "flagos/tools/_diagnose.py": [cpu(DIAGNOSE)],
    "flagos/tools/_metrics.py": [cpu(METRICS)],
    "flagos/tools/_models.py": [cpu(T + "workloads.py", BENCH, COMPARE)],
    "flagos/report/_probe.py": [cpu(DIAGNOSE, DEVICES, T + "probe.py")],
    "flagos/tools/_smoke.py": [cpu(DIAGNOSE, T + "smoke_checks.py"), sim_default(T + "smoke_checks.py")],
    "flagos/tools/_top.py": [cpu(TOP)],
    # ---- the C router and loader ----
    "csrc/module.c": [cpu(DEVICE, ROUTES, ERRORS, NATIVE), sim(DEVICE), cpu(T + "benchmarks.py", k="floor"),
                      cpu(FIDELITY, k="dispatch_subclass or jagged"),
                      cpu(COMPILE, k="layout_and_bits or before_activation or report_counts or host_outputs")],
    "csrc/state.c": [cpu(DEVICE, ROUTES), cpu(MULTI, k="each_threads_own")],  # which activates sim itself
    "csrc/router.c": [cpu(ROUTES, POLICY, COUNTERS, FIDELITY, T + "precision_policy.py"),
                      sim(ROUTES, POLICY, COUNTERS)],
    "csrc/payload.c": [cpu(ROUTES, POLICY, COUNTERS, FIDELITY), sim(ROUTES, POLICY, COUNTERS),
                       cpu(SEQUENCES, k="packed"),
                       cpu(COMPILE, k="layout_and_bits or before_activation"),
                       cpu(ECOSYSTEM, k="capsule"),
                       cpu(NATIVE, k="routes_reports"),  # native mode: payloads are the chip's own tensors
                       cpu(ERRORS, k="nonexistent_device_index"), sim(ERRORS, k="nonexistent_device_index")],
    "csrc/fallback.c": [cpu(COUNTERS, POLICY, FIDELITY, T + "fallback_staging.py"), sim(COUNTERS)],
    "csrc/staging.c": [cpu(T + "fallback_staging.py", FIDELITY), sim(T + "fallback_staging.py")],
    "csrc/callsite.c": [cpu(ANALYZE), cpu(ROUTES, k="site")],
    "csrc/guard.c": [cpu(BACKWARD)],
    "csrc/adapter_load.c": [cpu(LOADER, ADAPTERS), sim(SIM_TESTS, STREAMS)],
    "csrc/adapter_checks.c": [cpu(LOADER, ADAPTERS, KERNEL_CHECKS), cpu(ACCELERATE, k="find_executable"), sim(SIM_TESTS, STREAMS)],
    "csrc/adapter_memory.c": [cpu(LOADER, ADAPTERS, KERNEL_CHECKS), sim(SIM_TESTS, STREAMS, SIM_FIDELITY)],
    "csrc/adapter_streams.c": [cpu(LOADER, ADAPTERS), sim(SIM_TESTS, STREAMS)],
    "csrc/adapter_kernels.c": [cpu(LOADER, ADAPTERS, KERNEL_CHECKS), sim(SIM_TESTS, STREAMS)],
    "csrc/adapter_fast.c": [cpu(T + "sim_fast_path.py"), sim(KERNELS), sim(MODELS, k="inference_mode")],
    "csrc/adapter_fallback.c": [cpu(T + "sim_fallback_c.py"), sim(COUNTERS, POLICY, T + "fallback_staging.py")],
    # ---- the emulated accelerator ----
    "backends/sim/kernels.c": [sim(KERNELS), cpu(KERNEL_CHECKS)],
    "backends/sim/sim.c": [sim(SIM_TESTS, SIM_FIDELITY, STREAMS, MULTI), cpu(ENV, k="sim"), cpu(KERNEL_CHECKS)],
    # ---- the OpenCL adapter (its kernels.cl, OpenCL C built at run time, is not mutated) ----
    "backends/opencl/kernels.c": [cpu(T + "opencl.py"), cpu(ERRORS, k="opencl")],
    "backends/opencl/memory.c": [cpu(T + "opencl.py"), cpu(ERRORS, k="opencl")],
    # streams and events: what test_streams checks on every chip, run on opencl itself
    "backends/opencl/opencl.c": [cpu(T + "opencl.py"), cpu(ERRORS, k="opencl"), opencl(STREAMS)],
    "backends/opencl/program.c": [cpu(T + "opencl.py"), cpu(ERRORS, k="opencl")],
}


def source_files(kind: str) -> list[str]:
    """Every file mutation testing covers: 'python' (flagos/) or 'c' (csrc/, backends/sim/, backends/opencl/)."""
    if kind == "python":
        pattern = ["flagos/**/*.py"]
    else:
        pattern = ["csrc/*.c", "backends/sim/*.c", "backends/opencl/*.c"]
    found = set()
    for p in pattern:
        found.update(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, p), recursive=True))
    return sorted(found)


def unmapped(kind: str) -> list[str]:
    """Files of that kind with no entry in TESTS: the mapping must be completed first."""
    return [f for f in source_files(kind) if f not in TESTS]


def tests_for(path: str) -> list[Run]:
    try:
        return TESTS[path]
    except KeyError:
        raise SystemExit(f"{path} has no tests named in scripts/mutation_map.py: add its entry") from None
