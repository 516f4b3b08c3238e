"""Benchmarks for lightning_straggler (run as modules, e.g. ``python -m benchmarks.ring_vs_plain``)."""
