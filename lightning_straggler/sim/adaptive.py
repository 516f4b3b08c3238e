"""``adaptive``: BOA's step (``sim/boa.py``) with the strategy's per-step speed-change detector.

Per step: worker i computes its b_i samples (a left-out worker a one-sample placeholder), then one
all-reduce over all N of the weighted gradients (with one float per worker of timing in it: not
modelled, N floats next to the gradient): step time = max_i compute_i(b_i) + allreduce(N) +
loop_overhead. After each step every worker's (b_i, compute_i) goes to the strategy's
``policies/adaptive.SpeedChangeDetector``; when it reports a change, or every ``window_steps``, rank 0
re-plans with ``policies/boa.rebalance_decision`` on the detector's points and broadcasts the plan
(one control call), which applies from the next step, as in ``AdaptiveStrategy._replan`` (the
strategy's loader has not drawn it yet at that point).

Counted samples: the global batch of every step, less placeholders.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_straggler.config import AdaptiveConfig as A
from lightning_straggler.policies.adaptive import SpeedChangeDetector
from lightning_straggler.policies.boa import initial_allocation, rebalance_decision
from lightning_straggler.policies.boa_schedule import AllocationSchedule
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.workload import Workload


def simulate_adaptive(workload: Workload, network: Network, react_steps: int = A.react_steps,
                      react_ratio: float = A.react_ratio, history_steps: int = A.history_steps,
                      global_batch: int = A.global_batch, min_local_batch: int = A.min_local_batch,
                      max_local_batch: int = A.max_local_batch, window_steps: int = A.window_steps,
                      rebalance_gain: float = A.rebalance_gain, tune_workers: bool = A.tune_workers,
                      initial_batch_sizes: Sequence[int] | None = None, seed: int = A.seed) -> SimResult:
    n, steps = workload.world_size, workload.steps
    ranks = np.arange(n)
    allocation = AllocationSchedule(initial_allocation(n, workload.batch_per_worker, global_batch, min_local_batch,
                                                       max_local_batch, initial_batch_sizes))
    detector = SpeedChangeDetector(n, react_steps, react_ratio, history_steps)
    allreduce = network.allreduce_s(n, workload.grad_bytes)
    plan_broadcast = network.control_s(n, "broadcast", 1024)
    step_times, step_samples = np.zeros(steps), np.zeros(steps)
    events: list[dict] = []
    for s in range(steps):
        sizes = np.asarray(allocation.at(s), dtype=np.int64)
        computed = np.maximum(sizes, 1)
        compute = workload.compute_s(ranks, s, computed)
        step_times[s] = compute.max() + allreduce + workload.loop_overhead_s
        step_samples[s] = float(sizes.sum())
        changed = detector.observe(computed.tolist(), compute.tolist())
        if changed or (window_steps and (s + 1) % window_steps == 0):
            step_times[s] += plan_broadcast
            decision = rebalance_decision(detector.points(), [int(b) for b in allocation.at(s + 1)],
                                          allocation.global_batch, min_local_batch, max_local_batch, tune_workers,
                                          allreduce, rebalance_gain)
            if decision is not None:
                allocation.change(s + 1, decision["batch_sizes"])
                events.append({"kind": "rebalance", "step": s, "from_step": s + 1, "changed_ranks": changed,
                               **{k: v for k, v in decision.items() if k != "models"}})
    return SimResult("adaptive", n, network.name, float(step_times.sum()), float(step_samples.sum()), step_times,
                     ideal_throughput(workload, network), per_rank_steps=[steps] * n, step_samples=step_samples,
                     events=events)
