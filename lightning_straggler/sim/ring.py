"""``ring``: every worker computes its batch, then one all-reduce over all N.

Step time = max_i compute_i + allreduce(N, grad_bytes) + loop_overhead. Closed form, vectorised.
"""
from __future__ import annotations

import numpy as np

from lightning_straggler.sim.network import Network
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.workload import Workload


def simulate_ring(workload: Workload, network: Network) -> SimResult:
    n, steps = workload.world_size, workload.steps
    compute = workload.compute_s(np.arange(n)[:, None], np.arange(steps)[None, :])
    step_times = compute.max(axis=0) + network.allreduce_s(n, workload.grad_bytes) + workload.loop_overhead_s
    return SimResult("ring", n, network.name, float(step_times.sum()), float(workload.global_batch * steps),
                     step_times, ideal_throughput(workload, network), per_rank_steps=[steps] * n)
