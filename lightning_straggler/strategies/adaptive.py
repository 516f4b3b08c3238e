"""``adaptive``: BOA's per-worker batch sizes, re-planned within ``react_steps`` steps of a speed change.

A :class:`BoaStrategy` (same sampler, same weighted gradients: whenever the allocation gives every
worker samples, a step equals a single-process step on the global batch) whose measurements travel
with the gradients: every rank adds its compute time of the step to the step's all-reduce (one slot
per rank, no extra collective), so every rank holds every rank's (batch size, seconds) of every step
and feeds them, in the same order, to ``policies/adaptive.SpeedChangeDetector``. When a worker's
speed changes (``react_ratio`` x slower or faster than its own recent per-sample time for
``react_steps`` steps in a row) its older points are dropped and rank 0 re-plans at once with BOA's
solver (``policies/boa.rebalance_decision``: time models, worker-set tuning, gain gate) and broadcasts
the plan, which takes effect at the first step no rank's loader has drawn (the next step when the
loader draws batch by batch; later when DataLoader workers prefetch). Every ``window_steps`` it re-plans as BOA does, on the same per-step points. A
collapsed worker gets few samples or, with ``tune_workers`` (on by default here), none: it steps on a
one-sample placeholder with weight 0 until its measured speed recovers, when the next re-plan gives it
samples again.

What it does not do (README "adaptive"): close a step at a deadline without a late worker's gradients
(eager-SGD's partial collectives). The group waits for a collapsed worker's ``react_steps`` slow steps
and for the steps its loader has already drawn; a frozen worker is the watchdog's (it is named and the
job restarts without it).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_straggler.config import AdaptiveConfig as A
from lightning_straggler.policies.adaptive import SpeedChangeDetector, check_settings
from lightning_straggler.strategies.boa import BoaStrategy


class AdaptiveStrategy(BoaStrategy):
    """BOA's batch orchestration that reacts within a few steps (``strategy="adaptive"``): per-worker batch
    sizes from time models fitted on per-step measurements that every rank receives with the gradients; a
    worker whose speed changes triggers a re-plan ``react_steps`` steps later (see the module docstring).

    Args:
        react_steps: steps in a row a worker must be ``react_ratio`` x slower or faster than its own recent
            per-sample time before the allocation is re-planned (>= 1, default 2).
        react_ratio: how far a worker's per-sample time must move, > 1 (default 1.5).
        history_steps: per-step points per worker the time models are fitted on (>= ``react_steps``).
        tune_workers: give no samples to workers that cost more time than they add (default True here).
        global_batch, min_local_batch, max_local_batch, window_steps, rebalance_gain, initial_batch_sizes,
        seed: as :class:`BoaStrategy` (``window_steps``: also re-plan every N steps; 0 = only on changes).
        **kwargs: :class:`HorovodStrategy`'s arguments.
    """

    strategy_name = "adaptive"

    def __init__(self, react_steps: int = A.react_steps, react_ratio: float = A.react_ratio,
                 history_steps: int = A.history_steps, global_batch: int = A.global_batch,
                 min_local_batch: int = A.min_local_batch, max_local_batch: int = A.max_local_batch,
                 window_steps: int = A.window_steps, rebalance_gain: float = A.rebalance_gain,
                 tune_workers: bool = A.tune_workers, initial_batch_sizes: Optional[Sequence[int]] = None,
                 seed: int = A.seed, **kwargs: Any) -> None:
        check_settings(react_steps, react_ratio, history_steps)
        super().__init__(global_batch=global_batch, min_local_batch=min_local_batch, max_local_batch=max_local_batch,
                         window_steps=window_steps, rebalance_gain=rebalance_gain, tune_workers=tune_workers,
                         initial_batch_sizes=initial_batch_sizes, seed=seed, **kwargs)
        self.react_steps, self.react_ratio, self.history_steps = react_steps, react_ratio, history_steps
        self.detector: Optional[SpeedChangeDetector] = None  # made at set-up (needs the world size)
        self._changed: list = []  # ranks whose speed changed at the step just taken
        self._wait_s: dict = {}  # step -> this rank's wait for the slowest rank's compute at that step

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.detector = SpeedChangeDetector(self.world_size, self.react_steps, self.react_ratio, self.history_steps)

    @override
    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        grads = self.weighted_gradients(optimizer)
        times = grads[0].new_zeros(self.world_size)
        times[self.global_rank] = self.current_step_compute_s()
        self.comm.allreduce_grouped_(grads + [times], op="sum", tag="grads")  # the times ride along: summed slots
        computed = [max(b, 1) for b in self.schedule.at(self.steps_done)]  # a left-out worker: one placeholder
        seconds = times.tolist()
        self._changed = self.detector.observe(computed, seconds)
        self._wait_s[self.steps_done] = max(seconds) - seconds[self.global_rank]
        self._wait_s.pop(self.steps_done - 4 * max(self.window_steps, self.history_steps), None)

    @override
    def _allreduce_cost_s(self) -> float:
        # The transfer alone: this rank's all-reduce time less its wait for the slowest rank's compute (known
        # here: every rank's compute time rides on the all-reduce). BOA's raw minimum counts a straggler that
        # is slow at every step as communication, and worker-set tuning then drops healthy workers to save it.
        net = [max(0.0, r.comm_s - self._wait_s.get(r.step, 0.0)) for r in self._allreduce_cost_records()]
        return min(net) if net else 0.0

    def _allreduce_cost_records(self) -> list:
        return self.recorder.records[-max(self.window_steps, self.react_steps):]

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        window_end = self.window_steps and (self.steps_done + 1) % self.window_steps == 0
        if self._changed or window_end:
            self._replan(list(self._changed))
        self._changed = []

    def _replan(self, changed: list) -> None:
        """Rank 0 decides on the points every rank holds and broadcasts (one broadcast, as BOA's plan)."""
        assert self.schedule is not None and self.sampler is not None
        decision = None
        if self.global_rank == 0:
            from_step = self.sampler.next_step  # the first step no loader has drawn (every rank in lock-step)
            decision = self.plan_from(self.detector.points(), from_step)
            if decision is not None:
                decision["changed_ranks"] = changed
        decision = self.comm.broadcast_object(decision, root=0, tag="boa_plan")
        if decision is None:
            return
        if self.sampler.next_step > decision["from_step"]:
            raise RuntimeError(f"adaptive: rank {self.global_rank} has drawn step {self.sampler.next_step - 1}'s batch, "
                               f"past the plan's first step {decision['from_step']} (ranks out of lock-step)")
        self.schedule.change(decision["from_step"], decision["batch_sizes"])
        self.record_event("rebalance", **decision)

    # --- exact resume ---------------------------------------------------------------------------
    @override
    def strategy_state(self) -> dict:
        state = super().strategy_state()
        # BOA saves its open window; adaptive never closes one (its plans come from the detector), so keep only
        # the records the all-reduce cost reads, with their waits: a checkpoint does not grow with the run and
        # the first plan after a resume nets out the wait as the straight run does.
        keep = self._allreduce_cost_records()
        state["boa"]["window"] = [r.as_row() for r in keep]
        state["adaptive"] = self.detector.to_dict() if self.detector is not None else None
        state["adaptive_wait_s"] = {int(r.step): float(self._wait_s[r.step]) for r in keep if r.step in self._wait_s}
        return state

    @override
    def load_strategy_state(self, state: dict) -> None:
        super().load_strategy_state(state)
        if state.get("adaptive") is not None and self.detector is not None:
            self.detector.restore(state["adaptive"])
        self._wait_s = {int(k): float(v) for k, v in state.get("adaptive_wait_s", {}).items()}


__all__ = ["AdaptiveStrategy"]
