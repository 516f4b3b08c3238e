"""Where a partial-group algorithm (dpar, awar) meets every rank: the boundary rule, in one place.

A position (0-based optimizer step) ends a window and everyone meets after it when it is
  * the last of a decision window: (position + 1) % window_steps == 0;
  * the last of an epoch, or the last of the run;
  * followed by a validation or a step-based checkpoint (both read every rank's model);
  * (EarlyBoundary, below) while nobody is outside the group: when a rank has been slow for
    ``react_steps`` steps in a row.
The strategy (strategies/partial_group.py) reads those facts from Lightning's loop; the simulator
(sim/partial_group.py) from its workload. Both ask this function, so they cannot drift apart.

A rank outside the group learns of a boundary only between two of its local steps, so the group waits
there for the local step in flight (up to one of the straggler's steps). ``outside_rank_holds`` lets it
wait for the boundary instead of starting a step predicted to end after the group gets there
(``next_boundary``: where; the group's step period from the last boundary's numbers: when).
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Optional

#: steps in a row a rank must be slow before the group holds a boundary early (0 = only at window ends)
DEFAULT_REACT_STEPS = 3


def is_boundary(position: int, window_steps: int, *, last_of_epoch: bool, total_steps: int = 0,
                validation_follows: bool = False, checkpoint_every: Iterable[int] = ()) -> bool:
    """True when every rank meets after ``position`` (the same answer on every rank for the same facts).

    ``total_steps`` <= 0 means no step limit; ``checkpoint_every`` lists step-based checkpoint periods
    (0 = none)."""
    return (position + 1) % window_steps == 0 or model_read_after(
        position, last_of_epoch=last_of_epoch, total_steps=total_steps, validation_follows=validation_follows,
        checkpoint_every=checkpoint_every)


def model_read_after(position: int, *, last_of_epoch: bool, total_steps: int = 0, validation_follows: bool = False,
                     checkpoint_every: Iterable[int] = ()) -> bool:
    """True when something reads the model after ``position``: a validation, a step-based checkpoint, the
    epoch's end (its callbacks), the end of the run. Every boundary but a mere window end. DPAR hands
    the group's model to ranks outside the group only before these (``policies/dpar.merges``)."""
    step = position + 1
    if last_of_epoch or (total_steps > 0 and step >= total_steps):
        return True
    if any(every > 0 and step % every == 0 for every in checkpoint_every):
        return True
    return bool(validation_follows)


def next_boundary(after: int, window_steps: int, *, epoch_start: int, epoch_batches: int = 0, total_steps: int = 0,
                  validation_every: int = 0, checkpoint_every: Iterable[int] = ()) -> int:
    """The first position after ``after`` that :func:`is_boundary` calls a boundary, from the facts known
    ahead: the current epoch began at position ``epoch_start`` and has ``epoch_batches`` batches (0 =
    unknown), a validation follows every ``validation_every``-th batch of an epoch (0 = none). Early
    boundaries are not predicted (there are none while a rank is outside the group)."""
    checkpoint_every = tuple(checkpoint_every)
    for position in range(after + 1, after + window_steps + 1):
        index = position - epoch_start  # the batch's index in its epoch
        if is_boundary(position, window_steps, last_of_epoch=epoch_batches > 0 and index == epoch_batches - 1,
                       total_steps=total_steps, checkpoint_every=checkpoint_every,
                       validation_follows=validation_every > 0 and (index + 1) % validation_every == 0):
            return position
    raise AssertionError("a window's end lies within window_steps positions")  # (position + 1) % window_steps == 0


def outside_rank_holds(now_s: float, boundary_eta_s: Optional[float], own_step_s: Optional[float],
                       local_steps_since_boundary: int) -> bool:
    """Whether a rank outside the group waits for the next boundary instead of starting another local step:
    when that step is predicted to end after the group reaches the boundary (``boundary_eta_s``), which
    would otherwise wait for it there. A rank always computes one local step per window, so its speed is
    still measured (re-admission and strike-out decide on it); without a prediction it computes."""
    if local_steps_since_boundary < 1 or boundary_eta_s is None or own_step_s is None:
        return False
    return now_s + own_step_s > boundary_eta_s


def boundary_eta(left_last_boundary_s: float, steps_to_boundary: int, group_step_s: Optional[float]) -> Optional[float]:
    """When the group is predicted to reach its next boundary: ``steps_to_boundary`` of its steps after it
    left the last one (None without a step period)."""
    if group_step_s is None or not group_step_s > 0:
        return None
    return left_last_boundary_s + steps_to_boundary * group_step_s


class EarlyBoundary:
    """Holds a boundary before the window ends when a rank of the full group has been slow for
    ``react_steps`` steps in a row, so a new straggler costs a few steps of waiting, not a window.

    Fed with every rank's compute time of each step (before any collective): the strategy adds them to
    the step's gradient all-reduce (one slot per rank, no extra collective), the simulator takes them
    from its workload. Every rank feeds the same numbers in the same order, so every rank decides the
    same steps. A rank is slow in a step when its time is at least ``slow_ratio`` x the median over all
    ranks (the algorithm's own detection ratio; the median, so a straggler cannot drag the reference).

    Only while nobody is outside the group: an outside rank does not take part in the group's steps and
    may be anywhere between boundaries, so the group cannot move a boundary it has not been told about.
    What the boundary decides is still the algorithm's policy, from each rank's median over the slow run
    (:meth:`recent_medians`) instead of the whole window. ``react_steps = 0`` turns it off.
    """

    def __init__(self, world_size: int, react_steps: int, slow_ratio: float) -> None:
        if not isinstance(react_steps, int) or isinstance(react_steps, bool) or react_steps < 0:
            raise ValueError(f"react_steps must be an integer >= 0 (0 = decide only at window ends) (got {react_steps!r})")
        if not slow_ratio > 1:
            raise ValueError(f"slow_ratio must be > 1 (got {slow_ratio!r})")
        self.world_size, self.react_steps, self.slow_ratio = world_size, react_steps, float(slow_ratio)
        self.streaks = [0] * world_size  # consecutive slow steps per rank since the last boundary
        self.recent: list[list[float]] = []  # the last react_steps steps' times, oldest first

    @property
    def enabled(self) -> bool:
        return self.react_steps > 0

    def observe(self, times: Sequence[float]) -> bool:
        """Take one step's compute times (one per rank); True when a boundary should follow this step."""
        if not self.enabled:
            return False
        if len(times) != self.world_size:
            raise ValueError(f"expected {self.world_size} compute times, got {len(times)}")
        reference = statistics.median(times)
        for rank, t in enumerate(times):
            self.streaks[rank] = self.streaks[rank] + 1 if t >= self.slow_ratio * reference else 0
        self.recent = (self.recent + [list(map(float, times))])[-self.react_steps:]
        return max(self.streaks) >= self.react_steps

    def recent_medians(self) -> list[float]:
        """Each rank's median compute over the last ``react_steps`` steps: what an early boundary decides on."""
        return [statistics.median(step[rank] for step in self.recent) for rank in range(self.world_size)]

    def reset(self) -> None:
        """At every boundary (early or not): streaks start again."""
        self.streaks = [0] * self.world_size
        self.recent = []

    def to_dict(self) -> dict:
        return {"streaks": list(self.streaks), "recent": [list(s) for s in self.recent]}

    def restore(self, saved: dict) -> None:
        if len(saved["streaks"]) != self.world_size:
            raise ValueError(f"early-boundary state is for {len(saved['streaks'])} ranks, this run has {self.world_size}")
        self.streaks = [int(s) for s in saved["streaks"]]
        self.recent = [[float(t) for t in s] for s in saved["recent"]]
