"""What flagos tells: the fallback report and its HTML page, the Prometheus exporters, device
readings, and the per-chip coverage files."""
