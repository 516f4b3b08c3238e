"""The boundary protocol shared by ``dpar`` and ``awar`` (``strategies/partial_group.py``), step by step.

Between boundaries the group (the ranks in ``group``) runs lock-step: a step lasts
max over members of compute + allreduce(N) + loop_overhead. The all-reduce runs over the whole
world's ring: ranks outside the group have joined (Horovod's ``join()``) and add zeros, so the group
pays what ``ring`` pays, with no process set. A rank outside the group that still computes does local
steps back to back (compute + loop_overhead each, no communication) on the positions after the last
boundary; one that does not compute (DPAR's struck-out) waits.

Boundaries come after position p when (p + 1) is a multiple of ``window_steps`` and at the
workload's sync points (epoch ends, validations, the last step): policies/boundary.is_boundary, the rule the strategy uses.
While everyone is in the group, the policy's ``early`` (policies/boundary.EarlyBoundary, the strategy's
object) sees every step's compute times (in the strategy they ride on the gradient all-reduce: no
cost modelled) and may call a boundary sooner; the members then report their medians over its slow run.
At a boundary (every collective call here is a control call, ``Network.control_s``: its alpha-beta
cost plus the fixed ``control_op_s``):

1. the group has finished position p at time T and joins; an outside rank's join returns and it
   notices at the end of the local step it is in at T (or, if it reached position p itself, it
   blocks until T). It does not start a local step predicted to end after the group gets there
   (``policies/boundary.outside_rank_holds``, the strategy's rule, on the group's median step of the
   window before and the rank's last local steps), but always computes one per window. The boundary
   starts when the last of them arrives. The join is one control call
   over everyone (modelled as an 8-byte all-reduce), paid only when someone is outside;
2. everyone shares its window numbers (position, median compute per step, samples, steps, local
   steps): allgather(N, boundary_bytes) when someone is outside or the boundary is early; with everyone
   in the group at a foreseen boundary they ride on the last step's gradient all-reduce (no cost
   modelled: N rows of 64 bytes on a gradient of megabytes);
3. the algorithm decides (the project's policy) and merges (its cost, ``GroupPolicy.merge_cost_s``);
4. outside ranks pass over the batches up to p (``skip_batch_s`` each), and only then join again: the
   group's next all-reduce needs every rank either in it or joined, so the next window starts when
   the last of them has caught up. A membership change costs nothing more.

So with nobody outside before or after, a boundary costs nothing (the algorithm's merge is 0 for both
when nobody is or was outside): a run without stragglers costs what ``ring`` costs.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional

import numpy as np

from lightning_straggler.policies.boundary import (EarlyBoundary, boundary_eta, is_boundary, model_read_after,
                                                   outside_rank_holds)
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.workload import Workload

#: The per-rank row gathered at a boundary, as the strategy's (RANK, MEDIAN_COMPUTE, SAMPLES, STEPS, LOCAL_STEPS)
#: (the strategy's POSITION column only tells outside ranks where the group is).
Row = tuple[int, Optional[float], int, int, int]


class GroupPolicy:
    """What dpar and awar plug into the protocol: their membership objects (``policies``), as
    ``PartialGroupStrategy`` subclasses use them, plus each merge's modelled cost."""

    name = "partial"
    window_steps = 20
    early: Optional[EarlyBoundary] = None  # the strategy's early-boundary rule, when on

    def group(self) -> tuple[int, ...]:
        raise NotImplementedError

    def computes_outside_group(self, rank: int) -> bool:
        return True

    def on_boundary(self, rows: list[Row], old_group: tuple[int, ...], position: int) -> None:
        raise NotImplementedError

    def merge_cost_s(self, old_group: tuple[int, ...], new_group: tuple[int, ...], network: Network,
                     workload: Workload, model_read: bool = True) -> float:
        """The merge's cost at a boundary; ``model_read``: something reads the model after it (a validation,
        an epoch end, the end of the run: policies/boundary.model_read_after)."""
        return 0.0

    def counts_local_samples(self) -> bool:
        """Whether samples of local steps outside the group reach the model (awar: yes; dpar: no)."""
        return False

    events: list[dict]


def boundary_exchange_s(network: Network, workload: Workload, someone_outside: bool, early: bool) -> float:
    """Steps 1-2 of a boundary: the join and the statistics all-gather, only when someone is outside or the
    boundary is early (else the numbers came with the last step's all-reduce)."""
    n = workload.world_size
    if not (someone_outside or early):
        return 0.0
    join = network.control_s(n, "allreduce", 8.0) if someone_outside else 0.0
    return join + network.control_s(n, "allgather", workload.boundary_bytes)


def simulate_partial_group(workload: Workload, network: Network, policy: GroupPolicy,
                           window_median: Callable[[Sequence[float]], float | None]) -> SimResult:
    n, steps, b = workload.world_size, workload.steps, workload.batch_per_worker
    loop = workload.loop_overhead_s
    time_now = 0.0  # when everyone left the last boundary
    free_at = np.zeros(n)  # when each rank may start its next step after the last boundary (skip cost)
    per_rank_steps = np.zeros(n, dtype=np.int64)
    local_steps = np.zeros(n, dtype=np.int64)  # steps outside the group since last (re)joining it
    samples = 0.0
    step_times: list[float] = []
    step_samples: list[float] = []
    start = 0
    group_step_s: Optional[float] = None  # the group's median step of the last window: outside ranks' prediction
    while start < steps:
        group = policy.group()
        watching = policy.early is not None and policy.early.enabled and len(group) == n
        end, early = start, False
        while True:
            early = watching and policy.early.observe(workload.compute_s(np.arange(n), end).tolist())
            if early or is_boundary(end, policy.window_steps, last_of_epoch=workload.last_of_epoch(end),
                                    total_steps=workload.steps, validation_follows=workload.validation_follows(end)):
                break
            end += 1
        in_group = set(group)
        members = np.asarray(group, dtype=np.int64)
        positions = np.arange(start, end + 1)
        # group members: lock-step
        compute = workload.compute_s(members[:, None], positions[None, :])
        group_steps = compute.max(axis=0) + network.allreduce_s(n, workload.grad_bytes) + loop
        begin = float(free_at.max())  # outside ranks join again once caught up
        t_group = begin + float(group_steps.sum())
        step_times.extend(group_steps.tolist())
        step_times[-len(positions)] += begin - time_now  # the group waited for that in its first step
        medians: list[float | None] = [None] * n
        steps_in_window = np.zeros(n, dtype=np.int64)
        for k, r in enumerate(group):
            medians[r] = policy.early.recent_medians()[r] if early else window_median(compute[k])
            steps_in_window[r] = len(positions)
        samples += float(len(group) * b * len(positions))
        step_samples.extend([float(len(group) * b)] * len(positions))
        # outside ranks: local steps until they meet the signal, or hold for it
        arrive = t_group
        eta = boundary_eta(begin, len(positions), group_step_s)  # from when the last outside rank joined again
        for r in range(n):
            if r in in_group or not policy.computes_outside_group(r):
                continue
            t, times = float(free_at[r]), []
            for q in positions:
                if t >= t_group:
                    break  # polled the signal between two local steps
                if outside_rank_holds(t, eta, float(np.median(times[-3:])) if times else None, len(times)):
                    break  # waits in join() for the signal
                c = float(workload.compute_s(r, q))
                times.append(c)
                t += c + loop
            arrive = max(arrive, t)
            medians[r] = window_median(times) if times else None
            steps_in_window[r] = len(times)
            local_steps[r] += len(times)
            if policy.counts_local_samples():
                samples += float(b * len(times))
                step_samples[-1] += float(b * len(times))  # credited at the merge that uses them
        per_rank_steps += steps_in_window
        rows: list[Row] = [(r, medians[r], int(steps_in_window[r] * b), int(steps_in_window[r]), int(local_steps[r]))
                           for r in range(n)]
        t = arrive + boundary_exchange_s(network, workload, len(group) < n, early)
        policy.on_boundary(rows, group, end)
        if early:
            policy.events.append({"kind": "early_boundary", "step": end, "group": list(policy.group())})
        if policy.early is not None:
            policy.early.reset()
        new_group = policy.group()
        model_read = model_read_after(end, last_of_epoch=workload.last_of_epoch(end), total_steps=workload.steps,
                                      validation_follows=workload.validation_follows(end))
        t += policy.merge_cost_s(group, new_group, network, workload, model_read)
        for r in set(new_group) - in_group:
            local_steps[r] = 0
        step_times[-1] += t - t_group  # the boundary belongs to the window's last step
        group_step_s = float(np.median(group_steps))
        time_now = t
        free_at[:] = t
        for r in set(range(n)) - in_group:
            if steps_in_window[r]:  # it computed outside: it passes over the batches up to the group's position
                free_at[r] = t + (len(positions) - steps_in_window[r]) * workload.skip_batch_s
        start = end + 1
    return SimResult(policy.name, n, network.name, time_now, samples, np.asarray(step_times),
                     ideal_throughput(workload, network), per_rank_steps=per_rank_steps.tolist(),
                     step_samples=np.asarray(step_samples),
                     events=policy.events)
