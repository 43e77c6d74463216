"""Per-op routes: forced routes (FLAGOS_ROUTE, set_route) and override kernels.

The C router asks `resolve(op_name)` once per op (and again after any change
here); the answer is cached in the op's table entry, so nothing in this module
runs per call.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch

from .. import _C
from ..errors import ConfigError
from . import _env
from ._schema import packet_name

ROUTES = ("auto", "override", "native", "fallback", "error")
_CODES = {"override": _C.ROUTE_OVERRIDE, "native": _C.ROUTE_NATIVE,
          "fallback": _C.ROUTE_FALLBACK, "error": _C.ROUTE_ERROR}

# op name ("aten::mm" for every overload, or "aten::add.Tensor") -> route
_forced: dict[str, str] = {}
# (op name, chip) -> kernel; chip None means every chip
_overrides: dict[tuple[str, str | None], Callable] = {}
_active_chip: str | None = None
_warned_library_kernels: set[str] = set()
log = logging.getLogger("flagos")


def _normalize_op(op) -> str:
    if not isinstance(op, str):  # an OpOverload or OpOverloadPacket
        schema = getattr(op, "_schema", None)
        if schema is not None:
            op = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
        else:
            op = f"{op._qualified_op_name}"
    op = op.strip()
    if "::" not in op:
        raise ConfigError(f"op {op!r} needs its namespace, e.g. 'aten::{op}'")
    return op


def _check_route(route: str, where: str) -> str:
    route = route.strip().lower()
    if route not in ROUTES:
        raise ConfigError(f"{where}: route {route!r} is not valid; use one of: {', '.join(ROUTES)}")
    return route


def parse_route_spec(spec: str) -> dict[str, str]:
    """'aten::mm=fallback,aten::softmax=native' -> {'aten::mm': 'fallback', ...}."""
    out = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        op, sep, route = item.partition("=")
        if not sep or not op.strip():
            raise ConfigError(
                f"FLAGOS_ROUTE entry {item!r} is not 'op=route' "
                f"(example: FLAGOS_ROUTE='aten::mm=fallback,aten::softmax=native')")
        out[_normalize_op(op)] = _check_route(route, f"FLAGOS_ROUTE entry {item!r}")
    return out


def load_env() -> None:
    """Apply FLAGOS_ROUTE on top of routes set through the API."""
    _forced.update(parse_route_spec(_env.get("FLAGOS_ROUTE")))
    _C.invalidate()


def set_active_chip(chip: str | None) -> None:
    global _active_chip
    _active_chip = chip
    _C.invalidate()


def _override_for(name: str):
    for key in ((name, _active_chip), (packet_name(name), _active_chip),
                (name, None), (packet_name(name), None)):
        fn = _overrides.get(key)
        if fn is not None:
            return fn
    return None


def _forced_route(name: str) -> str:
    return _forced.get(name) or _forced.get(packet_name(name)) or "auto"


def _warn_if_registered_for_the_device(name: str) -> None:
    """A kernel registered for the flagos device through torch.library (`custom_op(...,
    device_types="flagos")`, `torch.library.register_kernel(op, "flagos")`) sits on the
    PrivateUse1 key, below the wrapper's Python key where flagos routes: it is never called.
    Say so once, with the way flagos takes such a kernel. (PyTorch's own aten and c10d ops
    carry PrivateUse1 kernels of PyTorch's and flagos's making: not these.)"""
    if name.split("::", 1)[0] in ("aten", "c10d") or name in _warned_library_kernels:
        return
    try:
        registered = torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1")
    except RuntimeError:  # not an operator the dispatcher knows by that name
        return
    if registered:
        _warned_library_kernels.add(name)
        warnings.warn(
            f"{name} has a kernel registered for the flagos device through torch.library; flagos "
            f"routes ops above that key, so it is not called (the op runs on the chip's own "
            f"kernel or the CPU fallback). Register it with flagos.register_kernel({name!r}, fn), "
            f"which calls fn with the chip's own tensors.", UserWarning, stacklevel=3)


def resolve(name: str):
    """(route code, override kernel or None) for the active chip; called by the C router."""
    forced = _forced_route(name)
    override = _override_for(name)
    if override is None:
        _warn_if_registered_for_the_device(name)
    if forced == "override" and override is None:
        raise ConfigError(f"{name} is routed to 'override' but no kernel is registered for it "
                          f"on chip {_active_chip!r}; use flagos.register_kernel()")
    if forced == "auto":
        route = "override" if override else "native"
    else:
        route = forced
    log.debug("%s on %s: %s%s", name, _active_chip, route, "" if forced == "auto" else " (forced)")
    return _CODES[route], override if route == "override" else None


def set_route(op, route: str) -> None:
    """Force the route of an op ('aten::mm' for all overloads, 'aten::add.Tensor' for one)."""
    name = _normalize_op(op)
    route = _check_route(route, f"set_route({name!r})")
    if route == "auto":
        _forced.pop(name, None)
    else:
        _forced[name] = route
    _C.invalidate()


def clear_routes() -> None:
    """Drop every forced route (FLAGOS_ROUTE included) and go back to 'auto'."""
    _forced.clear()
    _C.invalidate()


def register_kernel(op, fn: Callable, chip: str | None = None) -> None:
    """Register an override kernel for an op on one chip (or every chip).

    The kernel receives the chip's own tensors (a CUDA tensor on the cuda chip,
    a CPU tensor on the cpu chip) with the op's arguments, and returns the op's
    result in the same form. Raising NotImplementedError hands the call to the
    chip's own kernel.
    """
    if not callable(fn):
        raise ConfigError(f"register_kernel: {fn!r} is not callable")
    _overrides[(_normalize_op(op), chip)] = fn
    _C.invalidate()


def unregister_kernel(op, chip: str | None = None) -> None:
    _overrides.pop((_normalize_op(op), chip), None)
    _C.invalidate()


def route_of(op) -> str:
    """The route an op takes on the active chip: override, native, fallback or error."""
    name = _normalize_op(op)
    for row in _C.table():
        if name in (row["op"], packet_name(row["op"])) and row["route"] != "unresolved":
            return row["route"]
    code, _ = resolve(name)
    return {v: k for k, v in _CODES.items()}[code]


def forced_routes() -> dict[str, str]:
    """The forced routes in effect: {op: route}."""
    return dict(_forced)


def routes() -> dict[str, str]:
    """Route of every op seen so far, plus every forced route: {op: route}."""
    out = {row["op"]: route_of(row["op"]) for row in _C.table()}
    for name, route in _forced.items():
        out.setdefault(name, route)
    return dict(sorted(out.items()))
