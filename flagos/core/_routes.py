"""Per-op routes: forced routes (FLAGOS_ROUTE, set_route) and override kernels.

The C router asks `resolve(op_name)` once per op (and again after any change
here); the answer is cached in the op's table entry, so nothing in this module
runs per call.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from .. import _C
from ..errors import ConfigError
from . import _env
from ._schema import op_overload, packet_name

ROUTES = ("auto", "override", "native", "fallback", "error")
_CODES = {"override": _C.ROUTE_OVERRIDE, "native": _C.ROUTE_NATIVE,
          "fallback": _C.ROUTE_FALLBACK, "error": _C.ROUTE_ERROR}

# op name ("aten::mm" for every overload, or "aten::add.Tensor") -> route
_forced: dict[str, str] = {}
# (op name, chip) -> kernel; chip None means every chip
_overrides: dict[tuple[str, str | None], Callable] = {}
_active_chip: str | None = None
_device_mode = False
_PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
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


def set_active_chip(chip: str | None, device_mode: bool = False) -> None:
    """The chip routes are resolved for; in device mode (flagos tensors are the device's own),
    kernels registered for the flagos device through torch.library are among them."""
    global _active_chip, _device_mode
    _active_chip, _device_mode = chip, device_mode
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


def _device_kernel_for(name: str):
    """A kernel registered for the flagos device through torch.library (`custom_op(...,
    device_types="flagos")`, `register_kernel(op, "flagos")`, `Library.impl(..., "PrivateUse1")`)
    sits on the PrivateUse1 key, below the wrapper's Python key where flagos routes. It is
    the device's own kernel for that op: a callable that runs it with the flagos tensors
    themselves (their ops inside come back through the router), or None. PyTorch's aten and
    c10d ops carry PrivateUse1 kernels of PyTorch's and flagos's own making: not these."""
    if name.split("::", 1)[0] in ("aten", "c10d", "prim", "prims"):
        return None
    try:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"):
            return None
    except RuntimeError:  # not an operator the dispatcher knows by that name
        return None
    op = op_overload(name)
    return None if op is None else functools.partial(op.redispatch, _PRIVATEUSE1)


def resolve(name: str):
    """(route code, kernel or None, whether the kernel takes the flagos tensors themselves)
    for the active chip; called by the C router once per op and change."""
    forced = _forced_route(name)
    override = _override_for(name)
    on_device = False
    if override is None and forced in ("auto", "override") and _device_mode:
        override = _device_kernel_for(name)
        on_device = override is not None
    if forced == "override" and override is None:
        raise ConfigError(f"{name} is routed to 'override' but no kernel is registered for it "
                          f"on chip {_active_chip!r}; use flagos.register_kernel()")
    if forced == "auto":
        route = "override" if override else "native"
    else:
        route = forced
    log.debug("%s on %s: %s%s%s", name, _active_chip, route,
              " (torch.library's kernel for the device)" if on_device else "",
              "" if forced == "auto" else " (forced)")
    if route != "override":
        return _CODES[route], None, False
    return _CODES[route], override, on_device


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
    code = resolve(name)[0]
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
