"""``adaptive``: BOA's step (``sim/boa.py``) with the strategy's per-step speed-change detector.

Per step: worker i computes its b_i samples (a left-out worker a one-sample placeholder), then one
all-reduce over all N of the weighted gradients (with one float per worker of timing in it: not
modelled, N floats next to the gradient): step time = max_i compute_i(b_i) + allreduce(N) +
loop_overhead. After each step every worker's (b_i, compute_i) goes to the strategy's
``policies/adaptive.SpeedChangeDetector``; when it reports a change, or every ``window_steps``, rank 0
re-plans with ``policies/boa.rebalance_decision`` on the detector's points. A change's plan is
broadcast (one control call, every rank free) and applies from the next step; a window's plan rides on
the next step's all-reduce (no cost) and applies from the step after that (s + 2 for a plan decided
after step s), as ``AdaptiveStrategy._replan_now`` / ``_replan_with_next_step`` with a loader that draws
batch by batch.

The step deadline (``policies/deadline.StepDeadline`` and ``arrived_scale``, the strategy's own objects):
a step opens at T (the group's last collective ended); rank i reaches it at r_i = max(T, the end of a
compute it is still busy with); a rank that reaches it at or past the cut-off T + deadline is cut at once
(it skips the compute), else it computes until f_i = r_i + compute_i and hands in at f_i, or is cut at the
cut-off when f_i is later (it stays busy until f_i). The all-reduce starts when the last rank has handed
in (a rank behind holds the step until it reaches it: nothing runs ahead of its training loop). The
periods between step closings feed the deadline; a cut rank's time in the detector is how long it had
been given (or its speed on its last late step, if that says more), amended with its real time at the
next step, as the strategy's amend slot does. A change's broadcast waits for every rank to be free.

Counted samples: the global batch of every step, less placeholders and the cut ranks' samples.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_straggler.config import AdaptiveConfig as A
from lightning_straggler.policies.adaptive import SpeedChangeDetector
from lightning_straggler.policies.deadline import StepDeadline
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
                      initial_batch_sizes: Sequence[int] | None = None, seed: int = A.seed,
                      deadline_factor: float = A.deadline_factor,
                      deadline_history_steps: int = A.deadline_history_steps) -> SimResult:
    n, steps = workload.world_size, workload.steps
    ranks = np.arange(n)
    allocation = AllocationSchedule(initial_allocation(n, workload.batch_per_worker, global_batch, min_local_batch,
                                                       max_local_batch, initial_batch_sizes))
    detector = SpeedChangeDetector(n, react_steps, react_ratio, history_steps)
    allreduce = network.allreduce_s(n, workload.grad_bytes)
    plan_broadcast = network.control_s(n, "broadcast", 1024)
    step_times, step_samples = np.zeros(steps), np.zeros(steps)
    events: list[dict] = []
    deadline = StepDeadline(deadline_factor, deadline_history_steps)
    now, last_close = 0.0, None  # the group's last collective ended at ``now``
    busy_until = np.zeros(n)  # when each rank's main thread finishes the compute it is in
    true_pending = np.zeros(n)  # a rank cut while computing: its real time, sent with the next step
    late_per_sample = np.full(n, np.nan)  # ... and its per-sample time then (its speed, for a skipped step)
    for s in range(steps):
        opened = now
        sizes = np.asarray(allocation.at(s), dtype=np.int64)
        computed = np.maximum(sizes, 1)
        compute = workload.compute_s(ranks, s, computed)
        reach = np.maximum(opened, busy_until)
        cut_off = opened + (deadline.seconds() if deadline.seconds() is not None else np.inf)
        finish = reach + compute
        skipped = reach >= cut_off
        late = ~skipped & (finish > cut_off)
        arrived = ~skipped & ~late
        hand_in = np.where(skipped, reach, np.where(late, cut_off, finish))
        busy_until = np.where(skipped, reach, finish)
        close = hand_in.max() + allreduce
        step_samples[s] = float(sizes[arrived].sum())
        # a cut rank: the time it had been given, or its speed on its last late step if that says more
        estimate = np.nan_to_num(late_per_sample * computed, nan=0.0)
        seen = np.where(arrived, compute, np.maximum(hand_in - opened, estimate))
        for r in np.flatnonzero(true_pending > 0):  # the previous step's real time of a rank cut while computing
            detector.amend_last(int(r), float(true_pending[r]))
        true_pending = np.where(late, compute, 0.0)
        late_per_sample = np.where(late, compute / computed, np.where(arrived, np.nan, late_per_sample))
        if not arrived.all():
            events.append({"kind": "deadline_cut", "step": s, "ranks": [int(r) for r in ranks[~arrived]]})
        if last_close is not None:
            deadline.observe(close - last_close)
        last_close = close
        now = close + workload.loop_overhead_s
        changed = detector.observe(computed.tolist(), seen.tolist())
        if (changed or (window_steps and (s + 1) % window_steps == 0)) and s + 1 < steps:  # the last step's plan is never sent
            if changed:  # broadcast now, in force from the next step
                now = max(now, float(busy_until.max())) + plan_broadcast  # every rank takes part
            start = s + 1 if changed else s + 2  # a window's plan: sent with step s + 1's all-reduce
            decision = rebalance_decision(detector.points(), [int(b) for b in allocation.at(s + 1)],
                                          allocation.global_batch, min_local_batch, max_local_batch, tune_workers,
                                          allreduce, rebalance_gain)
            if decision is not None:
                allocation.change(start, decision["batch_sizes"])
                events.append({"kind": "rebalance", "step": s, "from_step": start, "changed_ranks": changed,
                               **{k: v for k, v in decision.items() if k != "models"}})
        step_times[s] = now - opened
    return SimResult("adaptive", n, network.name, float(step_times.sum()), float(step_samples.sum()), step_times,
                     ideal_throughput(workload, network), per_rank_steps=[steps] * n, step_samples=step_samples,
                     events=events)
