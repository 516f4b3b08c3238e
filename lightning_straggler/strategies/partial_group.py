"""The boundary protocol shared by ``dpar`` and ``awar``: a synchronous group that leaves some ranks out.

The group needs no process set. A rank outside the group starts Horovod's ``join()`` without waiting
(``comm.join_async``: polled between its steps) and goes on with local steps; a joined rank adds zeros to every all-reduce
the others run, so the group's members sum their gradients over the world's ring and divide by their
count. The group's own ``join()`` at the next boundary releases everyone: it is also the boundary
signal. So a membership change costs nothing but the boundary exchange, a group step costs what a
``ring`` step costs (the same one all-reduce, over the same ring), and with nobody outside a step is
exactly a ``ring`` step.

Boundaries come after the batch at position p (batches counted from the start of fit, the same
numbering on every rank) when p + 1 is a multiple of ``window_steps``, at the last batch of an
epoch, before a validation, where a ``ModelCheckpoint(every_n_train_steps=n)`` saves, and at the last
step of training. At a boundary every rank:
  1. (if a rank is outside the group) meets the others in ``join()``: group members join when they
     reach p; an outside rank's pending join then completes, and the rank notices it before its
     next local step (so the group waits for at most about one of its steps); an outside rank that
     reaches position p itself waits for it. An outside rank does not start a local step predicted to
     end after the group reaches the boundary (it waits in ``join()`` instead, so the group does not wait
     for it): ``policies/boundary.outside_rank_holds``, from the group's step period at the last boundary
     and where the next boundary lies; it always computes one local step per window (its speed is measured);
  2. shares its numbers for the window: its position, median compute time per step (before any
     collective), samples and steps computed, local steps since it left the group, median step period.
     With everyone in the group they ride on the last step's gradient all-reduce (one row per rank, like
     the early boundary's compute times: no collective of their own); else (someone outside, or an early
     boundary, which nobody can foresee before the step's all-reduce) in an all-gather;
  3. runs the algorithm's ``on_boundary`` (the same decision on every rank from the same numbers, and
     the model merge: DPAR broadcasts the group's model, AWAR takes a weighted average);
  4. outside ranks pass over the batches between their position and p, so every rank is at the same
     position again: epoch ends, validation, checkpoints and the end of training line up on every
     rank. Only then does a rank still outside join again (at its first batch after p): from there
     to the next boundary it runs no collective of its own.
While nobody is outside the group a boundary can also come early (``react_steps`` > 0,
``policies/boundary.EarlyBoundary``): every rank adds its compute time of the step to the step's
gradient all-reduce (one slot per rank, no extra collective), so every rank sees every rank's time
after each step and holds a boundary when one rank has been ``slow_ratio`` x the median for
``react_steps`` steps in a row. There every rank reports its median over those steps, and the
algorithm decides as at any boundary: a new straggler costs the group a few steps, not a window.
Lightning's collectives called between boundaries (``self.log(..., sync_dist=True)``, ``reduce``,
``all_gather`` in ``training_step``) reduce over the group on its members and stay local on the
ranks outside it; at boundaries (validation, epoch ends) they are over every rank.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from abc import abstractmethod
from typing import Any, List, Optional, Tuple

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_straggler.policies.boundary import (DEFAULT_REACT_STEPS, EarlyBoundary, boundary_eta, is_boundary,
                                                   model_read_after, next_boundary, outside_rank_holds)
from lightning_straggler.policies.group_floor import max_outside
from lightning_straggler.profiling import StepRecord
from lightning_straggler.profiling import batch_size_of
from lightning_straggler.strategies.horovod_base import HorovodStrategy, _op_name

log = logging.getLogger(__name__)

# Columns of the per-rank numbers gathered at a boundary.
RANK, POSITION, MEDIAN_COMPUTE, SAMPLES, STEPS, LOCAL_STEPS, STEP_PERIOD, MODEL_READ = range(8)
COLUMNS = 8
_WHOLE_NUMBERS = (RANK, POSITION, SAMPLES, STEPS, LOCAL_STEPS, MODEL_READ)  # exact again after the all-reduce's mean
# Carried on the gradient all-reduce, the numbers take the gradients' dtype: one more dtype in Horovod's grouped
# all-reduce is a second operation (float64 rows beside float32 gradients cost about 9 ms per boundary at 8
# ranks on 2 cores: benchmarks/carried_dtype_cost.py). In float32 a whole number x rides as two pieces below
# 2^21 (x = high * 2^20 + low): the mean's roundings (two on the CPU; three on the GPU, which rounds 1 / N to
# float32) leave each piece within 3 * piece * 2^-24 < 0.5 of itself, so rounding restores x exactly for |x| < 2^41.
_PIECE = 2 ** 20
CARRIED_COLUMNS = COLUMNS + len(_WHOLE_NUMBERS)  # the columns, whole ones holding their low piece, then the high pieces
_REDUCE = {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin, "product": torch.prod}


def carried_row(numbers: List[float]) -> List[float]:
    """One rank's boundary numbers (columns RANK .. MODEL_READ) as its slot of the step's all-reduce: whole
    numbers split into a low and a high piece (:data:`CARRIED_COLUMNS`), the others as they are."""
    row = list(numbers)
    high = []
    for column in _WHOLE_NUMBERS:
        whole = int(round(row[column]))
        row[column] = float(whole % _PIECE)
        high.append(float(whole // _PIECE))
    return row + high


def carried_slots(numbers: List[float], rank: int, world_size: int, like: Tensor) -> Tensor:
    """This rank's contribution to the slot tensor a step's mean all-reduce carries: zeros but for its own row
    (:func:`carried_row`, times ``world_size``: the mean divides). In ``like``'s dtype and device (a second dtype
    would be a second operation); half precision could not hold the numbers, so those models carry float32."""
    dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
    slots = like.new_zeros((world_size, CARRIED_COLUMNS), dtype=dtype)
    slots[rank] = torch.tensor(carried_row(numbers), dtype=dtype) * world_size
    return slots


def rows_from_carried(carried: List[List[float]]) -> List[List[float]]:
    """Every rank's boundary numbers back from the all-reduced slots (:func:`carried_row`'s inverse, exact for
    whole numbers below 2^41 in magnitude after a float32 mean)."""
    rows = []
    for slot in carried:
        row = list(slot[:COLUMNS])
        for high, column in zip(slot[COLUMNS:], _WHOLE_NUMBERS):
            row[column] = float(round(high) * _PIECE + round(row[column]))
        rows.append(row)
    return rows


class PartialGroupStrategy(HorovodStrategy):
    # the group is the world with the outside ranks joined: no process sets at all
    uses_subgroups = False
    # ranks are not in step between boundaries: metrics computed while training stay local
    lockstep_training = False

    def __init__(self, window_steps: int = 20, react_steps: int = DEFAULT_REACT_STEPS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(window_steps, int) or window_steps < 1:
            raise ValueError(f"window_steps must be an integer >= 1 (got {window_steps!r})")
        if not isinstance(react_steps, int) or isinstance(react_steps, bool) or react_steps < 0:
            raise ValueError(f"react_steps must be an integer >= 0 (0 = decide only at window ends) (got {react_steps!r})")
        self.window_steps, self.react_steps = window_steps, react_steps
        self.early: Optional[EarlyBoundary] = None  # made at set-up (needs the world size)
        self._early_due = False  # the last step's times call for a boundary now
        self.position = 0  # batches started since fit began; the current batch is position - 1
        # (seconds this rank spent in each boundary's join + exchange, whether a rank was outside)
        self.boundary_waits: List[Tuple[float, bool]] = []
        self._synced_through = -1  # boundaries up to this position are done; batches up to it are skipped
        self._join: Optional[Any] = None  # an outside rank's pending join (the next boundary's signal)
        self._window_start = 0  # first recorder record of the current window
        self._steps = 0  # steps computed since the last boundary
        self._samples = 0  # samples computed since the last boundary
        self._batch_samples = 0
        self._local_steps = 0  # steps computed outside the group since this rank last (re)joined it
        self._just_synced = False
        # every rank's boundary numbers, carried by this step's gradient all-reduce (see synchronize_gradients)
        self._carried_rows: Optional[List[List[float]]] = None
        # an outside rank's prediction of the next boundary: when the group could start its window (this rank
        # joined again, caught up; monotonic) and the group's median step period at the last boundary (None
        # until a boundary has measured the group)
        self._window_opened_s = 0.0
        self._group_step_s: Optional[float] = None
        self.boundary_holds = 0  # local steps this rank did not start, to meet a boundary without being waited for
        # boundaries this rank led (old group's first rank) while a rank was outside: count, seconds, longest
        self._led_waits = [0, 0.0, 0.0]

    # --- what the algorithm decides ------------------------------------------------------------
    @abstractmethod
    def group(self) -> Tuple[int, ...]:
        """Ranks that synchronise every step (sorted)."""

    def note_group_floor(self, configured: int, used: int) -> None:
        """Log when the membership raised the configured floor (``policies.group_floor.join_safe_floor``)."""
        if used > configured:
            self.record_event("group_floor", configured=configured, used=used,
                              note=f"at most {max_outside(self.world_size, self.comm.join_is_fixed())} rank(s) out of "
                                   f"the group at {self.world_size} workers: this Horovod's join() is unsafe with more "
                                   "(stock 0.28.1; scripts/setup.sh builds it with the fix)")

    def computes_outside_group(self, rank: int) -> bool:
        """Whether a rank outside the group still computes (DPAR's struck-out ranks do not)."""
        return True

    @property
    @abstractmethod
    def slow_ratio(self) -> float:
        """The algorithm's detection ratio, also the early boundary's."""

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.early = EarlyBoundary(self.world_size, self.react_steps, self.slow_ratio)

    @abstractmethod
    def on_boundary(self, rows: List[List[float]], old_group: Tuple[int, ...], position: int) -> None:
        """Decide and merge. ``rows[r]`` holds rank r's numbers (columns RANK .. MODEL_READ; MODEL_READ is
        meaningful in the old group's leader's row: whether something reads the model after this boundary,
        as the leader, at the boundary's position, knows it; every rank takes the leader's)."""

    # --- helpers --------------------------------------------------------------------------------
    @property
    def _lined_up(self) -> bool:
        """At or behind the group's last boundary (catching up, validating, at an epoch end): every rank
        reaches the collectives run now at the same point. Else a step is in flight."""
        return self.position - 1 <= self._synced_through

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
        if self._join is not None and self.comm.join_done(self._join):
            self._boundary()  # the group has reached a boundary: join it now, then catch up
        elif self._join is not None and self._holds_for_boundary():
            self.boundary_holds += 1
            self._boundary()  # wait in join() for the group instead of making it wait for this step
        elif self._join is None and not self.in_group and self.position - 1 > self._synced_through:
            # caught up with the group: from here to the next boundary this rank runs no collective
            self._join = self.comm.join_async()
            self._window_opened_s = time.monotonic()  # the group's window needs this rank joined: it starts now
        self._batch_samples = batch_size_of(batch)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        self._carried_rows = None
        if not self.in_group:
            self._local_steps += 1
            return
        grads = self.gradients_of(optimizer)
        if len(self.group()) < self.world_size:
            self.comm.allreduce_among_(grads, self.group(), op="mean", tag="grads")
            return
        # With everyone in the group, the step's all-reduce also carries (one slot per rank, summed; "mean"
        # divides, so each rank puts in N x its numbers): every rank's compute time of the step (early
        # boundaries) and, when a boundary follows this step, every rank's boundary numbers, so that such a
        # boundary needs no all-gather of its own.
        extra, times, numbers = [], None, None
        if self.early is not None and self.early.enabled:
            times = grads[0].new_zeros(self.world_size)
            times[self.global_rank] = self.current_step_compute_s() * self.world_size
            extra.append(times)
        boundary_follows = self._is_boundary(self.position - 1)
        if boundary_follows:
            numbers = carried_slots(self._boundary_numbers(step_in_flight=True), self.global_rank, self.world_size,
                                    like=grads[0])
            extra.append(numbers)
        self.comm.allreduce_among_(grads + extra, self.group(), op="mean",
                                   tag="grads.boundary" if boundary_follows else "grads")
        if times is not None:
            self._early_due = self.early.observe(times.tolist())
        if numbers is not None:
            self._carried_rows = rows_from_carried(numbers.tolist())

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if not self.skip_this_batch():
            self._steps += 1
            self._samples += self._batch_samples
        here = self.position - 1
        if here > self._synced_through and (self._early_due or self._is_boundary(here)):
            self._boundary()

    def _boundary_numbers(self, step_in_flight: bool) -> List[float]:
        """This rank's row of a boundary's exchange (columns RANK .. MODEL_READ). ``step_in_flight``: taken
        during the step before the boundary (its all-reduce carries them), whose samples and step
        after_optimizer_step has not counted yet."""
        window = self.recorder.records[self._window_start:]  # the step in flight is not among them
        median = statistics.median([r.compute_s for r in window]) if window else math.nan
        if self._early_due:  # decided on the slow run that called it, as every rank saw it
            median = self.early.recent_medians()[self.global_rank]
        periods = [b.start_s - a.start_s for a, b in zip(window, window[1:])]
        model_read = model_read_after(self.position - 1, **self._facts_here())  # the leader's counts (at the boundary)
        steps, samples = self._steps, self._samples
        if step_in_flight:
            steps, samples = steps + 1, samples + self._batch_samples
        return [float(self.global_rank), float(self.position - 1), median, float(samples), float(steps),
                float(self._local_steps), statistics.median(periods) if periods else math.nan, float(model_read)]

    def _holds_for_boundary(self) -> bool:
        """Outside the group, caught up, between boundaries: whether this batch's local step would end after
        the group is predicted to reach its next boundary (policies/boundary.py decides)."""
        if not self.computes_outside_group(self.global_rank):
            return False
        trainer = self.lightning_module.trainer
        every, batches = trainer.val_check_batch, trainer.num_training_batches
        upcoming = next_boundary(
            self._synced_through, self.window_steps,
            epoch_start=self.position - 1 - trainer.fit_loop.epoch_loop.batch_idx,  # this rank's epoch is the group's
            epoch_batches=batches if isinstance(batches, int) else 0, total_steps=max(trainer.max_steps, 0),
            validation_every=every if trainer.enable_validation and isinstance(every, int) else 0,
            checkpoint_every=self._checkpoint_every())
        eta = boundary_eta(self._window_opened_s, upcoming - self._synced_through, self._group_step_s)
        mine = self.recorder.records[self._window_start:]
        own = statistics.median(r.compute_s for r in mine[-3:]) if mine else None
        return outside_rank_holds(time.monotonic(), eta, own, self._steps)

    def _facts_here(self) -> dict:
        """Lightning's facts about this rank's current batch, as policies/boundary.py's rules take them."""
        trainer = self.lightning_module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        every = trainer.val_check_batch  # validation runs after batches where (batch_idx + 1) % every == 0
        validation_follows = bool(trainer.enable_validation and isinstance(every, int) and every > 0
                                  and (epoch_loop.batch_idx + 1) % every == 0)
        return dict(last_of_epoch=bool(epoch_loop.batch_progress.is_last_batch), total_steps=trainer.max_steps,
                    validation_follows=validation_follows, checkpoint_every=self._checkpoint_every())

    def _checkpoint_every(self) -> List[int]:
        # checkpoints gather every rank's state: they come at boundaries (global_step = position + 1)
        trainer = self.lightning_module.trainer
        return [c._every_n_train_steps for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]

    def _is_boundary(self, position: int) -> bool:
        """Lightning's facts about ``position``, judged by the one boundary rule (policies/boundary.py)."""
        return is_boundary(position, self.window_steps, **self._facts_here())

    # --- the boundary ---------------------------------------------------------------------------
    def _boundary(self) -> None:
        started = time.perf_counter()
        old_group = self.group()
        if len(old_group) < self.world_size:  # meet the outside ranks in join(): everyone is released
            if self._join is not None:
                self.comm.join_wait(self._join)
                self._join = None
            else:
                self.comm.join()

        early = self._early_due
        carried, self._carried_rows = self._carried_rows, None
        if carried is not None and not early:
            rows = carried  # exchanged with this step's gradients (everyone was in the group)
        else:
            mine = self._boundary_numbers(step_in_flight=False)
            rows = sorted(self.comm.allgather(torch.tensor([mine], dtype=torch.float64), tag="boundary_stats").tolist())
        position = int(rows[old_group[0]][POSITION])  # the group's position (outside ranks may be behind)
        waited, outside = time.perf_counter() - started, len(old_group) < self.world_size
        self.boundary_waits.append((waited, outside))
        if outside and self.global_rank == old_group[0]:  # one group member per boundary counts the group's wait
            self._led_waits = [self._led_waits[0] + 1, self._led_waits[1] + waited, max(self._led_waits[2], waited)]
        self._synced_through = position  # lined up from here: the merge's collectives are over every rank

        self.on_boundary(rows, old_group, position)

        if self.in_group and self.global_rank not in old_group:
            self._local_steps = 0
        log.debug("rank %d: boundary at %d (own position %d), group %s", self.global_rank, position,
                  self.position - 1, self.group())
        self._window_start = len(self.recorder.records)
        self._steps = self._samples = 0
        self._just_synced = True
        periods = [rows[r][STEP_PERIOD] for r in old_group if rows[r][STEP_PERIOD] == rows[r][STEP_PERIOD]]
        self._group_step_s = statistics.median(periods) if periods else None
        if early:
            self.record_event("early_boundary", step=position, react_steps=self.react_steps, group=list(self.group()),
                              note=f"a rank was >= {self.slow_ratio} x the median for {self.react_steps} steps in a row")
        self._early_due = False
        if self.early is not None:
            self.early.reset()

    @override
    def on_train_end(self) -> None:
        # Training ends at a boundary, where nobody has joined yet; should it end elsewhere (a callback
        # stopping it), an outside rank may be joined: every rank joins once more, which releases all.
        if len(self.group()) < self.world_size:
            if self._join is not None:
                self.comm.join_wait(self._join)
                self._join = None
            else:
                self.comm.join()
            self._synced_through = self.position - 1
        super().on_train_end()
        sums = self.comm.allreduce(torch.tensor([float(self.boundary_holds), float(self._led_waits[0]), self._led_waits[1]],
                                                dtype=torch.float64), op="sum", tag="boundary_holds").tolist()
        longest = self.comm.allreduce(torch.tensor([self._led_waits[2]], dtype=torch.float64), op="max",
                                      tag="boundary_wait_max").item()
        if self.global_rank == 0:
            self.run_report["outside_rank_holds"] = int(sums[0])
            # the group's wait at boundaries while a rank was outside (the join + exchange, as the old group's
            # first rank measured it)
            self.run_report["group_boundary_wait"] = {"boundaries": int(sums[1]), "total_s": sums[2], "max_s": longest}
            # rank 0's own seconds at each such boundary (its hold, when rank 0 itself is outside)
            self.run_report["group_boundary_waits_s"] = [w for w, outside in self.boundary_waits if outside]

    # --- Lightning's collectives between boundaries ---------------------------------------------------
    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if self._lined_up or group is not None or not isinstance(tensor, Tensor) or not self.comm.initialized:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        op = _op_name(reduce_op)
        if op == "mean" and not tensor.is_floating_point():
            tensor = tensor.float()
        if not self.in_group:
            return tensor  # outside the group: the rank's own value, no collective
        members = self.group()
        if len(members) == self.world_size:
            return super().reduce(tensor, reduce_op=reduce_op)
        return _REDUCE[op](self.comm.allgather_among(tensor, members, tag="reduce"), dim=0)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        if self._lined_up or group is not None or not self.comm.initialized:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        if not self.in_group:
            return tensor.unsqueeze(0)
        return self.comm.allgather_among(tensor, self.group(), tag="all_gather")

    # --- non-finite check and exact resume (HorovodStrategy hooks) -----------------------------------
    @override
    def gradient_sync_group(self) -> Optional[Tuple[int, ...]]:
        # group members averaged their gradients; ranks outside it took a local step on their own
        return self.group() if self.in_group else None

    @override
    def gather_in_sync_group(self, tensor: Tensor, members: Tuple[int, ...], tag: str) -> Tensor:
        return self.comm.allgather_among(tensor, members, tag=tag)

    @override
    def strategy_state(self) -> dict:
        state = super().strategy_state()
        state["partial_group"] = {
            "position": self.position, "synced_through": self._synced_through, "steps": self._steps,
            "samples": self._samples, "local_steps": self._local_steps,
            "window": [r.as_row() for r in self.recorder.records[self._window_start:]],  # the open window
            "early": self.early.to_dict() if self.early is not None else None,
            "holds": self.boundary_holds, "led_waits": list(self._led_waits), "group_step_s": self._group_step_s,
        }
        return state

    @override
    def start_algorithm_at(self, step: int) -> None:
        # the boundary rules read position + 1 as the global step (the run's end, step-based checkpoints);
        # every rank restarts from the same checkpoint: lined up through the step before
        super().start_algorithm_at(step)
        self.position, self._synced_through = step, step - 1

    @override
    def load_strategy_state(self, state: dict) -> None:
        super().load_strategy_state(state)
        saved = state["partial_group"]
        self.position, self._synced_through = int(saved["position"]), int(saved["synced_through"])
        self._steps, self._samples, self._local_steps = int(saved["steps"]), int(saved["samples"]), int(saved["local_steps"])
        self.recorder.records = [StepRecord.from_row(r) for r in saved["window"]]
        if saved.get("early") is not None and self.early is not None:
            self.early.restore(saved["early"])
        self.boundary_holds = int(saved.get("holds", 0))
        count, total, longest = saved.get("led_waits", [0, 0.0, 0.0])
        self._led_waits = [int(count), float(total), float(longest)]
        self._group_step_s = saved.get("group_step_s")
        self.recorder.take_unsent()  # measured before the checkpoint: the profiler does not report them again
        self._window_start = 0
