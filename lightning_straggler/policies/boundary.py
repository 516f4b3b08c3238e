"""Where a partial-group algorithm (dpar, awar) meets every rank: the boundary rule, in one place.

A position (0-based optimizer step) ends a window and everyone meets after it when it is
  * the last of a decision window: (position + 1) % window_steps == 0;
  * the last of an epoch, or the last of the run;
  * followed by a validation or a step-based checkpoint (both read every rank's model).
The strategy (strategies/partial_group.py) reads those facts from Lightning's loop; the simulator
(sim/partial_group.py) from its workload. Both ask this function, so they cannot drift apart.
"""
from __future__ import annotations

from collections.abc import Iterable


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
