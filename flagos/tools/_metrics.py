"""Serve Prometheus metrics of this machine's devices, the same names on every chip.

The endpoint is http://ADDR:PORT/metrics.

The same metric names on every chip: flagos_device_memory_used_bytes,
flagos_device_memory_total_bytes, flagos_device_utilization_ratio (where the chip exposes it),
labelled chip, index, name; flagos_op_calls_total{op,route} and
flagos_op_fallback_seconds_total{op} (a program's own ops: start the exporter inside it with
flagos.metrics.start_http_server(port)); flagos_info{version,chip,mode}.

Runs until interrupted (Ctrl-C or SIGTERM). Needs prometheus_client: pip install flagos[metrics].

exit status: 0 ok, 1 the exporter cannot start (port in use, prometheus_client missing),
2 usage error.
"""
from __future__ import annotations

import signal
import sys
import threading

from .. import chips
from .. import metrics as flagos_metrics

DEFAULT_PORT = 9491


def add_arguments(parser) -> None:
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port to serve on (default {DEFAULT_PORT}; 0: any free port, printed)")
    parser.add_argument("--addr", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; "
                             "0.0.0.0 for a Prometheus server elsewhere)")
    parser.add_argument("--once", action="store_true",
                        help="print one scrape in Prometheus's text format and exit")


def metrics(port: int | None = None, addr: str = "127.0.0.1"):
    """port None: one scrape of every device of every available chip, as Prometheus text. A
    port: start that exporter in this process and return it (flagos.metrics.Exporter;
    `.stop()` ends it). Unlike an exporter started inside a program, which shows its active
    chip, the machine's exporter shows every chip even where flagos is active."""
    every_chip = list(chips.known())
    if port is None:
        return flagos_metrics.exposition(every_chip)
    return flagos_metrics.start_http_server(port, addr, every_chip)


def _serve(exporter) -> None:
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        # announced inside the try: a Ctrl-C right after the line is seen stops it quietly
        print(f"flagos metrics: serving {exporter.url} (Ctrl-C to stop)", flush=True)
        while not stop.wait(0.5):  # a timed wait, so Ctrl-C is seen at once
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        exporter.stop()


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        print(f"flagos metrics: error: --port must be from 0 to 65535, not {args.port}", file=sys.stderr)
        return 2
    try:
        if args.once:
            sys.stdout.write(metrics())
            return 0
        exporter = metrics(args.port, args.addr)
    except (ModuleNotFoundError, OSError) as e:
        print(f"flagos metrics: error: {e}", file=sys.stderr)
        return 1
    _serve(exporter)
    return 0
