"""``awar``: the partial-group protocol with AWAR's decisions (``policies/awar.classify`` and
``average_weights``).

At a boundary where someone trained outside the group, the weighted model average is, as
``AwarStrategy.weighted_average``, one grouped all-reduce of the parameters and float buffers over
everyone, then the leader's optimizer state with ``broadcast_object`` (pickled length, then
``optimizer_state_bytes``); every call a control call (alpha-beta + ``control_op_s``)::

    merge_s = control_s(N, allreduce, grad_bytes) + broadcast_object_s(N, optimizer_state_bytes)

(integer buffers, broadcast one by one, are not modelled: the project's models have none).
Stragglers' local steps count: their updates enter the average with their weight.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from lightning_straggler.config import AwarConfig
from lightning_straggler.policies.boundary import EarlyBoundary
from lightning_straggler.policies.awar import AwarMembership, AwarThresholds, merge_window
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.partial_group import (
    GroupPolicy,
    Row,
    simulate_partial_group,
)
from lightning_straggler.sim.result import SimResult
from lightning_straggler.sim.workload import Workload


def _median_or_none(times: Sequence[float]) -> float | None:
    # the strategy takes statistics.median of the window's compute times (NaN, i.e. None, when empty)
    return float(statistics.median(times)) if len(times) else None


class AwarPolicy(GroupPolicy):
    """The strategy's membership (``policies.awar.AwarMembership``) plugged into the simulated protocol.
    ``join_fixed``: the Horovod build of scripts/setup.sh; False models a stock Horovod 0.28.1."""

    name = "awar"

    def __init__(self, world_size: int, period_steps: int = AwarConfig.period_steps, thresholds: AwarThresholds | None = None,
                 weighting: str = AwarConfig.weighting, join_fixed: bool = True,
                 react_steps: int = AwarConfig.react_steps) -> None:
        self.window_steps = merge_window(period_steps)
        self.membership = AwarMembership(world_size, thresholds or AwarThresholds(), weighting, join_fixed)
        self.early = EarlyBoundary(world_size, react_steps, self.membership.thresholds.slow_ratio)
        self.events: list[dict] = []

    @property
    def thresholds(self) -> AwarThresholds:
        return self.membership.thresholds

    def group(self) -> tuple[int, ...]:
        return self.membership.group()

    def counts_local_samples(self) -> bool:
        return True

    def on_boundary(self, rows: list[Row], old_group: tuple[int, ...], position: int) -> None:
        if self.membership.merges(old_group):
            updates, samples = [row[3] for row in rows], [row[2] for row in rows]
            self.events.append({"kind": "average", "step": position, "weights": self.membership.merge_weights(updates, samples),
                                "updates": updates, "stragglers": [r for r in range(len(rows)) if r not in old_group]})
        for change in self.membership.classify([row[1] for row in rows]):
            self.events.append({"kind": "classification", "step": position, **change})

    def merge_cost_s(self, old_group, new_group, network: Network, workload: Workload, model_read: bool = True) -> float:
        return merge_s(network, workload) if self.membership.merges(old_group) else 0.0


def merge_s(network: Network, workload: Workload) -> float:
    """The weighted average and the optimizer-state broadcast (see the module docstring)."""
    n = workload.world_size
    return (network.control_s(n, "allreduce", workload.grad_bytes)
            + network.broadcast_object_s(n, workload.optimizer_state_bytes))


def simulate_awar(workload: Workload, network: Network, period_steps: int = AwarConfig.period_steps,
                  thresholds: AwarThresholds | None = None, weighting: str = AwarConfig.weighting,
                  react_steps: int = AwarConfig.react_steps) -> SimResult:
    policy = AwarPolicy(workload.world_size, period_steps, thresholds, weighting, react_steps=react_steps)
    result = simulate_partial_group(workload, network, policy, _median_or_none)
    result.notes = f"final group: {len(policy.group())} of {workload.world_size}"
    return result
