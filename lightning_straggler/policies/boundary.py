"""Where a partial-group algorithm (dpar, awar) meets every rank: the boundary rule, in one place.

A position (0-based optimizer step) ends a window and everyone meets after it when it is
  * the last of a decision window: (position + 1) % window_steps == 0;
  * the last of an epoch, or the last of the run;
  * followed by a validation or a step-based checkpoint (both read every rank's model);
  * (EarlyBoundary, below) while nobody is outside the group: when a rank has been slow for
    ``react_steps`` steps in a row.
The strategy (strategies/partial_group.py) reads those facts from Lightning's loop; the simulator
(sim/partial_group.py) from its workload. Both ask this function, so they cannot drift apart.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

#: steps in a row a rank must be slow before the group holds a boundary early (0 = only at window ends)
DEFAULT_REACT_STEPS = 3


def is_boundary(position: int, window_steps: int, *, last_of_epoch: bool, total_steps: int = 0,
                validation_follows: bool = False, checkpoint_every: Iterable[int] = ()) -> bool:
    """True when every rank meets after ``position`` (the same answer on every rank for the same facts).

    ``total_steps`` <= 0 means no step limit; ``checkpoint_every`` lists step-based checkpoint periods
    (0 = none)."""
    step = position + 1
    if step % window_steps == 0 or last_of_epoch:
        return True
    if total_steps > 0 and step >= total_steps:
        return True
    if any(every > 0 and step % every == 0 for every in checkpoint_every):
        return True
    return bool(validation_follows)


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
