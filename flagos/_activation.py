"""Activation: choosing the chip and the mode, wiring the C router to them, and installing
each layer's part (the device runtime, the integrations, the report). The top of the package:
it imports every layer below it, and nothing below imports it."""
from __future__ import annotations

import logging
import os
import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack

from . import _C, chips
from .chips import names
from .chips.adapter import AdapterChip
from .chips.base import DeviceInfo, TorchChip
from .core import _env, _precision, _routes, _schema, _state
from .core._state import TESTED_TORCH, Active, info
from .errors import (
    ChipNotFoundError,
    ConfigError,
    DeviceMismatchError,
    DowncastWarning,
    FallbackError,
    FallbackWarning,
    NoEngineQueueError,
)
from .integrations import (
    _backward_errors,
    _caches,
    _compile,
    _data_parallel,
    _distributed,
    _dlpack,
    _lazy_params,
    _libraries,
    _offload,
    _redirect,
)
from .report import _report
from .runtime import (
    _adapter_ops,
    _autocast,
    _device_module,
    _math_keys,
    _native_mode,
    _payload_rules,
    _pinned,
    _registration,
    _sequences,
)
from .runtime._tensor import FlagosTensor, set_metadata

MODES = ("device", "native")
_POLICIES = {"allow": 0, "warn": 1, "error": 2}

log = logging.getLogger("flagos")
_lock = threading.RLock()


# ---- choosing the chip ---------------------------------------------------

def _available_chips() -> list[str]:
    return [name for name in chips.known() if chips.profile(name).detect()]


def _pick_chip(device: str) -> TorchChip:
    """The chip a typed name stands for (a chip, a vendor or product alias: chips/names.py)."""
    asked = names.resolve(device, chips.known())
    name = asked.chip
    if name == "auto":
        for candidate in chips.auto_order():
            profile = chips.profile(candidate)
            if profile.picked_by_auto():
                return profile
        raise ChipNotFoundError("no chip found (not even cpu)")  # unreachable: cpu is always there
    typed = device.strip()
    shown = f"chip {name!r}" if typed.lower() == name else f"{typed!r} (chip {names.describe(asked)})"
    profile = chips.profile(name)
    if isinstance(profile, AdapterChip):
        if profile.adapter.device_count() < 1:  # a broken library raises AdapterError here
            raise ChipNotFoundError(f"{shown}: its adapter reports no devices")
        return profile
    if not profile.detect():
        install = f". To use it, install {profile.install}" if profile.install else ""
        raise ChipNotFoundError(
            f"{shown} is not available on this machine: {profile.why_unavailable()}{install}; "
            f"available here: {', '.join(_available_chips())} (or 'auto' for the best of them). "
            f"`flagos diagnose` says what this machine has.")
    if asked.vendor and profile.vendor != asked.vendor:
        raise ChipNotFoundError(
            f"{shown} is not on this machine: the {name} devices here are "
            f"{names.CUDA_VENDORS[profile.vendor].label} ({profile.device_name(0)}). Ask for "
            f"{name!r} (or {profile.vendor!r}) to use them; `flagos diagnose` says more.")
    return profile


def _pick_mode(chip: TorchChip, mode: str | None) -> str:
    mode = (mode or _env.get("FLAGOS_MODE") or "").lower()
    if not mode:
        if chip.owns_privateuse1:
            return "native"
        if not _registration.device_mode_supported() and not isinstance(chip, AdapterChip):
            log.warning("PyTorch %s has no Python device guard for PrivateUse1 (it came after "
                        "2.9): flagos runs in native mode, and flagos.device() is the chip's own "
                        "device", torch.__version__)
            return "native"
        return "device"
    if mode not in MODES:
        raise ConfigError(f"mode {mode!r} is not valid; use one of: {', '.join(MODES)}")
    if mode == "device" and chip.owns_privateuse1:
        raise ConfigError(
            f"chip {chip.name!r} runs through {chip.plugin}, which owns PyTorch's PrivateUse1 "
            f"slot, so the 'flagos' device cannot exist next to it; use mode='native' "
            f"(flagos.device() is then {chip.torch_type}:N)")
    return mode


# ---- wiring ----------------------------------------------------------------

def _skip_prefixes() -> tuple[str, ...]:
    """Source folders that are not user code, for the report's first call site."""
    dirs = {os.path.dirname(torch.__file__), os.path.dirname(__file__)}
    for mod in ("contextlib", "functools"):
        m = __import__(mod)
        dirs.add(m.__file__)
    return tuple(sorted(dirs))


def _configure_router(state: Active) -> None:
    chip = state.chip
    device_mode = state.mode == "device"
    _C.configure(
        device_mode=device_mode,
        chip_is_host=chip.payload_is_host,
        tensor_type=torch.Tensor,
        device_type=torch.device,
        wrapper_type=FlagosTensor,
        make_wrapper=torch.Tensor._make_wrapper_subclass,
        # the ops' C++ entry points: OpOverload.__call__ is a Python frame around them
        to_copy=torch.ops.aten._to_copy.default._op,
        copy_=torch.ops.aten.copy_.default._op,
        host_device=torch.device("cpu"),
        chip_devices=tuple(_compile.payload_device_of(chip, i) for i in range(state.device_count)),
        flagos_devices=state.flagos_devices,
        describe=_schema.describe,
        resolve=_routes.resolve,
        fallback_warning=FallbackWarning,
        fallback_error=FallbackError,
        device_mismatch=DeviceMismatchError,
        skip_prefixes=_skip_prefixes(),
        set_metadata=set_metadata,
        adapter_dispatch=_adapter_runner(state) if isinstance(chip, AdapterChip) else None,
    )
    _C.set_fallback_policy(_POLICIES[_env.get("FLAGOS_FALLBACK") or "warn"])
    _C.set_current_device(state.current)
    _math_keys.install()
    if device_mode:
        _backward_errors.install()


def _adapter_runner(state: Active):
    if state.mode != "device":
        raise ConfigError(f"chip {state.chip.name!r} is a C-ABI adapter: it runs in device mode only")
    return _adapter_ops.Runner(state.chip, state.flagos_devices)


def _apply_log_level() -> None:
    level = _env.get("FLAGOS_LOG_LEVEL") or "warning"
    log.setLevel(getattr(logging, level.upper()))
    # Asked for explicitly: make the messages visible even where the application set up no
    # logging (once; an application's own handlers keep working).
    if os.environ.get("FLAGOS_LOG_LEVEL") and not any(getattr(h, "_flagos", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("flagos %(levelname)s: %(message)s"))
        handler._flagos = True
        log.addHandler(handler)
        log.propagate = False


def _check_dtype_policy(chip, mode: str, policy: str | None) -> None:
    """The downcast rewrites ops on the flagos device (device mode): a native-mode chip whose
    bfloat16 is not native cannot have it."""
    if policy == "downcast" and mode == "native" and _precision.substitute(chip.native_dtypes):
        raise ConfigError(
            f"dtype_policy='downcast' works in device mode; chip {chip.name!r} runs in native "
            f"mode here and its bfloat16 is not native. Use mode='device', or "
            f"dtype_policy='strict' and pick the dtype with flagos.preferred_dtype()")


def _apply_dtype_policy(state: Active, policy: str) -> None:
    """Turn the downcast on (a chip whose bfloat16 is not native) or off; strict adds nothing
    to any op's path."""
    to = _precision.substitute(state.chip.native_dtypes) if policy == "downcast" else None
    state.dtype_policy = policy
    state.downcast_to = to
    if to is None:
        _C.set_downcast(None)
        return
    name = str(to).removeprefix("torch.")
    _C.set_downcast(torch.bfloat16, to, state.flagos_devices[0].type, DowncastWarning,
                    f"bfloat16 is not native on {state.chip.name}: running bfloat16 work in "
                    f"{name} (dtype_policy='downcast'); flagos.fallback_report() counts it")
    log.info("flagos: dtype_policy=downcast: bfloat16 work runs in %s on %s", name, state.chip.name)


def activate(device: str | None = "auto", mode: str | None = None,
             redirect_cuda: bool | None = None, dtype_policy: str | None = None) -> dict:
    """Activate flagos on a chip; returns `info()`.

    device: "auto" (best available chip), a chip name ("cpu", "cuda", "npu", ...), a vendor
    or product name standing for one ("ascend", "cambricon", "hygon", ...: chips/names.py,
    docs/chips.md), or None to read FLAGOS_DEVICE. mode: "device" (tensors live on the `flagos`
    device) or "native" (the chip keeps its own device type and flagos routes
    every op through a dispatch mode); None reads FLAGOS_MODE, then picks the
    chip's natural mode. redirect_cuda: True makes code written for CUDA run on this
    chip unchanged ("cuda" devices, `.cuda()`, `torch.cuda.*`, autocast, GradScaler,
    `init_process_group("nccl")`, which becomes `flagos.dist_backend()`; a no-op on the cuda chip); None reads FLAGOS_REDIRECT_CUDA.
    dtype_policy: "strict" (bfloat16 runs as bfloat16; where the chip lacks it, ops fall back)
    or "downcast" (on a chip whose bfloat16 is not native, bfloat16 weights, factories and
    autocast run in float16, float32 where float16 is not native either; said once in a
    DowncastWarning, counted in the report); None reads FLAGOS_DTYPE_POLICY, and where that
    is unset a first activation is strict and a repeated one keeps the policy in force.
    Calling activate() again with another policy switches it (tensors already made keep
    their dtype).
    """
    with _lock:
        if device is None:
            device = _env.requested_device() or "auto"
        # Validate everything before touching torch, so a bad value changes nothing.
        policy = _env.get("FLAGOS_FALLBACK")
        if redirect_cuda is None:
            redirect_cuda = _env.flag("FLAGOS_REDIRECT_CUDA")
        _routes.parse_route_spec(_env.get("FLAGOS_ROUTE"))
        try:  # the fallback's staging limit, read by the C pool on each use: checked here first
            _C.staging_stats()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        dtype_policy = (_precision.env_policy() if dtype_policy is None
                        else _precision.check_policy(dtype_policy))
        _apply_log_level()
        chip = _pick_chip(device)
        mode = _pick_mode(chip, mode)
        _check_dtype_policy(chip, mode, dtype_policy)
        current = _state.active_or_none()
        if current is not None:
            if (current.chip.name, current.mode) == (chip.name, mode):
                if redirect_cuda:
                    current.redirect_cuda = _redirect.install(current)
                if dtype_policy is not None:
                    _apply_dtype_policy(current, dtype_policy)
                return info()
            if current.mode == "device":
                raise ConfigError(
                    f"flagos is already active on chip '{current.chip.name}' in device mode; "
                    f"PyTorch's device registration cannot be undone, so a process uses one "
                    f"chip in device mode. Start a new process to use '{chip.name}'.")
            deactivate()
        count = chip.device_count()
        if count < 1:
            raise ChipNotFoundError(f"chip {chip.name!r} reports no devices")
        if mode == "device":
            _registration.claim(_device_module)
            _autocast.register(chip)
            _pinned.register(chip)
            _payload_rules.register(chip)
            _sequences.register(chip)
            if not isinstance(chip, AdapterChip):  # torch.compile (C-ABI chips run eagerly)
                _compile.install(_device_module)
            devices = tuple(torch.device("flagos", i) for i in range(count))
        else:
            devices = tuple(chip.torch_device(i) for i in range(count))
        state = Active(chip=chip, mode=mode, device_count=count, flagos_devices=devices)
        _configure_router(state)
        _routes.set_active_chip(chip.name, device_mode=mode == "device")
        _routes.load_env()
        _state.set_active(state)
        state.caches = _caches.install(state)  # before anything can compile on the chip
        if mode == "device":  # libraries that asked before, or will ask, which device exists
            _offload.install()
            _lazy_params.install()
            _data_parallel.install()
            _dlpack.install()
            _libraries.install()
            _distributed.install()
        # At `import torch` (autoload) no backward can have run yet, and a probe would deadlock:
        # the engine's thread would import torch modules while `import torch` holds the lock.
        if mode == "device" and not _autoloading:
            state.backward_ok = _probe_backward(state)
            _configure_router(state)  # a fresh table: the probe leaves no rows or warnings
        if mode == "native":
            state.native_mode = _native_mode.NativeMode()
            state.native_mode.__enter__()
            state.native_thread = threading.get_ident()
        if redirect_cuda:
            state.redirect_cuda = _redirect.install(state)
        _apply_dtype_policy(state, dtype_policy or "strict")
        if isinstance(chip, AdapterChip) and not chip.fork_safe:
            _refuse_in_forked_children()
        _report.on_activate()
        _warn_untested_torch()
        log.info("flagos active on chip %s (%s mode, %d device(s), fallback=%s)",
                 chip.name, mode, count, policy)
        on_activated = getattr(chip, "on_activated", None)  # what comes next is the program's
        if on_activated is not None:
            on_activated()
        return info()


_ENGINE_QUEUE = "device_ready_queues_"


def _probe_backward(state: Active) -> bool:
    """Whether autograd's engine can run backward on flagos:0. The engine sizes its device
    queues once, at the first backward() of the process: one that ran before activation (on
    CPU tensors) leaves flagos without a queue, and every flagos backward then stops at a
    PyTorch internal assert. Say so now, with the way out, rather than at the first step."""
    _C.set_fallback_policy(0)
    try:
        x = torch.zeros((), device=state.flagos_devices[0], requires_grad=True)
        (x * 2).backward()
    except Exception as e:  # the probe is flagos's own: only the engine's failure is an answer
        if not isinstance(e, NoEngineQueueError) and _ENGINE_QUEUE not in str(e):
            return True  # another failure (a route to a kernel registered later, say): not the engine's
        log.warning("autograd's engine started before flagos was activated (a backward pass ran "
                    "earlier in this process), so backward() on flagos tensors cannot run: "
                    "PyTorch sizes its device queues once. Activate flagos before the first "
                    "backward(): call flagos.activate() at the start of the program, or set "
                    "FLAGOS_DEVICE so it activates at `import torch`. Forward passes work.")
        return False
    return True


def _warn_untested_torch() -> None:
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    low, high = (tuple(int(p) for p in v.split(".")) for v in TESTED_TORCH)
    if not low <= version <= high:
        log.warning("flagos is made for PyTorch %s to %s; this is %s", TESTED_TORCH[0],
                    TESTED_TORCH[1], torch.__version__)


_autoloading = False


def activate_from_env() -> dict:
    """What autoload runs: FLAGOS_DEVICE / FLAGOS_DEVICE_BACKEND and FLAGOS_MODE."""
    global _autoloading
    _autoloading = True
    try:
        return activate(_env.requested_device() or "auto")
    finally:
        _autoloading = False


def deactivate() -> None:
    """Leave native mode (device mode stays for the life of the process).

    Native mode is a dispatch mode on the stack of the thread that activated it, and only
    there, at the top, can it be left: deactivate() from another thread, from inside an op
    flagos routes (an override kernel) or under a dispatch mode entered after activate()
    raises ConfigError and changes nothing; flagos stays active, and deactivate() works once
    called from where it can.
    """
    with _lock:
        state = _state.active_or_none()
        if state is None:
            return
        if state.mode == "device":
            raise ConfigError("device mode cannot be deactivated: PyTorch's device "
                              "registration lasts for the life of the process")
        _check_native_mode_on_top(state)
        _redirect.uninstall()
        _caches.uninstall()
        state.redirect_cuda = False
        state.native_mode.__exit__(None, None, None)
        _C.set_downcast(None)
        _C.deconfigure()
        _registration.release()  # torch.Generator and torch.accelerator back to PyTorch's own
        _state.set_active(None)


_fork_hook_registered = False


def _refuse_in_forked_children() -> None:
    """A chip whose driver runs threads (OpenCL) does not survive fork(): in a forked child
    its first call would wait forever on a thread that stayed in the parent. Refuse it with
    the fix, as PyTorch refuses CUDA in a forked child."""
    global _fork_hook_registered
    if not _fork_hook_registered:  # os.register_at_fork cannot be undone: once per process
        os.register_at_fork(after_in_child=_in_forked_child)
        _fork_hook_registered = True


def _in_forked_child() -> None:
    state = _state.active_or_none()
    if state is None or not isinstance(state.chip, AdapterChip) or state.chip.fork_safe:
        return
    message = (f"the {state.chip.name} chip cannot be used in a process forked after it started "
               f"(its driver's threads stay in the parent). Start worker processes with the "
               f"'spawn' method: torch.multiprocessing.set_start_method('spawn'), or "
               f"DataLoader(..., multiprocessing_context='spawn').")
    _C.refuse_forked_child(message)
    _state.refuse(message)


def _check_native_mode_on_top(state: Active) -> None:
    """Leaving a dispatch mode pops the top of this thread's mode stack: make sure it is ours."""
    stack = _dispatch_mode_stack()
    if stack and stack[-1] is state.native_mode:
        return
    if threading.get_ident() != state.native_thread:
        raise ConfigError(
            "flagos.deactivate() must be called in the thread that activated native mode "
            "(dispatch modes belong to one thread); flagos stays active")
    if any(mode is state.native_mode for mode in stack):
        raise ConfigError(
            f"flagos.deactivate(): the dispatch mode {type(stack[-1]).__name__}, entered after "
            f"flagos.activate(), is still active; leave it first (flagos stays active)")
    raise ConfigError(
        "flagos.deactivate() cannot run inside an op that flagos routes (an override kernel, "
        "or code it calls): PyTorch takes native mode off its stack while the op runs. "
        "Call it after the op returns; flagos stays active")


def list_devices(include_unavailable: bool = False) -> list[DeviceInfo]:
    """Every device of every chip found here (and one row per absent chip if asked)."""
    rows = []
    for name in chips.known():
        chip = chips.profile(name)
        present = chip.detect()
        mode = "native" if chip.owns_privateuse1 else "device"
        if not present:
            if include_unavailable:
                dtypes = () if isinstance(chip, AdapterChip) else chip.native_dtypes
                rows.append(DeviceInfo(chip.name, 0, "not found", 0, dtypes, mode,
                                       False, chip.vendor, chip.collective_backend))
            continue
        for i in range(chip.device_count()):
            rows.append(DeviceInfo(chip.name, i, chip.device_name(i), chip.total_memory(i),
                                   chip.native_dtypes, mode, True, chip.vendor,
                                   chip.collective_backend))
    return rows
