"""The ideal throughput every efficiency in this project is measured against (one definition).

    ideal = G / (G / sum_i R_i + t_ar),    G = the global batch of one step (samples)

``R_i`` is worker i's own sample rate when it trains ALONE (its compute plus the training loop's
per-step work, no communication, no waiting), averaged over its slowdown schedule; ``t_ar`` is the
time of one all-reduce of the gradients across the whole world. So the ideal is: every worker at its
own speed, the global batch split perfectly in proportion to those speeds, and one all-reduce per
step. Everything else (waiting for stragglers, protocol overhead, omitted data, validation) counts
as loss. Asynchronous SGD pays no all-reduce and can exceed it.

Where R_i and t_ar come from differs only in what can be observed, not in the formula:
  * ``benchmarks.matrix``: R_i from 1-worker calibration runs at each slowdown factor (measured),
    t_ar from the straggler-free ring run's transfer time per step;
  * the simulator (``lightning_straggler.sim``): R_i from the workload model (compute + loop
    overhead per step), t_ar from the network model.
Pure Python, no torch: the simulator and the benchmarks import it.
"""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ideal_throughput"]


def ideal_throughput(rates: Iterable[float], global_batch: float, allreduce_s: float) -> float:
    """G / (G / sum R_i + t_ar) in samples per second; a negative ``allreduce_s`` counts as 0."""
    total = float(sum(float(r) for r in rates))
    if total <= 0 or global_batch <= 0:
        raise ValueError(f"ideal_throughput needs positive rates and global batch, got sum {total}, G {global_batch}")
    return global_batch / (global_batch / total + max(0.0, float(allreduce_s)))
