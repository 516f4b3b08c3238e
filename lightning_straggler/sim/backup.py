"""Baseline: synchronous SGD with b backup workers (Chen, Pan, Monga, Bengio, Jozefowicz 2016,
"Revisiting Distributed Synchronous SGD", arXiv:1604.00981).

Of the N workers, each step aggregates the gradients of the first N - b to finish; the b slowest
are dropped for that step (their samples do not count) and, in this model, abandon their batch and
start the next step with everyone else (the most favourable reading for the baseline: a late worker
that finished its stale batch first would also be late for the next step). Chen et al. aggregate on
parameter servers; here the aggregation is an all-reduce in which all N take part (the dropped
workers contribute zeros), so its cost is allreduce(N). Step time = (N-b)-th smallest compute +
allreduce(N) + loop_overhead; with b = 0 this is exactly ``ring``.
"""
from __future__ import annotations

import numpy as np

from lightning_straggler.sim.network import Network
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.workload import Workload


def simulate_backup(workload: Workload, network: Network, backups: int = 1) -> SimResult:
    n, steps = workload.world_size, workload.steps
    if not (isinstance(backups, int) and 0 <= backups < n):
        raise ValueError(f"backups must be an integer in 0..world_size-1 = 0..{n - 1} (got {backups!r})")
    kept = n - backups
    compute = workload.compute_s(np.arange(n)[:, None], np.arange(steps)[None, :])
    finish = np.partition(compute, kept - 1, axis=0)[kept - 1]  # the kept-th fastest worker of each step
    step_times = finish + network.allreduce_s(n, workload.grad_bytes) + workload.loop_overhead_s
    return SimResult(f"backup{backups}", n, network.name, float(step_times.sum()),
                     float(kept * workload.batch_per_worker * steps), step_times,
                     ideal_throughput(workload, network), per_rank_steps=[steps] * n,
                     notes=f"{backups} backup worker(s): first {kept} of {n} gradients per step")
