"""Adaptive Weighted All-Reduce (AWAR): who trains in the synchronous group, and how models merge.

Pure decision logic. At every merge point each rank's median compute time per step over the period
(before any collective) is gathered; every rank classifies the same way:

* ``group_time`` = median over the NORMAL ranks with a measurement (if none, over all measured);
* a STRAGGLER whose ratio t / group_time <= ``recover_ratio`` rejoins the group (hysteresis: it left
  at >= ``slow_ratio`` > ``recover_ratio``);
* NORMAL ranks with ratio >= ``slow_ratio`` become stragglers, slowest first (ties by rank), while
  at least ``min_group`` ranks stay NORMAL (0 = half the world, rounded up);
* a rank with no measurement keeps its class (a straggler that did no step stays a straggler).

Merging is a weighted model average ``sum_i w_i theta_i / sum_i w_i`` with ``w_i`` the number of
gradient updates rank i contributed since the last average (``weighting="updates"``, the thesis: a
group member counts the group's steps, a straggler its own local steps) or the samples it processed
(``weighting="samples"``). A model that learned little moves the result little; a rank with zero
updates has weight 0. If every weight is 0 nobody changed anything since the last average, and the
average of the (identical) models is taken with equal weights.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_straggler.policies.group_floor import join_safe_floor

NORMAL, STRAGGLER = "normal", "straggler"


def _is_int(x) -> bool:  # bool is an int subclass: min_group=True is a mistake, not 1
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
WEIGHTINGS = ("updates", "samples")


@dataclass(frozen=True)
class AwarThresholds:
    slow_ratio: float = 1.5
    recover_ratio: float = 1.2
    min_group: int = 0

    def validate(self, world_size: int) -> None:
        if not (_is_real(self.slow_ratio) and math.isfinite(self.slow_ratio) and self.slow_ratio > 1.0):
            raise ValueError(f"slow_ratio must be a finite number > 1 (got {self.slow_ratio!r})")
        if not (_is_real(self.recover_ratio) and 1.0 <= self.recover_ratio < self.slow_ratio):
            raise ValueError(f"recover_ratio must be in [1, slow_ratio) = [1, {self.slow_ratio}) (slow_ratio={self.slow_ratio}) (got {self.recover_ratio!r})")
        if not (_is_int(self.min_group) and 0 <= self.min_group <= world_size):
            raise ValueError(f"min_group must be an integer in 0..{world_size} (0 = half, rounded up) (got {self.min_group!r})")

    def min_group_for(self, world_size: int) -> int:
        return self.min_group or max(1, math.ceil(world_size / 2))


def classify(times: Sequence[Optional[float]], states: Sequence[str],
             thresholds: AwarThresholds) -> Tuple[List[str], List[Dict]]:
    """New class per rank and the changes (rank, from_state, to_state, ratio, group_time, reason)."""
    if len(times) != len(states):
        raise ValueError(f"times and states must have one entry per rank ({len(times)} != {len(states)})")
    measured = [(i, t) for i, t in enumerate(times) if t is not None and math.isfinite(t)]
    normal = [t for i, t in measured if states[i] == NORMAL]
    pool = normal or [t for _, t in measured]
    new = list(states)
    if not pool:
        return new, []
    group_time = statistics.median(pool)

    def ratio(t: float) -> float:
        return t / group_time if group_time > 0 else (1.0 if t == 0 else math.inf)

    changes = []
    for i, t in measured:
        if states[i] == STRAGGLER and ratio(t) <= thresholds.recover_ratio:
            new[i] = NORMAL
            changes.append(dict(rank=i, from_state=STRAGGLER, to_state=NORMAL, ratio=ratio(t),
                                group_time=group_time, reason="recovered"))
    floor = thresholds.min_group_for(len(states))
    candidates = sorted(((ratio(t), i) for i, t in measured if states[i] == NORMAL and ratio(t) >= thresholds.slow_ratio),
                        key=lambda c: (-c[0], c[1]))
    for r, i in candidates:
        if sum(s == NORMAL for s in new) - 1 < floor:
            break
        new[i] = STRAGGLER
        changes.append(dict(rank=i, from_state=NORMAL, to_state=STRAGGLER, ratio=r, group_time=group_time,
                            reason="slow"))
    changes.sort(key=lambda c: c["rank"])
    return new, changes


def average_weights(updates: Sequence[float], samples: Sequence[float], weighting: str = "updates") -> List[float]:
    """Normalised merge weights (sum 1)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)} (got {weighting!r})")
    raw = [float(x) for x in (updates if weighting == "updates" else samples)]
    if any(x < 0 or not math.isfinite(x) for x in raw):
        raise ValueError(f"weights must be finite and >= 0 (got {raw})")
    total = sum(raw)
    if total == 0:
        return [1.0 / len(raw)] * len(raw)
    return [x / total for x in raw]


#: ``period_steps=0``: no periodic merge; the group's window is then longer than any run, so boundaries
#: come only at the sync points (epoch ends, validation, checkpoints, the end of training).
EPOCH_ONLY = 10**12


def merge_window(period_steps: int) -> int:
    """Steps between periodic merges (and re-classifications): ``period_steps``, or none if 0."""
    return period_steps or EPOCH_ONLY


class AwarMembership:
    """AWAR's membership over a job: every worker's class, the synchronous group, when a merge is due and
    its weights. ``AwarStrategy`` keeps one on every rank and the simulator one per run; both feed it the
    same gathered numbers. ``join_fixed`` as for ``DparMembership`` (the floor is ``min_group``)."""

    def __init__(self, world_size: int, thresholds: AwarThresholds, weighting: str = "updates",
                 join_fixed: bool = True) -> None:
        thresholds.validate(world_size)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)} (got {weighting!r})")
        self.configured_floor = thresholds.min_group_for(world_size)
        self.thresholds = replace(thresholds, min_group=join_safe_floor(world_size, self.configured_floor, join_fixed))
        self.weighting = weighting
        self.states: List[str] = [NORMAL] * world_size

    @property
    def world_size(self) -> int:
        return len(self.states)

    def group(self) -> Tuple[int, ...]:
        """The NORMAL ranks (sorted), or everyone if all were classed stragglers."""
        return tuple(r for r, s in enumerate(self.states) if s == NORMAL) or tuple(range(self.world_size))

    def merges(self, old_group: Sequence[int]) -> bool:
        """A weighted average is due at a boundary where someone trained on its own copy."""
        return len(old_group) < self.world_size

    def merge_weights(self, updates: Sequence[float], samples: Sequence[float]) -> List[float]:
        return average_weights(updates, samples, self.weighting)

    def restore(self, states: Sequence[str]) -> None:
        if len(states) != self.world_size or any(s not in (NORMAL, STRAGGLER) for s in states):
            raise ValueError(f"awar classes {list(states)} cannot be restored on {self.world_size} ranks")
        self.states = list(states)

    def classify(self, window_medians: Sequence[Optional[float]]) -> List[Dict]:
        """Re-classify from every rank's median compute per step (None: no measurement); the changes."""
        self.states, changes = classify(window_medians, self.states, self.thresholds)
        return changes
