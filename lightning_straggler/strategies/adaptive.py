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
loader draws batch by batch; later when DataLoader workers prefetch). Every ``window_steps`` it
re-plans as BOA does, on the same per-step points, without a collective of its own: that plan rides on
the next step's all-reduce like the times and takes effect at the first step no rank's loader has drawn
when it arrives (every rank's count of drawn steps rides along too), one step later than a broadcast
plan. (A broadcast every window cost about 1.3% of an 8-worker run on this project's 2-core machine;
a change is rare and worth the step it saves.) A
collapsed worker gets few samples or, with ``tune_workers`` (on by default here), none: it steps on a
one-sample placeholder with weight 0 until its measured speed recovers, when the next re-plan gives it
samples again.

Within a step (``deadline_factor``, off by default, ``policies/deadline.py``): a rank that has not handed its gradients
in ``deadline_factor`` x the step period after the group's last collective is cut from the step: a helper
thread hands in zeros for it (``comm/deadline.py``), the others' gradients are weighted by their samples
over the samples that arrived, and the late rank drops its own gradient of that step and takes the
group's update like everyone else. A rank already too late when it starts a step skips its compute. The
per-step times of a cut rank carry the time it had been given, so the detector sees it slow and the
re-plan follows. Exact (as ``boa``) whenever every rank makes the deadline. The group still waits for a
late rank at the other collectives (a change's re-plan broadcast, a validation); a frozen worker is the
watchdog's (it is named and the job restarts without it).
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_straggler.comm.deadline import DeadlineExchange
from lightning_straggler.config import AdaptiveConfig as A
from lightning_straggler.policies import deadline as deadline_policy
from lightning_straggler.policies.adaptive import SpeedChangeDetector, check_settings
from lightning_straggler.strategies.boa import BoaStrategy

# What rides on each step's gradient all-reduce, one more tensor after the gradients, summed over ranks:
# four rows of one entry per rank (each rank writes its own) and a window's plan (rank 0 writes it).
# One tensor, not five: Horovod negotiates every tensor of a grouped all-reduce on its own.
TIMES, AMENDED, ARRIVED, DRAWN = range(4)


def slot_views(slots: torch.Tensor, n: int) -> tuple:
    """(rows[TIMES..DRAWN], plan) as views of the slot tensor of ``6 n + 1`` entries."""
    rows = [slots[k * n:(k + 1) * n] for k in range(4)]
    return rows, slots[4 * n:]


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
        deadline_factor: a step closes without a rank that has not handed its gradients in this many step
            periods after the group's last collective (0 = no deadline, the default; else in (1, 1000], e.g. 3).
        deadline_history_steps: steps the step period's median is taken over (>= 5, default 20).
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
                 seed: int = A.seed, deadline_factor: float = A.deadline_factor,
                 deadline_history_steps: int = A.deadline_history_steps, **kwargs: Any) -> None:
        check_settings(react_steps, react_ratio, history_steps)
        deadline_policy.check_settings(deadline_factor, deadline_history_steps)
        super().__init__(global_batch=global_batch, min_local_batch=min_local_batch, max_local_batch=max_local_batch,
                         window_steps=window_steps, rebalance_gain=rebalance_gain, tune_workers=tune_workers,
                         initial_batch_sizes=initial_batch_sizes, seed=seed, **kwargs)
        self.react_steps, self.react_ratio, self.history_steps = react_steps, react_ratio, history_steps
        self.detector: Optional[SpeedChangeDetector] = None  # made at set-up (needs the world size)
        self._changed: list = []  # ranks whose speed changed at the step just taken
        self._wait_s: dict = {}  # step -> this rank's wait for the slowest rank's compute at that step
        self._pending_plan: Optional[dict] = None  # rank 0: a plan decided, sent with the next step's all-reduce
        self.deadline = deadline_policy.StepDeadline(deadline_factor, deadline_history_steps)
        self.exchange: Optional[DeadlineExchange] = None  # started at the first step of a fit (deadline on)
        self._shapes: list = []  # the exchanged tensors' (shape, dtype, device): what a cut rank hands in zeros of
        self._skipping = False  # this step was cut before this rank started it: no compute
        self._last_close: Optional[float] = None  # when the previous step's all-reduce ended here
        self._validated_at = 0.0  # when a validation between two steps ended here (0: none)
        self.cut_steps, self.cut_samples = 0, 0  # this rank's steps cut by the deadline and their samples
        self.deadline_steps = 0  # steps this rank started with a deadline set
        # a step this rank was cut from while computing: its real compute seconds, sent with the next step
        # (the cut step's slot held a lower bound), and its per-sample time (this rank's speed now)
        self._true_s_pending = 0.0
        self._late_per_sample: Optional[float] = None

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.detector = SpeedChangeDetector(self.world_size, self.react_steps, self.react_ratio, self.history_steps)

    # --- the step deadline ------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._skipping = False
        if self.exchange is None and self.deadline.enabled and self._shapes:
            self.exchange = DeadlineExchange(self.comm, self._zeros_for, tag="grads")
        if self.exchange is not None:
            seconds = self.deadline.seconds()
            self.deadline_steps += seconds is not None
            self._skipping = self.exchange.arm(self.steps_done, seconds, not_before=self._validated_at)
            self._validated_at = 0.0

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        # a validation need not end with a collective: the next step's deadline counts from its end here
        self._validated_at = time.monotonic()

    @override
    def skip_this_batch(self) -> bool:
        return self._skipping  # decided once at the batch's start

    @override
    def synchronizes_skipped_batch(self) -> bool:
        return True  # a cut rank takes the group's update of the step it skipped

    def _zeros_for(self, step: int, waited_s: float) -> list:
        """What a cut rank hands in: zero gradients; its time slot = how long it had been given (a lower
        bound on its compute), or its speed on its last late step if that says more; the real time of
        its previous step if that was cut too (amend slot); its arrival slot 0."""
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in self._shapes]
        rows, _ = slot_views(zeros[-1], self.world_size)
        rows[TIMES][self.global_rank] = max(waited_s, self._estimate_s(step))
        rows[AMENDED][self.global_rank] = self._true_s_pending
        self._fill_plan_slots(zeros[-1], step)  # a plan must not wait for its sender's compute
        return zeros

    def _fill_plan_slots(self, slots: torch.Tensor, step: int) -> None:
        """This rank's count of steps its loader has drawn beyond ``step``; on rank 0 the pending plan:
        batch sizes, a 1 per changed rank, and how many steps ago it was decided, + 1 (> 0: a plan)."""
        n = self.world_size
        rows, plan_slots = slot_views(slots, n)
        rows[DRAWN][self.global_rank] = float(self.sampler.next_step - step)
        plan = self._pending_plan
        if self.global_rank == 0 and plan is not None:
            plan_slots[:n] = torch.tensor(plan["batch_sizes"], dtype=slots.dtype)
            for rank in plan["changed_ranks"]:
                plan_slots[n + rank] = 1.0
            plan_slots[2 * n] = float(step - plan["step"] + 1)

    def _estimate_s(self, step: int) -> float:
        if self._late_per_sample is None:
            return 0.0
        return self._late_per_sample * max(self.schedule.at(step)[self.global_rank], 1)

    def _exchange(self, grads: list) -> tuple:
        """The step's all-reduce: (summed gradients + the slot tensor, whether this rank was cut)."""
        slots = grads[0].new_zeros(6 * self.world_size + 1)
        rows, _ = slot_views(slots, self.world_size)
        rows[TIMES][self.global_rank] = self.current_step_compute_s()
        rows[AMENDED][self.global_rank] = self._true_s_pending
        rows[ARRIVED][self.global_rank] = 1.0
        self._fill_plan_slots(slots, self.steps_done)
        tensors = grads + [slots]
        if not self._shapes:
            self._shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        if self.exchange is None:
            self.comm.allreduce_grouped_(tensors, op="sum", tag="grads")  # the slots ride along: summed
            return tensors, False
        result, cut = self.exchange.exchange(self.steps_done, tensors)
        self._true_s_pending = 0.0  # sent, by whichever thread handed the step in
        if cut:
            for mine, group in zip(grads, result):
                mine.copy_(group)  # this rank's own gradient of the step is dropped
            if not self._skipping:  # it computed, too late: its real time goes with the next step
                self._true_s_pending = self.current_step_compute_s()
                self._late_per_sample = self._true_s_pending / max(self.schedule.at(self.steps_done)[self.global_rank], 1)
        else:
            self._late_per_sample = None
        return grads + [result[-1]], cut

    @override
    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        grads = self.weighted_gradients(optimizer)
        result, cut = self._exchange(grads)
        rows, plan = slot_views(result[-1], self.world_size)
        times, amended = rows[TIMES], rows[AMENDED].tolist()
        arrived = [bool(a > 0.5) for a in rows[ARRIVED].tolist()]
        self._apply_plan(rows[DRAWN].tolist(), plan.tolist())
        for rank, seconds in enumerate(amended):
            if seconds > 0:  # a rank cut from the previous step while computing: its real time
                self.detector.amend_last(rank, seconds)
        sizes = list(self.schedule.at(self.steps_done))
        scale = deadline_policy.arrived_scale(sizes, arrived)
        if scale is None:  # no rank made the step: no update at all
            self.drop_gradients(optimizer)
        elif scale != 1.0:
            for g in grads:
                g.mul_(scale)
        if not all(arrived):
            self._note_cut(sizes, arrived, cut)
        close = self.comm.last_collective_end
        if self._last_close is not None and self.exchange is not None:
            self.deadline.observe(close - self._last_close)
        self._last_close = close
        computed = [max(b, 1) for b in sizes]  # a left-out worker: one placeholder
        seconds = times.tolist()
        self._changed = self.detector.observe(computed, seconds)
        self._wait_s[self.steps_done] = max(seconds) - seconds[self.global_rank]
        self._wait_s.pop(self.steps_done - 4 * max(self.window_steps, self.history_steps), None)

    def _note_cut(self, sizes: list, arrived: list, cut: bool) -> None:
        missing = [r for r, a in enumerate(arrived) if not a]
        if cut:
            self.cut_steps += 1
            self.cut_samples += sizes[self.global_rank]
        self.record_event("deadline_cut", ranks=missing, dropped_samples=sum(sizes[r] for r in missing),
                          arrived_samples=sum(b for b, a in zip(sizes, arrived) if a))

    @override
    def on_train_end(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None
        mine = torch.tensor([float(self.cut_steps), float(self.cut_samples)], dtype=torch.float64)
        total = self.comm.allreduce(mine, op="sum", tag="deadline_cuts").tolist()
        super().on_train_end()
        if self.global_rank == 0:
            # the cut ranks' samples of those steps were not trained on: not counted as trained
            self.run_report["discarded_samples"] = self.run_report.get("discarded_samples", 0) + int(total[1])
            self.run_report["deadline"] = {"factor": self.deadline.factor, "steps_with_deadline": self.deadline_steps,
                                           "cut_rank_steps": int(total[0]), "dropped_samples": int(total[1])}

    @override
    def teardown(self) -> None:
        if self.exchange is not None:  # a fit that ended by an exception
            self.exchange.close()
            self.exchange = None
        super().teardown()

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
        if self._changed:  # every rank saw the same change (same numbers): all take part in the broadcast
            self._replan_now(list(self._changed))
        elif window_end:
            self._replan_with_next_step()
        self._changed = []

    def _replan_now(self, changed: list) -> None:
        """A worker's speed changed: rank 0 decides on the points every rank holds and broadcasts the plan,
        in force from the next step (the first no loader has drawn)."""
        assert self.schedule is not None and self.sampler is not None
        decision = None
        if self.global_rank == 0:
            from_step = self.sampler.next_step  # every rank in lock-step
            decision = self.plan_from(self.detector.points(), from_step)
            if decision is not None:
                decision = {"step": self.steps_done, **decision, "changed_ranks": changed}
        decision = self.comm.broadcast_object(decision, root=0, tag="boa_plan")
        if decision is None:
            return
        if self.sampler.next_step > decision["from_step"]:
            raise RuntimeError(f"adaptive: rank {self.global_rank} has drawn step {self.sampler.next_step - 1}'s batch, "
                               f"past the plan's first step {decision['from_step']} (ranks out of lock-step)")
        self.schedule.change(decision["from_step"], decision["batch_sizes"])
        self.record_event("rebalance", **decision)

    def _replan_with_next_step(self) -> None:
        """A window's routine re-plan: rank 0 decides; the plan goes out with the next step's all-reduce
        (``_fill_plan_slots``), no collective of its own. The other ranks have nothing to do here."""
        assert self.schedule is not None and self.sampler is not None
        if self.global_rank != 0:
            return
        # the allocation in force where the plan can start at the earliest (nothing else is pending: the
        # previous plan arrived with this step's all-reduce)
        decision = self.plan_from(self.detector.points(), self.sampler.next_step)
        if decision is not None:
            self._pending_plan = {"step": self.steps_done, **decision, "changed_ranks": []}

    def _apply_plan(self, drawn: list, plan: list) -> None:
        """Every rank, on the step's all-reduce result: a plan in it starts at the first step no rank's
        loader has drawn (the same step everywhere: from the same numbers)."""
        n = self.world_size
        if plan[2 * n] < 0.5:
            return
        from_step = self.steps_done + int(round(max(drawn)))
        if self.sampler.next_step > from_step:  # cannot happen: this rank's own count is in ``drawn``
            raise RuntimeError(f"adaptive: rank {self.global_rank} has drawn step {self.sampler.next_step - 1}'s batch, "
                               f"past the plan's first step {from_step}")
        sizes = [int(round(b)) for b in plan[:n]]
        decided = self.steps_done + 1 - int(round(plan[2 * n]))
        changed = [r for r in range(n) if plan[n + r] > 0.5]
        self.schedule.change(from_step, sizes)
        # every rank logs the same plan; rank 0 adds what only it computed (time models, predicted times)
        details = dict(self._pending_plan) if self.global_rank == 0 and self._pending_plan is not None else {}
        details.update(step=decided, from_step=from_step, batch_sizes=sizes, changed_ranks=changed)
        self._pending_plan = None
        self.record_event("rebalance", **details)

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
        state["adaptive_deadline"] = self.deadline.to_dict()
        state["adaptive_pending_plan"] = self._pending_plan  # rank 0: decided, not yet sent
        return state

    @override
    def load_strategy_state(self, state: dict) -> None:
        super().load_strategy_state(state)
        if state.get("adaptive") is not None and self.detector is not None:
            self.detector.restore(state["adaptive"])
        self._wait_s = {int(k): float(v) for k, v in state.get("adaptive_wait_s", {}).items()}
        if "adaptive_deadline" in state:
            self.deadline.restore(state["adaptive_deadline"])
        plan = state.get("adaptive_pending_plan")
        if self.global_rank == 0 and plan is not None and len(plan["batch_sizes"]) == self.world_size:
            self._pending_plan = plan


__all__ = ["AdaptiveStrategy"]
