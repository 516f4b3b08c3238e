"""``awar``: Adaptive Weighted All-Reduce (AWAR thesis).

Profiling classifies stragglers (``policies/awar.py``). The normal group all-reduces gradients every
step (stragglers have joined and add zeros: no process set) while stragglers train asynchronously on
their own copy of the model:
local steps on their own shard, nobody waits for them (the boundary protocol is in
``partial_group.py``). At every epoch end, before validation, at the end of training and, with
``period_steps`` > 0, every ``period_steps`` steps, a weighted model average merges everyone:
``theta = sum_i w_i theta_i / sum_i w_i`` with w_i the gradient updates rank i contributed since the
last average (``weighting="updates"``: a group member counts the group's steps, a straggler its own
local steps) or its samples (``weighting="samples"``). Then classification is re-evaluated on the
period's compute times and recovered stragglers rejoin the group.

What the average does to the rest of the training state (documented choice, tested):
* parameters and floating-point buffers (e.g. batch-norm running statistics): the weighted average;
* optimizer state (momentum, Adam moments and step counts) and integer buffers: the group leader's,
  broadcast to everyone. Averaging moments of models that took different paths has no clear meaning,
  and the group's state belongs to the model that contributed most of the updates.
Batches a straggler passes over to catch up with the group at a merge are not trained on.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from torch import Tensor
from typing_extensions import override

from lightning_straggler.config import AwarConfig
from lightning_straggler.policies.awar import NORMAL, STRAGGLER, WEIGHTINGS, AwarMembership, AwarThresholds, merge_window
from lightning_straggler.strategies.partial_group import MEDIAN_COMPUTE, SAMPLES, STEPS, PartialGroupStrategy



class AwarStrategy(PartialGroupStrategy):
    """Adaptive Weighted All-Reduce (``strategy="awar"``): stragglers train alone on their own copy while the
    group all-reduces every step; a model average weighted by each worker's updates (or samples) merges
    everyone at epoch ends, before validation, at the end and every ``period_steps`` (see the module docstring).

    Args:
        period_steps: also merge and re-classify every N optimizer steps (0 = only at epoch ends, before
            validation and at the end of training). Default 20.
        react_steps: while nobody is outside the group, re-classify at once when a worker has been
            ``slow_ratio`` x the median for this many steps in a row (>= 0, 0 = off; default 3).
        slow_ratio: a worker is a straggler when its median compute per step is at least this x the
            group's, > 1 (default 1.5).
        recover_ratio: a straggler rejoins the group when back under this x the group's, in
            [1, ``slow_ratio``).
        min_group: never fewer workers in the synchronous group (0 = half, rounded up); the least slow
            stragglers stay in.
        weighting: ``"updates"`` (gradient updates contributed since the last average, the thesis) or
            ``"samples"``.
        **kwargs: :class:`HorovodStrategy`'s arguments.
    """

    strategy_name = "awar"

    # defaults: the config schema's (one source for Trainer(strategy=AwarStrategy()), Hydra and the simulator)
    def __init__(self, period_steps: int = AwarConfig.period_steps, react_steps: int = AwarConfig.react_steps,
                 slow_ratio: float = AwarConfig.slow_ratio,
                 recover_ratio: float = AwarConfig.recover_ratio, min_group: int = AwarConfig.min_group,
                 weighting: str = AwarConfig.weighting, **kwargs: Any) -> None:
        if not isinstance(period_steps, int) or isinstance(period_steps, bool) or period_steps < 0:
            raise ValueError(f"period_steps must be an integer >= 0 (0 = only at epoch ends) (got {period_steps!r})")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)} (got {weighting!r})")
        super().__init__(window_steps=merge_window(period_steps), react_steps=react_steps, **kwargs)
        self.period_steps, self.weighting = period_steps, weighting
        self.thresholds = AwarThresholds(slow_ratio=slow_ratio, recover_ratio=recover_ratio, min_group=min_group)
        self.membership: Optional[AwarMembership] = None  # made at set-up, when the world size is known

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.membership = AwarMembership(self.world_size, self.thresholds, self.weighting, self.comm.join_is_fixed())
        self.note_group_floor(self.membership.configured_floor, self.membership.thresholds.min_group)

    @property
    @override
    def slow_ratio(self) -> float:
        return self.thresholds.slow_ratio

    @property
    def states(self) -> List[str]:
        return list(self.membership.states) if self.membership else [NORMAL] * self.world_size

    @override
    def group(self) -> Tuple[int, ...]:
        return self.membership.group() if self.membership else tuple(range(self.world_size))

    def model_tensors(self) -> List[Tensor]:
        """What the weighted average covers: parameters and floating-point buffers."""
        module = self.lightning_module
        return [p.data for p in module.parameters()] + [b.data for b in module.buffers() if b.is_floating_point()]

    def weighted_average(self, weights: List[float], leader: int) -> None:
        """theta <- sum_i w_i theta_i (weights sum to 1): one all-reduce of the weighted tensors; then the
        leader's optimizer state and integer buffers for everyone."""
        tensors = self.model_tensors()
        for t in tensors:
            t.mul_(weights[self.global_rank])
        self.comm.allreduce_grouped_(tensors, op="sum", tag="awar_average")
        module = self.lightning_module
        for name, buffer in module.named_buffers():
            if not buffer.is_floating_point():
                self.comm.broadcast_(buffer.data, root=leader, tag=f"buffer.{name}")
        for i, optimizer in enumerate(self.optimizers):
            state = self.comm.broadcast_object(optimizer.state_dict(), root=leader, tag=f"optimizer{i}")
            if self.global_rank != leader:
                optimizer.load_state_dict(state)

    @override
    def on_boundary(self, rows: List[List[float]], old_group: Tuple[int, ...], position: int) -> None:
        if self.membership.merges(old_group):  # someone trained on its own copy: merge
            updates, samples = [r[STEPS] for r in rows], [r[SAMPLES] for r in rows]
            weights = self.membership.merge_weights(updates, samples)
            self.weighted_average(weights, leader=old_group[0])
            self.record_event("average", step=position, weighting=self.weighting, weights=weights,
                              updates=[int(u) for u in updates], samples=[int(s) for s in samples],
                              stragglers=[r for r in range(self.world_size) if r not in old_group])
        times = [None if r[MEDIAN_COMPUTE] != r[MEDIAN_COMPUTE] else r[MEDIAN_COMPUTE] for r in rows]  # NaN -> None
        for change in self.membership.classify(times):
            self.record_event("classification", step=position, **change)

    @override
    def model_diverges(self) -> bool:
        return len(self.group()) < self.world_size  # stragglers train their own copies until the next merge

    @override
    def strategy_state(self) -> dict:
        state = super().strategy_state()
        state["awar"] = {"states": list(self.states)}
        return state

    @override
    def load_strategy_state(self, state: dict) -> None:
        super().load_strategy_state(state)
        self.membership.restore(state["awar"]["states"])


__all__ = ["AwarStrategy", "NORMAL", "STRAGGLER"]
