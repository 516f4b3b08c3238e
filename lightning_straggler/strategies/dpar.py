"""``dpar``: Dynamic Partial All-Reduce (DPAR thesis).

Synchronous training in which workers detected as slow leave the all-reduce. Between window
boundaries the ACTIVE group all-reduces gradients every step in a Horovod process set without the
excluded workers; a SLOW worker keeps doing local steps on its own shard (so its speed is still
measured) and a STRUCK_OUT one passes over its batches without computing. The decisions
(``policies/dpar.py``: median compute per window against the group's, an explicit keep/exclude cost
model, hysteresis, ``min_active``) are taken at boundaries by every rank from the same gathered numbers.

Boundaries come after the batch at position p (batches counted from the start of fit, the same
numbering on every rank) when p + 1 is a multiple of ``window_steps``, at the last batch of an epoch,
before a validation and at the last step of training. At a boundary:
  1. if a rank is excluded, the group signals it: it posted an asynchronous broadcast right after the
     previous boundary and polls it between its local steps, so the group waits for at most about one
     of its steps (an excluded rank that reaches the boundary position itself blocks on it). The
     broadcast carries the group's position p;
  2. every rank all-gathers its window's median compute time, steps, samples and local steps;
  3. every rank runs the same policy on the same numbers and gets the same new states;
  4. if any rank is or was excluded, the old group's leader broadcasts parameters, buffers and
     optimizer state to everyone: excluded workers' local updates are discarded (DPAR's definition;
     a re-admission logs how many local steps were dropped), and validation, checkpoints and the
     model handed back are the group's model;
  5. excluded ranks pass over the batches between their position and p, so every rank is at the
     same position again and epoch ends, validation and the end of training line up.
Batches an excluded rank passes over are data the model does not see (DPAR omits a straggler's
shard); its local steps' samples are not counted in ``train_samples``. Training steps must not run
collectives of their own (``self.log(..., sync_dist=True)`` in ``training_step``): ranks are not in
step between boundaries. Validation may.
"""
from __future__ import annotations

import logging
import math
import statistics
from typing import Any, List, Optional

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_straggler.policies.dpar import ACTIVE, STRUCK_OUT, DparMemory, DparThresholds, decide
from lightning_straggler.strategies.horovod_base import HorovodStrategy

log = logging.getLogger(__name__)


class DparStrategy(HorovodStrategy):
    strategy_name = "dpar"
    uses_subgroups = True

    def __init__(self, window_steps: int = 20, slow_ratio: float = 1.5, strikeout_ratio: float = 5.0,
                 strikeout_windows: int = 3, readmit_ratio: float = 1.2, readmit_windows: int = 2,
                 min_active: int = 0, data_penalty: float = 0.5, scale_lr: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(window_steps, int) or window_steps < 1:
            raise ValueError(f"window_steps must be an integer >= 1 (got {window_steps!r})")
        self.window_steps, self.scale_lr = window_steps, scale_lr
        self.thresholds = DparThresholds(slow_ratio=slow_ratio, strikeout_ratio=strikeout_ratio,
                                         strikeout_windows=strikeout_windows, readmit_ratio=readmit_ratio,
                                         readmit_windows=readmit_windows, min_active=min_active,
                                         data_penalty=data_penalty)
        self.memory: Optional[DparMemory] = None
        self.position = 0  # batches started since fit began; the current batch is position - 1
        self.discarded_samples = 0  # this rank's samples whose updates were thrown away
        self._synced_through = -1  # boundaries up to this position are done; batches up to it are skipped
        self._signal: Optional[Any] = None  # an excluded rank's pending boundary signal
        self._window_start = 0  # first recorder record of the current window
        self._window_local_steps = 0  # local steps while excluded, since the last re-admission
        self._just_synced = False

    # --- state ----------------------------------------------------------------------------------
    @property
    def states(self) -> List[str]:
        return list(self.memory.states) if self.memory else [ACTIVE] * self.world_size

    @property
    def active(self) -> tuple:
        return tuple(r for r, s in enumerate(self.states) if s == ACTIVE)

    @property
    def is_active(self) -> bool:
        return self.states[self.global_rank] == ACTIVE

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.thresholds.validate(self.world_size)
        self.memory = DparMemory.initial(self.world_size)

    @override
    def current_group_leader(self) -> int:
        return self.active[0] if self.is_active else self.global_rank

    @override
    def profile_clock(self) -> int:
        return self._synced_through + 1  # the group position of the last boundary: equal on every rank

    @override
    def profile_gather_due(self, last_gather_step: int, every: int) -> bool:
        return self._just_synced and self.profile_clock() - last_gather_step >= every

    # --- per batch ------------------------------------------------------------------------------
    @override
    def skip_this_batch(self) -> bool:
        return self.position - 1 <= self._synced_through or self.states[self.global_rank] == STRUCK_OUT

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.position += 1
        self._just_synced = False
        if self._signal is not None and self.comm.poll(self._signal):
            self._boundary()  # the group has reached a boundary: join it now, then catch up
        super().on_train_batch_start(batch, batch_idx)

    @override
    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        if self.is_active:
            self.comm.allreduce_grouped_(self.gradients_of(optimizer), op="mean", group=self.active, tag="grads")
        else:
            self._window_local_steps += 1

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        here = self.position - 1
        if here > self._synced_through and self._is_boundary(here):
            self._boundary()

    def _is_boundary(self, position: int) -> bool:
        """The same answer on every rank for the same position."""
        trainer = self.lightning_module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        if (position + 1) % self.window_steps == 0 or epoch_loop.batch_progress.is_last_batch:
            return True
        if trainer.max_steps > 0 and position + 1 >= trainer.max_steps:
            return True
        every = trainer.val_check_batch  # validation runs after batches where (batch_idx + 1) % every == 0
        return bool(trainer.enable_validation and isinstance(every, int) and every > 0
                    and (epoch_loop.batch_idx + 1) % every == 0)

    # --- the boundary ---------------------------------------------------------------------------
    def _boundary(self) -> None:
        states_before = self.states
        old_active = self.active
        leader = old_active[0]
        group_position = self.position - 1
        if len(old_active) < self.world_size:
            if self._signal is not None:  # excluded: the group's position comes with the signal
                group_position = int(self.comm.wait(self._signal)[0].item())
                self._signal = None
            else:  # group member: post the broadcast the excluded ranks are waiting on
                handle = self.comm.broadcast_async(torch.tensor([group_position], dtype=torch.int64), root=leader,
                                                   tag="dpar_signal")
                group_position = int(self.comm.wait(handle)[0].item())

        window = self.recorder.records[self._window_start:]
        median = statistics.median([r.compute_s for r in window]) if window else math.nan
        mine = [float(self.global_rank), median, float(sum(r.samples for r in window)), float(self._window_local_steps)]
        rows = self.comm.allgather(torch.tensor([mine], dtype=torch.float64), tag="dpar_stats").tolist()
        rows.sort(key=lambda r: r[0])
        times = [None if math.isnan(r[1]) else r[1] for r in rows]
        decision = decide(times, self.memory, self.thresholds)
        self.memory = decision.memory

        if states_before[self.global_rank] != ACTIVE:
            self.discarded_samples += int(mine[2])  # local updates are about to be overwritten
        for t in decision.transitions:
            details = {k: getattr(t, k) for k in ("rank", "from_state", "to_state", "ratio", "keep_cost",
                                                  "exclude_cost", "reason")}
            if t.from_state != ACTIVE and t.to_state == ACTIVE:
                details["discarded_local_steps"] = int(rows[t.rank][3])
                details["note"] = "re-admitted with the group's parameters and optimizer state; local updates discarded"
            self.record_event("transition", step=group_position, group_time=decision.group_time, **details)
            if t.rank == self.global_rank and t.to_state == ACTIVE:
                self._window_local_steps = 0
        if len(old_active) < self.world_size or len(decision.active) < self.world_size:
            self.broadcast_training_state(root=leader)  # everyone continues from the group's model
        if self.scale_lr and len(decision.active) != len(old_active):
            for optimizer in self.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= len(decision.active) / len(old_active)
        if len(decision.active) < self.world_size:
            self.comm.ensure_groups([decision.active])
            if not self.is_active:
                self._signal = self.comm.broadcast_async(torch.tensor([-1], dtype=torch.int64),
                                                         root=decision.active[0], tag="dpar_signal")
        self._synced_through = group_position
        log.debug("rank %d: boundary at %d (own position %d), states %s", self.global_rank, group_position,
                  self.position - 1, self.states)
        self._window_start = len(self.recorder.records)
        self._just_synced = True

    @override
    def on_train_end(self) -> None:
        # Excluded ranks always have a signal posted for the next boundary; training ended without
        # one (last step, early stop), so the group completes it here: no operation stays pending.
        if len(self.active) < self.world_size:
            if self._signal is None:
                self._signal = self.comm.broadcast_async(torch.tensor([-1], dtype=torch.int64), root=self.active[0],
                                                         tag="dpar_signal")
            self.comm.wait(self._signal)
            self._signal = None
        mine = torch.tensor([float(self.discarded_samples)], dtype=torch.float64)
        total = int(self.comm.allreduce(mine, op="sum", tag="dpar_discarded").item())
        if self.global_rank == 0:
            self.run_report["discarded_samples"] = total
        super().on_train_end()
