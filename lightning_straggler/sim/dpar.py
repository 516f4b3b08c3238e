"""``dpar``: the partial-group protocol with DPAR's decisions (``policies/dpar.decide``).

Merge: when any rank is or was excluded, the old group's leader broadcasts parameters and optimizer
state to everyone (broadcast(N, state_bytes)), as ``DparStrategy.on_boundary``. A SLOW rank keeps
doing local steps whose samples are discarded (not counted); a STRUCK_OUT rank computes nothing.
"""
from __future__ import annotations

from lightning_straggler.policies.dpar import (
    ACTIVE,
    STRUCK_OUT,
    DparMemory,
    DparThresholds,
    decide,
    window_median,
)
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.partial_group import (
    GroupPolicy,
    Row,
    simulate_partial_group,
)
from lightning_straggler.sim.result import SimResult
from lightning_straggler.sim.workload import Workload


class DparPolicy(GroupPolicy):
    name = "dpar"

    def __init__(self, world_size: int, window_steps: int = 20, thresholds: DparThresholds | None = None) -> None:
        self.window_steps = window_steps
        self.thresholds = thresholds or DparThresholds()
        self.thresholds.validate(world_size)
        self.memory = DparMemory.initial(world_size)
        self.events: list[dict] = []

    def group(self) -> tuple[int, ...]:
        return tuple(r for r, s in enumerate(self.memory.states) if s == ACTIVE)

    def computes_outside_group(self, rank: int) -> bool:
        return self.memory.states[rank] != STRUCK_OUT

    def on_boundary(self, rows: list[Row], old_group: tuple[int, ...], position: int) -> None:
        decision = decide([row[1] for row in rows], self.memory, self.thresholds)
        self.memory = decision.memory
        for t in decision.transitions:
            self.events.append({"kind": "transition", "step": position, "rank": t.rank, "from_state": t.from_state,
                                "to_state": t.to_state, "ratio": t.ratio, "reason": t.reason})

    def merge_cost_s(self, old_group, new_group, network: Network, workload: Workload) -> float:
        n = workload.world_size
        if len(old_group) < n or len(new_group) < n:
            return network.broadcast_s(n, workload.model_state_bytes)
        return 0.0


def simulate_dpar(workload: Workload, network: Network, window_steps: int = 20,
                  thresholds: DparThresholds | None = None) -> SimResult:
    policy = DparPolicy(workload.world_size, window_steps, thresholds)
    result = simulate_partial_group(workload, network, policy, window_median)
    result.notes = f"final states: {sum(s == ACTIVE for s in policy.memory.states)} active of {workload.world_size}"
    return result
