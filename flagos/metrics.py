"""Prometheus metrics with the same names on every chip.

    import flagos, flagos.metrics
    flagos.activate()
    exporter = flagos.metrics.start_http_server(9491)    # http://127.0.0.1:9491/metrics

Metrics (every scrape reads them afresh):

    flagos_device_memory_used_bytes{chip,index,name}     device memory in use (total - free)
    flagos_device_memory_total_bytes{chip,index,name}    device memory capacity
    flagos_device_utilization_ratio{chip,index,name}     0..1, only for chips that expose it
    flagos_op_calls_total{op,route}                      aten op calls in this process, by route
                                                         (override, native, fallback)
    flagos_op_fallback_seconds_total{op}                 wall time of this process's CPU fallbacks
    flagos_info{version,chip,mode}                       1; chip and mode are "" until activation

The devices are those of the active chip when flagos is active in the process, else every
device of every available chip (what `flagos metrics` serves). The op counters are the
fallback report's: `flagos.reset_report()` resets them, which Prometheus reads as a counter
reset. Needs prometheus_client (`pip install flagos[metrics]`).

A started exporter announces itself in FLAGOS_RUNTIME_DIR, so `flagos top` shows the process
and its fallback share.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from . import _C, __version__
from .core import _state
from .errors import ConfigError
from .report import _exporters, _probe

NAMES = ("flagos_device_memory_used_bytes", "flagos_device_memory_total_bytes",
         "flagos_device_utilization_ratio", "flagos_op_calls_total",
         "flagos_op_fallback_seconds_total", "flagos_info")
DEVICE_LABELS = ("chip", "index", "name")
ROUTES = ("override", "native", "fallback")
INSTALL_HINT = "pip install flagos[metrics]"


def _prometheus():
    try:
        import prometheus_client
    except ImportError as e:
        raise ModuleNotFoundError(
            f"flagos metrics need the prometheus_client package, which is not installed: "
            f"{INSTALL_HINT} (or pip install prometheus_client)", name="prometheus_client") from e
    return prometheus_client


def _active():
    return _state.active_or_none()


class Collector:
    """The flagos metrics as a prometheus_client collector, for a program that serves its own
    registry: `registry.register(flagos.metrics.Collector())`."""

    def __init__(self, chips: list[str] | None = None):
        self.chips = chips

    def describe(self):
        return []  # metrics are read at scrape time; nothing to read at registration

    def _devices(self) -> list[dict]:
        state = _active()
        names = self.chips or ([state.chip.name] if state is not None else None)
        return _probe.device_rows(_probe.chip_statuses(names), utilization=True)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        used = GaugeMetricFamily("flagos_device_memory_used_bytes",
                                 "Device memory in use (total - free), bytes", labels=DEVICE_LABELS)
        total = GaugeMetricFamily("flagos_device_memory_total_bytes",
                                  "Device memory capacity, bytes", labels=DEVICE_LABELS)
        busy = GaugeMetricFamily("flagos_device_utilization_ratio",
                                 "Device utilization, 0 to 1 (chips that expose it)",
                                 labels=DEVICE_LABELS)
        for row in self._devices():
            labels = [row["chip"], str(row["index"]), row["name"] or ""]
            if row["memory_total"] is not None:  # a failed device has no readings to give
                used.add_metric(labels, row["memory_used"])
                total.add_metric(labels, row["memory_total"])
            if row.get("utilization") is not None:
                busy.add_metric(labels, row["utilization"])
        yield from (used, total, busy)

        calls = CounterMetricFamily("flagos_op_calls", "aten op calls in this process by route",
                                    labels=("op", "route"))
        fallback = CounterMetricFamily("flagos_op_fallback_seconds",
                                       "Wall time of CPU fallbacks in this process, seconds",
                                       labels=("op",))
        state = _active()
        if state is not None:
            for row in _C.table():
                for route in ROUTES:
                    calls.add_metric([row["op"], route], row["calls"][route])
                fallback.add_metric([row["op"]], row["fallback_ns"] / 1e9)
        yield from (calls, fallback)

        info = GaugeMetricFamily("flagos_info", "flagos version, active chip and mode",
                                 labels=("version", "chip", "mode"))
        info.add_metric([__version__, state.chip.name if state else "", state.mode if state else ""], 1)
        yield info


def registry(chips: list[str] | None = None):
    """A prometheus_client registry holding only the flagos metrics."""
    prometheus_client = _prometheus()
    reg = prometheus_client.CollectorRegistry(auto_describe=False)
    reg.register(Collector(chips))
    return reg


def exposition(chips: list[str] | None = None) -> str:
    """One scrape of the flagos metrics, in Prometheus's text format."""
    return _prometheus().generate_latest(registry(chips)).decode()


@dataclass
class Exporter:
    """A running metrics endpoint; `stop()` closes it (it also ends with the process)."""
    host: str
    port: int
    url: str
    _server: object = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _announcement: str = field(repr=False)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        _exporters.withdraw(self._announcement)


def start_http_server(port: int, addr: str = "127.0.0.1", chips: list[str] | None = None) -> Exporter:
    """Serve the flagos metrics on http://addr:port/metrics from a background thread.

    port 0 picks a free port (read it from the result's `.port`). The default address serves
    this machine only; pass addr="0.0.0.0" for a Prometheus server elsewhere.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port must be an int from 0 to 65535 (0: any free port), not {port!r}")
    prometheus_client = _prometheus()
    try:
        started = prometheus_client.start_http_server(port, addr=addr, registry=registry(chips))
    except OSError as e:
        raise OSError(e.errno, f"cannot serve flagos metrics on {addr}:{port} ({e.strerror or e}); "
                      f"choose another port, or 0 for any free one") from e
    if not isinstance(started, tuple):  # before 0.17 the server was not returned: no port, no stop
        raise ModuleNotFoundError("flagos metrics need prometheus_client 0.17 or later: "
                                  "pip install -U 'prometheus_client>=0.17'", name="prometheus_client")
    server, thread = started
    bound = server.server_address[1]
    state = _active()
    announcement = _exporters.announce(addr, bound, state.chip.name if state else None)
    return Exporter(addr, bound, _exporters.url(addr, bound), server, thread, announcement)
