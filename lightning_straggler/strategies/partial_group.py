"""The boundary protocol shared by ``dpar`` and ``awar``: a synchronous group that leaves some ranks out.

Between boundaries the ranks in ``group()`` all-reduce gradients every step in a Horovod process set of
their own; the others work alone (local steps) or pass over their batches. Boundaries come after the
batch at position p (batches counted from the start of fit, the same numbering on every rank) when
p + 1 is a multiple of ``window_steps``, at the last batch of an epoch, before a validation and at the
last step of training. At a boundary every rank:
  1. (if a rank is outside the group) meets the group's signal: each outside rank posted an
     asynchronous broadcast right after the previous boundary and polls it between its own steps, so
     the group waits for at most about one of its steps (an outside rank that reaches the boundary
     position itself blocks on it). The broadcast carries the group's position p;
  2. all-gathers its numbers for the window: median compute time per step (before any collective),
     samples and steps computed, local steps since it left the group;
  3. runs the algorithm's ``on_boundary`` (the same decision on every rank from the same numbers, and
     the model merge: DPAR broadcasts the group's model, AWAR takes a weighted average);
  4. outside ranks pass over the batches between their position and p, so every rank is at the same
     position again: epoch ends, validation and the end of training line up on every rank.
Training steps must not run collectives of their own (``self.log(..., sync_dist=True)`` in
``training_step``): ranks are not in step between boundaries. Validation may.
"""
from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from abc import abstractmethod
from typing import Any, List, Optional, Tuple

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_straggler.profiling import StepRecord
from lightning_straggler.strategies.horovod_base import HorovodStrategy, batch_size_of

log = logging.getLogger(__name__)

# Up to this many possible groups are registered as static Horovod process sets at start-up.
MAX_STATIC_GROUPS = 16
# Columns of the per-rank numbers gathered at a boundary.
RANK, MEDIAN_COMPUTE, SAMPLES, STEPS, LOCAL_STEPS = range(5)


class PartialGroupStrategy(HorovodStrategy):
    uses_subgroups = True

    def __init__(self, window_steps: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(window_steps, int) or window_steps < 1:
            raise ValueError(f"window_steps must be an integer >= 1 (got {window_steps!r})")
        self.window_steps = window_steps
        self.position = 0  # batches started since fit began; the current batch is position - 1
        # (seconds this rank spent in each boundary's signal + exchange, whether a rank was outside)
        self.boundary_waits: List[Tuple[float, bool]] = []
        self._synced_through = -1  # boundaries up to this position are done; batches up to it are skipped
        self._signal: Optional[Any] = None  # an outside rank's pending boundary signal
        self._window_start = 0  # first recorder record of the current window
        self._steps = 0  # steps computed since the last boundary
        self._samples = 0  # samples computed since the last boundary
        self._batch_samples = 0
        self._local_steps = 0  # steps computed outside the group since this rank last (re)joined it
        self._just_synced = False

    # --- what the algorithm decides ------------------------------------------------------------
    @abstractmethod
    def group(self) -> Tuple[int, ...]:
        """Ranks that synchronise every step (sorted)."""

    @abstractmethod
    def min_group_size(self, world_size: int) -> int:
        """The algorithm's floor on the group's size (DPAR's ``min_active``, AWAR's ``min_group``)."""

    @override
    def static_groups(self, world_size: int) -> Optional[List[Tuple[int, ...]]]:
        # every group of at least the floor's size, if there are few: 10 at 4 ranks, 162 at 8 (too many)
        sizes = range(max(1, self.min_group_size(world_size)), world_size)
        if sum(math.comb(world_size, k) for k in sizes) > MAX_STATIC_GROUPS:
            return None
        return [g for k in sizes for g in itertools.combinations(range(world_size), k)]

    def computes_outside_group(self, rank: int) -> bool:
        """Whether a rank outside the group still computes (DPAR's struck-out ranks do not)."""
        return True

    @abstractmethod
    def on_boundary(self, rows: List[List[float]], old_group: Tuple[int, ...], position: int) -> None:
        """Decide and merge. ``rows[r]`` holds rank r's numbers (columns RANK .. LOCAL_STEPS)."""

    # --- helpers --------------------------------------------------------------------------------
    @property
    def in_group(self) -> bool:
        return self.global_rank in self.group()

    @override
    def current_group_leader(self) -> int:
        return self.group()[0] if self.in_group else self.global_rank

    @override
    def profile_clock(self) -> int:
        return self._synced_through + 1  # the group's position at the last boundary: equal on every rank

    @override
    def profile_gather_due(self, last_gather_step: int, every: int) -> bool:
        return self._just_synced and self.profile_clock() - last_gather_step >= every

    @override
    def skip_this_batch(self) -> bool:
        return self.position - 1 <= self._synced_through or not (
            self.in_group or self.computes_outside_group(self.global_rank))

    # --- per batch ------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.position += 1
        self._just_synced = False
        if self._signal is not None and self.comm.poll(self._signal):
            self._boundary()  # the group has reached a boundary: join it now, then catch up
        self._batch_samples = batch_size_of(batch)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        if self.in_group:
            self.comm.allreduce_grouped_(self.gradients_of(optimizer), op="mean", group=self.group(), tag="grads")
        else:
            self._local_steps += 1

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if not self.skip_this_batch():
            self._steps += 1
            self._samples += self._batch_samples
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
        started = time.perf_counter()
        old_group = self.group()
        position = self.position - 1
        if len(old_group) < self.world_size:
            if self._signal is not None:  # outside: the group's position comes with the signal
                position = int(self.comm.wait(self._signal)[0].item())
                self._signal = None
            else:  # group member: post the broadcast the outside ranks are waiting on
                handle = self.comm.broadcast_async(torch.tensor([position], dtype=torch.int64), root=old_group[0],
                                                   tag="group_signal")
                position = int(self.comm.wait(handle)[0].item())

        window = self.recorder.records[self._window_start:]
        median = statistics.median([r.compute_s for r in window]) if window else math.nan
        mine = [float(self.global_rank), median, float(self._samples), float(self._steps), float(self._local_steps)]
        rows = sorted(self.comm.allgather(torch.tensor([mine], dtype=torch.float64), tag="boundary_stats").tolist())
        self.boundary_waits.append((time.perf_counter() - started, len(old_group) < self.world_size))

        self.on_boundary(rows, old_group, position)

        new_group = self.group()
        if self.in_group and self.global_rank not in old_group:
            self._local_steps = 0
        if len(new_group) < self.world_size:
            self.comm.ensure_groups([new_group])  # a collective over all ranks, the same list on each
            if not self.in_group:
                self._signal = self.comm.broadcast_async(torch.tensor([-1], dtype=torch.int64), root=new_group[0],
                                                         tag="group_signal")
        log.debug("rank %d: boundary at %d (own position %d), group %s", self.global_rank, position,
                  self.position - 1, new_group)
        self._synced_through = position
        self._window_start = len(self.recorder.records)
        self._steps = self._samples = 0
        self._just_synced = True

    @override
    def on_train_end(self) -> None:
        # Outside ranks always have a signal posted for the next boundary; training ended without
        # one (last step, early stop), so the group completes it here: no operation stays pending.
        group = self.group()
        if len(group) < self.world_size:
            if self._signal is None:
                self._signal = self.comm.broadcast_async(torch.tensor([-1], dtype=torch.int64), root=group[0],
                                                         tag="group_signal")
            self.comm.wait(self._signal)
            self._signal = None
        super().on_train_end()

    # --- non-finite check and exact resume (HorovodStrategy hooks) -----------------------------------
    @override
    def gradient_sync_group(self) -> Optional[Tuple[int, ...]]:
        # group members averaged their gradients; ranks outside it took a local step on their own
        return self.group() if self.in_group else None

    @override
    def strategy_state(self) -> dict:
        state = super().strategy_state()
        state["partial_group"] = {
            "position": self.position, "synced_through": self._synced_through, "steps": self._steps,
            "samples": self._samples, "local_steps": self._local_steps,
            "window": [r.as_row() for r in self.recorder.records[self._window_start:]],  # the open window
        }
        return state

    @override
    def load_strategy_state(self, state: dict) -> None:
        super().load_strategy_state(state)
        saved = state["partial_group"]
        self.position, self._synced_through = int(saved["position"]), int(saved["synced_through"])
        self._steps, self._samples, self._local_steps = int(saved["steps"]), int(saved["samples"]), int(saved["local_steps"])
        self.recorder.records = [StepRecord.from_row(r) for r in saved["window"]]
        self.recorder.take_unsent()  # measured before the checkpoint: the profiler does not report them again
        self._window_start = 0

    @override
    def on_train_start(self) -> None:
        resuming = self._resumed_state() is not None
        super().on_train_start()  # restores the state (the subclass's membership included)
        if resuming:
            self._resume_signal()

    def _resume_signal(self) -> None:
        """Ranks outside the restored group post the boundary signal again (the interrupted run's was
        completed at its end), as ``_boundary`` does."""
        group = self.group()
        if len(group) < self.world_size:
            self.comm.ensure_groups([group])  # a collective over all ranks, the same list on each
            if not self.in_group:
                self._signal = self.comm.broadcast_async(torch.tensor([-1], dtype=torch.int64), root=group[0],
                                                         tag="group_signal")
