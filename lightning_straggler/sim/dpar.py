"""``dpar``: the partial-group protocol with DPAR's decisions (``policies/dpar.decide``).

Merge (``policies/dpar.merges``): when an excluded rank is re-admitted, and before the model is read (a
validation, an epoch end, the run's end) while a rank is excluded, the old group's leader broadcasts
the training state to everyone, as ``DparStrategy.on_boundary`` /
``broadcast_training_state``: each of the ``state_tensors`` tensors of the module's state_dict in its
own broadcast (grad_bytes in all), then the optimizer's state_dict with ``broadcast_object`` (its
pickled length, then ``optimizer_state_bytes``); every call a control call (alpha-beta +
``control_op_s``)::

    state_broadcast_s = state_tensors * control_s(N, broadcast, grad_bytes / state_tensors)
                        + broadcast_object_s(N, optimizer_state_bytes)

So while someone is excluded it is paid at a re-admission and before every validation, epoch end and
the end of the run, not at mere window ends. A SLOW rank keeps
doing local steps whose samples are discarded (not counted); a STRUCK_OUT rank computes nothing.
"""
from __future__ import annotations

from lightning_straggler.config import DparConfig
from lightning_straggler.policies.boundary import EarlyBoundary
from lightning_straggler.policies.dpar import ACTIVE, DparMembership, DparThresholds, window_median
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.partial_group import (
    GroupPolicy,
    Row,
    simulate_partial_group,
)
from lightning_straggler.sim.result import SimResult
from lightning_straggler.sim.workload import Workload


class DparPolicy(GroupPolicy):
    """The strategy's membership (``policies.dpar.DparMembership``) plugged into the simulated protocol.
    ``join_fixed``: the Horovod build of scripts/setup.sh; False models a stock Horovod 0.28.1."""

    name = "dpar"

    def __init__(self, world_size: int, window_steps: int = DparConfig.window_steps, thresholds: DparThresholds | None = None,
                 join_fixed: bool = True, react_steps: int = DparConfig.react_steps) -> None:
        self.window_steps = window_steps
        self.membership = DparMembership(world_size, thresholds or DparThresholds(), join_fixed)
        self.early = EarlyBoundary(world_size, react_steps, self.membership.thresholds.slow_ratio)
        self.events: list[dict] = []

    @property
    def thresholds(self) -> DparThresholds:
        return self.membership.thresholds

    def group(self) -> tuple[int, ...]:
        return self.membership.group()

    def computes_outside_group(self, rank: int) -> bool:
        return self.membership.computes_outside_group(rank)

    def on_boundary(self, rows: list[Row], old_group: tuple[int, ...], position: int) -> None:
        decision = self.membership.decide([row[1] for row in rows])
        for t in decision.transitions:
            self.events.append({"kind": "transition", "step": position,
                                **self.membership.transition_event(t, decision.group_time)})

    def merge_cost_s(self, old_group, new_group, network: Network, workload: Workload, model_read: bool = True) -> float:
        merges = self.membership.merges(old_group, new_group, model_read)
        return state_broadcast_s(network, workload) if merges else 0.0


def state_broadcast_s(network: Network, workload: Workload) -> float:
    """``HorovodStrategy.broadcast_training_state`` over everyone (see the module docstring)."""
    n, k = workload.world_size, workload.state_tensors
    return (network.control_s(n, "broadcast", workload.grad_bytes / k, calls=k)
            + network.broadcast_object_s(n, workload.optimizer_state_bytes))


def simulate_dpar(workload: Workload, network: Network, window_steps: int = DparConfig.window_steps,
                  thresholds: DparThresholds | None = None, react_steps: int = DparConfig.react_steps) -> SimResult:
    policy = DparPolicy(workload.world_size, window_steps, thresholds, react_steps=react_steps)
    result = simulate_partial_group(workload, network, policy, window_median)
    result.notes = f"final states: {sum(s == ACTIVE for s in policy.membership.states)} active of {workload.world_size}"
    return result
