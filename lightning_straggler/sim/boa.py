"""``boa``: per-worker batch sizes from fitted time models, re-planned every ``window_steps`` steps.

Per step: worker i computes its b_i samples (an excluded worker a one-sample placeholder), then one
all-reduce over all N of the weighted gradients: step time = max_i compute_i(b_i) + allreduce(N) +
loop_overhead. Every ``window_steps`` steps rank 0 gathers the window's (batch, compute) records,
fits one time model per worker, solves, and switches allocation when the predicted gain exceeds
``rebalance_gain``; the new allocation applies here from two steps later. The strategy applies it
from the next step (the first its sampler has not drawn: ``from_step`` = step + 1 in measured runs'
"rebalance" events), so this model keeps the old allocation one step longer per re-plan; left so
because the committed projections and simulator validation were made with it. That exchange costs
an all-gather and a broadcast of a few bytes.

The decisions are the strategy's own, from ``policies/boa.py``: the initial split
(``initial_allocation``), the re-planning at a window's end (``rebalance_decision``: each worker's
time model, least-squares fit or proportional, the solver and worker-set tuning, the gain gate). The
exchange is two control calls (``Network.control_s``: alpha-beta plus ``control_op_s`` each).

Counted samples: the global batch of every step, less placeholders.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import numpy as np

from lightning_straggler.config import BoaConfig
from lightning_straggler.policies.boa import initial_allocation, rebalance_decision
from lightning_straggler.policies.boa_schedule import AllocationSchedule
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.workload import Workload


def simulate_boa(workload: Workload, network: Network, window_steps: int = BoaConfig.window_steps,
                 rebalance_gain: float = BoaConfig.rebalance_gain, history_windows: int = BoaConfig.history_windows,
                 global_batch: int = BoaConfig.global_batch, min_local_batch: int = BoaConfig.min_local_batch,
                 max_local_batch: int = BoaConfig.max_local_batch, tune_workers: bool = BoaConfig.tune_workers, initial_batch_sizes: Sequence[int] | None = None,
                 on_decision: Callable[[int, dict], None] | None = None) -> SimResult:
    n, steps = workload.world_size, workload.steps
    ranks = np.arange(n)
    allocation = AllocationSchedule(initial_allocation(n, workload.batch_per_worker, global_batch, min_local_batch,
                                                 max_local_batch, initial_batch_sizes))
    total_batch = allocation.global_batch
    allreduce = network.allreduce_s(n, workload.grad_bytes)
    # the window's records gathered, the decision broadcast: two control calls
    exchange = (network.control_s(n, "allgather", workload.boundary_bytes * window_steps)
                + network.control_s(n, "broadcast", 1024))
    step_times = np.zeros(steps)
    window_records: list[tuple[np.ndarray, np.ndarray]] = []  # (batch sizes, compute times) per step
    history: list[list[tuple[np.ndarray, np.ndarray]]] = []
    events, samples = [], 0.0
    step_samples = np.zeros(steps)
    for s in range(steps):
        sizes = np.asarray(allocation.at(s), dtype=np.int64)
        computed = np.maximum(sizes, 1)  # a left-out worker steps on a one-sample placeholder
        compute = workload.compute_s(ranks, s, computed)
        step_times[s] = compute.max() + allreduce + workload.loop_overhead_s
        step_samples[s] = float(sizes.sum())
        samples += step_samples[s]
        if window_steps and (s + 1) % window_steps == 0:
            # the strategy's window holds the closed records, i.e. up to the previous step
            history = (history + [window_records])[-history_windows:]
            window_records = []
            points = [[(float(b[i]), float(t[i])) for window in history for b, t in window] for i in range(n)]
            current = [int(x) for x in allocation.at(s + 2)]
            decision = rebalance_decision(points, current, total_batch, min_local_batch, max_local_batch,
                                          tune_workers, allreduce, rebalance_gain) if all(points) else None
            step_times[s] += exchange
            if decision is not None:
                allocation.change(s + 2, decision["batch_sizes"])
                events.append({"step": s + 2, **{k: v for k, v in decision.items() if k != "models"}})
                if on_decision is not None:
                    on_decision(s, decision)
        window_records.append((computed, compute))
    return SimResult("boa", n, network.name, float(step_times.sum()), samples, step_times,
                     ideal_throughput(workload, network), per_rank_steps=[steps] * n, step_samples=step_samples,
                     events=events)
