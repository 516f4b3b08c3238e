"""``dssync``: Divide-and-Shuffle. Each step a worker averages (parameters, after its local step) only
within its group of that step's partition, chosen by the project's ``DSSyncSchedule``
(``policies/dssync.py``); a global average over everyone at sync points (epoch ends, validations,
the end) and every ``global_every_steps`` steps, as the strategy does.

Event rule: a group's average starts when its last member has finished computing the step, costs
allreduce(|G|, grad_bytes) (parameters are the size of the gradient), and releases every member at
the same time; so a straggler only holds up its own group, and slowness spreads to the next step's
groups through their members' start times. A global average is a barrier plus one control all-reduce over everyone
(``control_s(N, allreduce, grad_bytes)`` = allreduce(N) + ``control_op_s``), skipped when the
models already agree (the step's partition was one group of everyone), as ``DSSyncStrategy.global_average``.
The per-step group average is the steady-state exchange (no ``control_op_s``); any other per-step
work of the real strategy is in ``loop_overhead_s``.
With ``exchange="alltoall"`` the step's groups average inside one world all-to-all: it starts when every
rank has finished computing and costs ``group_alltoall_s(|G|, grad_bytes)`` per group (the largest group
decides), so a straggler holds up everyone, as in ``ring``. With ``exchange="aligned"`` every rank first
takes part in a one-value world all-reduce (``allreduce_s(N, 4)``), then the groups average as under
``"sets"``, all starting together (no alignment for one group of everyone): a straggler holds up everyone
too. ``exchange="direct"`` is modelled as ``"sets"`` (independent groups): what sets it apart in practice,
Horovod's one coordination thread shared by the sets, is not in the model either.
Every sample counts (every gradient updates some model). Vectorised per group size.
"""
from __future__ import annotations

import numpy as np

from lightning_straggler.config import DSSYNC_EXCHANGES
from lightning_straggler.policies.dssync import DSSyncSchedule
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.workload import Workload


def _members_by_size(partition) -> list[np.ndarray]:
    """The partition's groups as one [groups, size] index array per distinct group size."""
    by_size: dict[int, list[tuple[int, ...]]] = {}
    for g in partition:
        by_size.setdefault(len(g), []).append(g)
    return [np.asarray(groups, dtype=np.int64) for groups in by_size.values()]


def simulate_dssync(workload: Workload, network: Network, group_size: int = 2, schedule: str = "butterfly",
                    num_partitions: int | None = None, seed: int = 0,
                    global_every_steps: int = 0, exchange: str = "sets") -> SimResult:
    if exchange not in DSSYNC_EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(DSSYNC_EXCHANGES)} (got {exchange!r})")
    n, steps = workload.world_size, workload.steps
    plan = DSSyncSchedule(n, min(group_size, n), schedule, num_partitions, seed)
    layouts = [_members_by_size(plan.partition(i)) for i in range(plan.num_partitions)]
    ranks = np.arange(n)
    clock = np.zeros(n)  # when each worker is free to start its next step
    step_end = np.zeros(steps)
    rank_end = np.zeros((steps, n))
    globals_done = 0
    for s in range(steps):
        ready = clock + workload.compute_s(ranks, s) + workload.loop_overhead_s
        sizes = [members.shape[1] for members in layouts[s % plan.num_partitions]]
        if exchange == "alltoall" and max(sizes) > 1:  # one world operation: everyone starts it together
            clock[:] = ready.max() + max(network.group_alltoall_s(k, workload.grad_bytes) for k in sizes)
        elif exchange == "alltoall":  # groups of one: the strategy runs no exchange at all
            clock[:] = ready
        else:
            if exchange == "aligned" and max(sizes) > 1 and len(plan.partition(s)) > 1:  # starts every group together
                ready[:] = ready.max() + network.allreduce_s(n, 4)
            for members in layouts[s % plan.num_partitions]:
                size = members.shape[1]
                done = ready[members].max(axis=1) + network.allreduce_s(size, workload.grad_bytes)
                clock[members] = done[:, None]
        consensus = len(plan.partition(s)) == 1  # one group of everyone: nothing to average globally
        if not consensus and (workload.is_sync_point(s) or (global_every_steps and (s + 1) % global_every_steps == 0)):
            clock[:] = clock.max() + network.control_s(n, "allreduce", workload.grad_bytes)
            globals_done += 1
        step_end[s] = clock.max()
        rank_end[s] = clock
    step_times = np.diff(np.concatenate([[0.0], step_end]))
    return SimResult("dssync", n, network.name, float(clock.max()), float(workload.global_batch * steps),
                     step_times, ideal_throughput(workload, network), per_rank_steps=[steps] * n,
                     notes=f"group_size {plan.group_size}, {schedule}, exchange {exchange}, {globals_done} global averages",
                     rank_step_end_s=rank_end)
