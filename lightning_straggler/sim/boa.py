"""``boa``: per-worker batch sizes from fitted time models, re-planned every ``window_steps`` steps.

Per step: worker i computes its b_i samples (an excluded worker a one-sample placeholder), then one
all-reduce over all N of the weighted gradients: step time = max_i compute_i(b_i) + allreduce(N) +
loop_overhead. Every ``window_steps`` steps rank 0 gathers the window's (batch, compute) records,
fits one time model per worker, solves, and switches allocation when the predicted gain exceeds
``rebalance_gain``; the new allocation applies from two steps later (the step no data loader has
drawn yet: Lightning prefetches one batch). That exchange costs an all-gather and a broadcast of a
few bytes.

The decisions are the project's code: the initial split (``BoaStrategy._initial_allocation``), the
time model per worker (``BoaStrategy._time_model``, which picks between a least-squares fit and a
proportional model), the solver and worker-set tuning (``policies/boa.plan``) and the predicted step
time (``policies/boa.predicted_step_time``). The exchange is two control calls
(``Network.control_s``: alpha-beta plus ``control_op_s`` each). Only the gate "re-plan if the predicted gain > rebalance_gain
and the plan differs" of ``BoaStrategy._decide`` is restated here (:func:`rebalance_decision`),
because ``_decide`` groups the gathered points per rank with a scan over all points for every rank,
O(N^2 x window) (about 31 M Python iterations per decision at 1024 workers); a test checks that
:func:`rebalance_decision` and ``_decide`` agree.

Counted samples: the global batch of every step, less placeholders.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Callable

import numpy as np

from lightning_straggler.config import BoaConfig
from lightning_straggler.policies import boa as boa_policy
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.workload import Workload


def _strategy_class():
    # Imported late: the strategy module needs torch, the rest of the simulator does not.
    from lightning_straggler.strategies.boa import BoaStrategy

    return BoaStrategy


def initial_allocation(world_size: int, local_batch: int, global_batch: int = 0, min_local_batch: int = 1,
                       max_local_batch: int = 0, initial_batch_sizes: Sequence[int] | None = None) -> list[int]:
    """The strategy's own initial split (``BoaStrategy._initial_allocation`` on the simulator's settings)."""
    settings = SimpleNamespace(world_size=world_size, initial_batch_sizes=initial_batch_sizes, global_batch=global_batch,
                               min_local_batch=min_local_batch, max_local_batch=max_local_batch)
    return _strategy_class()._initial_allocation(settings, local_batch)


def rebalance_decision(points: Sequence[Sequence[tuple[float, float]]], current: Sequence[int], global_batch: int,
                       min_local_batch: int = 1, max_local_batch: int = 0, tune_workers: bool = False,
                       measured_allreduce_s: float = 0.0, rebalance_gain: float = 0.05) -> dict | None:
    """What rank 0 decides from ``points[i]`` = rank i's (batch, compute seconds) records: the new
    batch sizes and the predicted step times, or None to keep ``current``."""
    n = len(current)
    strategy = _strategy_class()
    models = [strategy._time_model(list(points[i]), current[i]) for i in range(n)]

    def allreduce_cost_s(k: int) -> float:  # as the strategy scales its measured cost to k workers
        return measured_allreduce_s * (2 * (k - 1) / k) / (2 * (n - 1) / n) if n > 1 else 0.0

    plan = boa_policy.plan(models, global_batch, min_local_batch, max_local_batch or None, tune_workers=tune_workers,
                           allreduce_cost_s=allreduce_cost_s if tune_workers else None)
    predicted_now = boa_policy.predicted_step_time(models, current)
    gain = (predicted_now - plan.predicted_step_time_s) / predicted_now if predicted_now > 0 else 0.0
    if gain <= rebalance_gain or list(plan.batch_sizes) == list(current):
        return None
    return {"batch_sizes": list(plan.batch_sizes), "excluded": list(plan.excluded),
            "predicted_step_s_before": predicted_now, "predicted_step_s_after": plan.predicted_step_time_s,
            "predicted_gain": gain, "models": models}


class _Allocations:
    """Batch sizes in force from given steps on (the strategy's AllocationSchedule without torch)."""

    def __init__(self, initial: Sequence[int]) -> None:
        self.starts, self.sizes = [0], [np.asarray(initial, dtype=np.int64)]

    def at(self, step: int) -> np.ndarray:
        return self.sizes[bisect.bisect_right(self.starts, step) - 1]

    def change(self, from_step: int, sizes: Sequence[int]) -> None:
        if from_step == self.starts[-1]:
            self.sizes[-1] = np.asarray(sizes, dtype=np.int64)
        else:
            self.starts.append(from_step)
            self.sizes.append(np.asarray(sizes, dtype=np.int64))


def simulate_boa(workload: Workload, network: Network, window_steps: int = BoaConfig.window_steps,
                 rebalance_gain: float = BoaConfig.rebalance_gain, history_windows: int = BoaConfig.history_windows,
                 global_batch: int = BoaConfig.global_batch, min_local_batch: int = BoaConfig.min_local_batch,
                 max_local_batch: int = BoaConfig.max_local_batch, tune_workers: bool = BoaConfig.tune_workers, initial_batch_sizes: Sequence[int] | None = None,
                 on_decision: Callable[[int, dict], None] | None = None) -> SimResult:
    n, steps = workload.world_size, workload.steps
    ranks = np.arange(n)
    allocation = _Allocations(initial_allocation(n, workload.batch_per_worker, global_batch, min_local_batch,
                                                 max_local_batch, initial_batch_sizes))
    total_batch = int(allocation.at(0).sum())
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
        sizes = allocation.at(s)
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
