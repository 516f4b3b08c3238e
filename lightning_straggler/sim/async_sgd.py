"""Baseline: fully asynchronous SGD (throughput only; staleness and its cost to accuracy are not modelled).

Each worker loops on its own: compute its batch, push the gradient and pull fresh parameters
(2 point-to-point messages of grad_bytes to a sharded parameter server assumed never to be the
bottleneck), loop overhead. Nobody waits for anybody. Throughput = sum over workers of
batch / mean iteration time; with a free network and no loop overhead it is exactly the sum of the
workers' own rates, i.e. the numerator of the ideal.
"""
from __future__ import annotations

import numpy as np

from lightning_straggler.sim.network import Network
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.workload import Workload


def simulate_async(workload: Workload, network: Network) -> SimResult:
    n, steps, b = workload.world_size, workload.steps, workload.batch_per_worker
    compute = workload.compute_s(np.arange(n)[:, None], np.arange(steps)[None, :])
    push_pull = 2 * (network.alpha_s + workload.grad_bytes * network.beta_s_per_byte)
    iteration = compute + push_pull + workload.loop_overhead_s
    per_worker_s = iteration.sum(axis=1)
    rate = float((b * steps / per_worker_s).sum())
    # Report the run as "every worker did `steps` steps, in the time that gives that summed rate".
    samples = float(n * b * steps)
    wall = samples / rate
    # no global steps: report an even pace, so the steady-state figure equals the whole-run one
    return SimResult("async", n, network.name, wall, samples, np.full(steps, wall / steps),
                     ideal_throughput(workload, network), per_rank_steps=[steps] * n,
                     notes="throughput only: stale gradients, no convergence model")
