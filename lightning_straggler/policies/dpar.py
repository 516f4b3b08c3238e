"""Dynamic Partial All-Reduce (DPAR): which workers take part in the global all-reduce.

Training stays synchronous, but a worker that is detected as slow is left out of the all-reduce so
the others stop waiting for it; the rest keep updating among themselves. An excluded worker is
either

* ``SLOW``: temporarily excluded. It keeps doing local steps (so its speed is still measured) and is
  re-admitted once it has been fast again for a while; or
* ``STRUCK_OUT``: excluded for good. It stops computing, has no measurement, and never comes back.

Pure decision logic: numbers in, decisions out. No Horovod, no Lightning. Decisions are taken at
window boundaries from each rank's median compute time per step over the last window
(:func:`window_median`), gathered to every rank; every rank then runs :func:`decide` on the same
numbers and the same :class:`DparMemory` and gets the same :class:`DparDecision` (ties are broken by
rank, nothing is random), so no rank has to tell the others what was decided.

Why these measurements:

* Compute time, i.e. the time of a step *before* any collective. Wall time per step includes the
  wait in the all-reduce, and in synchronous training every worker waits for the straggler: by
  wall time everybody looks as slow as the slowest worker.
* The median over the window, not the mean: a single long step (first-step compilation, a
  checkpoint, a GC pause, a data-loader hiccup) must not get a healthy worker excluded.
* The reference ``group_time`` is the median over the ACTIVE ranks, not their mean: the straggler
  cannot drag the reference towards itself, and since a candidate must be at least ``slow_ratio``
  (> 1) times the median, fewer than half of the active ranks can be candidates in any one window,
  so the group cannot talk itself into excluding its majority. (With two active ranks the median
  is their mean, so a worker ``x`` times slower than the other has ratio ``2x / (1 + x) < 2``.)

Why the cost comparison (rule 3 below). Keeping a worker that takes ``t_rank`` against the group's
``t_group`` makes each of the ``n_active`` workers wait ``t_rank - t_group`` per step:
``keep_cost = n_active * (t_rank - t_group)`` worker-seconds per step. Excluding it loses its own
work, one worker-step of ``t_group`` seconds, plus the cost of omitting its data shard from the
global gradient (fewer samples per step, a shard under-represented while it is out), counted as
``data_penalty`` worker-steps: ``exclude_cost = t_group * (1 + data_penalty)``. A worker is
excluded only when keeping it costs strictly more.

Why hysteresis. Re-admission needs ``ratio <= readmit_ratio`` (< ``slow_ratio``) for
``readmit_windows`` consecutive windows, so a worker hovering around the threshold does not flap in
and out of the all-reduce (each change costs a re-synchronisation of its parameters). Strike-out
needs ``ratio >= strikeout_ratio`` for ``strikeout_windows`` consecutive windows, so one bad window
does not cost a worker for the rest of the job.

The rules, applied in this order at each window boundary:

1. ``group_time`` = median of the times of the ACTIVE ranks that have a measurement; if none has,
   the median of all measured (non-struck-out) ranks; if nothing is measured at all, the decision
   is "no change": no transitions, counters unchanged, ``group_time`` is NaN.
2. Every rank that was ``SLOW`` at the start of the window, with ``ratio = t / group_time``
   (``+inf`` when it has no measurement: a SLOW rank keeps stepping, so doing no step at all in a
   window means it is too slow to finish one):

   * ``recovered_streak`` += 1 if ``ratio <= readmit_ratio``, else reset to 0;
     ``slow_streak`` += 1 if ``ratio >= strikeout_ratio``, else reset to 0;
   * if ``recovered_streak >= readmit_windows``: -> ``ACTIVE`` (reason :data:`REASON_RECOVERED`);
   * else if ``slow_streak >= strikeout_windows``: -> ``STRUCK_OUT`` (reason
     :data:`REASON_STRUCK_OUT`).

3. ``ACTIVE`` ranks (including any just re-admitted, which cannot qualify since
   ``readmit_ratio < slow_ratio``) with a measurement and ``ratio >= slow_ratio`` are exclusion
   candidates, processed slowest first (ties by rank). A candidate goes to ``SLOW`` (reason
   :data:`REASON_EXCLUDED`) iff ``keep_cost > exclude_cost`` and at least ``min_active`` ranks stay
   ACTIVE after removing it; ``n_active`` in ``keep_cost`` is the number of ACTIVE ranks just
   before this exclusion (after the re-admissions of rule 2 and the exclusions before it).
   A candidate that is kept, for either reason, produces **no** :class:`Transition`: the
   transitions are exactly the rank whose state changed. An ACTIVE rank without a measurement is
   never a candidate: in synchronous training it cannot have done fewer steps than the others, so
   a missing number means no data (e.g. an empty window), not slowness.
4. ``STRUCK_OUT`` never changes (its time, if any is given, is ignored).

Counters. Both streaks are 0 for every rank that is not SLOW after the decision. A newly excluded
rank starts with ``recovered_streak = 0`` and ``slow_streak = 1`` if its ratio is already
``>= strikeout_ratio`` (else 0): the exclusion window counts towards ``strikeout_windows``. But a
rank is never excluded and struck out in the same window (rule 2 only looks at ranks that were
already SLOW), so a rank that stays above ``strikeout_ratio`` is struck out
``max(strikeout_windows - 1, 1)`` windows after the window it was excluded in (with
``strikeout_windows=1``: at the very next window). A rank excluded in window ``w`` can be ACTIVE
again at window ``w + readmit_windows`` at the earliest.

Invariants: the number of ACTIVE ranks never falls below ``min_active`` through this function (a
state that starts below it only gets exclusions blocked); ``STRUCK_OUT`` is absorbing; the only
transitions are ACTIVE -> SLOW, SLOW -> ACTIVE and SLOW -> STRUCK_OUT; the input memory is not
mutated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np

from lightning_straggler.policies.group_floor import join_safe_floor

ACTIVE, SLOW, STRUCK_OUT = "active", "slow", "struck_out"
STATES = (ACTIVE, SLOW, STRUCK_OUT)

REASON_RECOVERED = "recovered"
REASON_STRUCK_OUT = "persistently slow"
REASON_EXCLUDED = "slow: excluding is cheaper"

__all__ = [
    "ACTIVE",
    "SLOW",
    "STRUCK_OUT",
    "STATES",
    "REASON_RECOVERED",
    "REASON_STRUCK_OUT",
    "REASON_EXCLUDED",
    "DparThresholds",
    "DparMemory",
    "Transition",
    "DparDecision",
    "window_median",
    "decide",
    "DparMembership",
]


def _is_int(x) -> bool:
    # bool is an int subclass, but True as a window count is a bug, not a 1.
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _check_world_size(world_size) -> int:
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (got {world_size!r})")
    return int(world_size)


# --------------------------------------------------------------------------------------------------
# Thresholds
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DparThresholds:
    """When to exclude, strike out and re-admit a worker (ratios are to the group's median time)."""

    slow_ratio: float = 1.5  # exclusion candidate: window median >= slow_ratio x group median
    strikeout_ratio: float = 5.0  # strike out: >= strikeout_ratio x group median ...
    strikeout_windows: int = 3  # ... for this many consecutive windows (counting the exclusion window)
    readmit_ratio: float = 1.2  # re-admit: <= readmit_ratio x group median ...
    readmit_windows: int = 2  # ... for this many consecutive windows
    min_active: int = 0  # never exclude below this many active workers; 0 = half the world, rounded up
    data_penalty: float = 0.5  # cost of omitting a worker's data shard, as a fraction of one worker-step

    def validate(self, world_size: int) -> None:
        """Raise ``ValueError`` naming the first bad field and its allowed range.

        ``slow_ratio > 1`` (a worker as fast as the median is not slow); ``slow_ratio <=
        strikeout_ratio`` (only an excluded worker can be struck out); ``1 <= readmit_ratio <
        slow_ratio`` (the gap is the hysteresis that stops flapping); windows >= 1;
        ``0 <= min_active <= world_size``; ``data_penalty >= 0``. Ratios and the penalty must be
        finite.
        """
        world_size = _check_world_size(world_size)
        s = self.slow_ratio
        if not _is_real(s) or not math.isfinite(s) or not s > 1:
            raise ValueError(f"slow_ratio must be a finite number > 1 (got {s!r})")
        k = self.strikeout_ratio
        if not _is_real(k) or not math.isfinite(k) or not k >= s:
            raise ValueError(f"strikeout_ratio must be a finite number >= slow_ratio (slow_ratio={s!r}) (got {k!r})")
        if not _is_int(self.strikeout_windows) or self.strikeout_windows < 1:
            raise ValueError(f"strikeout_windows must be an integer >= 1 (got {self.strikeout_windows!r})")
        r = self.readmit_ratio
        if not _is_real(r) or not math.isfinite(r) or not 1 <= r < s:
            raise ValueError(f"readmit_ratio must be in [1, slow_ratio) = [1, {s!r}) (slow_ratio={s!r}) (got {r!r})")
        if not _is_int(self.readmit_windows) or self.readmit_windows < 1:
            raise ValueError(f"readmit_windows must be an integer >= 1 (got {self.readmit_windows!r})")
        m = self.min_active
        if not _is_int(m) or not 0 <= m <= world_size:
            raise ValueError(f"min_active must be an integer in 0..world_size = 0..{world_size} "
                             f"(0 = half the world, rounded up) (got {m!r})")
        p = self.data_penalty
        if not _is_real(p) or not math.isfinite(p) or not p >= 0:
            raise ValueError(f"data_penalty must be a finite number >= 0 (got {p!r})")

    def min_active_for(self, world_size: int) -> int:
        """``min_active`` resolved for ``world_size``: 0 means ``ceil(world_size / 2)``; at least 1.

        Half the world by default: fewer than that and the "group" is no longer the majority whose
        median defines normal speed. At least 1 so there is always someone left to train.
        """
        world_size = _check_world_size(world_size)
        m = int(self.min_active) if self.min_active else (world_size + 1) // 2
        return max(1, m)


# --------------------------------------------------------------------------------------------------
# Memory carried between windows
# --------------------------------------------------------------------------------------------------


@dataclass
class DparMemory:
    """Per-rank state and streak counters carried from one window to the next.

    Part of the strategy's state: plain lists of str / int, so it pickles and round-trips through
    :meth:`to_dict` / :meth:`from_dict` (e.g. into a checkpoint). :func:`decide` never mutates it;
    it returns a new one.
    """

    states: List[str]  # per rank: ACTIVE / SLOW / STRUCK_OUT
    slow_streak: List[int] = field(default_factory=list)  # consecutive windows >= strikeout_ratio while excluded
    recovered_streak: List[int] = field(default_factory=list)  # consecutive windows <= readmit_ratio while SLOW

    @classmethod
    def initial(cls, world_size: int) -> "DparMemory":
        """Everybody ACTIVE, no streaks."""
        n = _check_world_size(world_size)
        return cls(states=[ACTIVE] * n, slow_streak=[0] * n, recovered_streak=[0] * n)

    def to_dict(self) -> dict:
        return {"states": list(self.states), "slow_streak": [int(x) for x in self.slow_streak],
                "recovered_streak": [int(x) for x in self.recovered_streak]}

    @classmethod
    def from_dict(cls, d) -> "DparMemory":
        """Inverse of :meth:`to_dict`; validates (``ValueError`` naming the bad key)."""
        try:
            keys = ("states", "slow_streak", "recovered_streak")
            missing = [k for k in keys if k not in d]
        except TypeError:
            raise ValueError(f"DparMemory.from_dict needs a mapping (got {type(d).__name__})") from None
        if missing:
            raise ValueError(f"DparMemory.from_dict: missing key(s) {missing}")
        mem = cls(states=[str(s) for s in d["states"]], slow_streak=list(d["slow_streak"]),
                  recovered_streak=list(d["recovered_streak"]))
        mem._check()
        mem.slow_streak = [int(x) for x in mem.slow_streak]
        mem.recovered_streak = [int(x) for x in mem.recovered_streak]
        return mem

    def _check(self, world_size: Optional[int] = None) -> None:
        n = len(self.states)
        if n < 1:
            raise ValueError("memory.states must not be empty")
        if world_size is not None and n != world_size:
            raise ValueError(f"memory.states has {n} ranks but times has {world_size}")
        bad = [s for s in self.states if s not in STATES]
        if bad:
            raise ValueError(f"memory.states must each be one of {', '.join(map(repr, STATES))} (got {bad[0]!r})")
        for name in ("slow_streak", "recovered_streak"):
            xs = getattr(self, name)
            if len(xs) != n:
                raise ValueError(f"memory.{name} must have one entry per rank ({n}) (got {len(xs)})")
            if not all(_is_int(x) and x >= 0 for x in xs):
                raise ValueError(f"memory.{name} must be integers >= 0 (got {list(xs)!r})")


# --------------------------------------------------------------------------------------------------
# Decision
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transition:
    """One rank's change of state, with the numbers that justified it (for logs).

    ``keep_cost = n_active * (t_rank - t_group)`` and ``exclude_cost = t_group * (1 +
    data_penalty)`` in worker-seconds per step. For an exclusion, ``n_active`` is the number of
    ACTIVE ranks just before it. For the transitions of a SLOW rank (re-admission, strike-out) the
    costs are informational, with ``n_active`` the number of ACTIVE ranks at the start of the
    window; ``keep_cost`` and ``ratio`` are ``+inf`` when the rank has no measurement.
    """

    rank: int
    from_state: str
    to_state: str
    ratio: float
    keep_cost: float  # worker-seconds per step lost by keeping it: n_active * (t_rank - t_group)
    exclude_cost: float  # worker-seconds per step lost by excluding it: t_group * (1 + data_penalty)
    reason: str


@dataclass(frozen=True)
class DparDecision:
    """The outcome of one window: new states, what changed and why, and the counters to carry on."""

    states: Tuple[str, ...]  # new state per rank
    transitions: Tuple[Transition, ...]  # one per rank whose state changed, sorted by rank
    group_time: float  # the reference: median over ACTIVE ranks' window medians (NaN if nothing measured)
    memory: DparMemory  # updated counters (a new object; the input is not mutated)

    @property
    def active(self) -> Tuple[int, ...]:
        """Sorted ranks in ACTIVE: the members of the next global all-reduce."""
        return tuple(i for i, s in enumerate(self.states) if s == ACTIVE)


def window_median(times: Sequence[float]) -> Optional[float]:
    """Median of one rank's per-step compute times over a window; ``None`` for an empty window.

    The median, not the mean, so that one long step (compilation, a checkpoint, a GC pause) does not
    make a healthy worker look slow. NaN entries are ignored (a step that was not timed); a window
    of only NaNs counts as empty.
    """
    arr = np.asarray(list(times), dtype=float).reshape(-1)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return None
    return float(np.median(arr))


def _clean_times(times: Sequence[Optional[float]]) -> List[Optional[float]]:
    out: List[Optional[float]] = []
    for i, t in enumerate(times):
        if t is None:
            out.append(None)
            continue
        if not _is_real(t):
            raise ValueError(f"times[{i}] must be None or a finite number >= 0 (got {t!r})")
        t = float(t)
        if math.isnan(t):  # NaN-safe: an untimed window is the same as no measurement
            out.append(None)
        elif not math.isfinite(t) or t < 0:
            raise ValueError(f"times[{i}] must be None or a finite number >= 0 (got {t!r})")
        else:
            out.append(t)
    return out


def _ratio(t: Optional[float], g: float) -> float:
    if t is None:
        return math.inf
    if g > 0:
        return t / g
    return 1.0 if t == 0 else math.inf  # a zero reference: only another zero is "as fast"


def decide(times: Sequence[Optional[float]], memory: DparMemory, thresholds: DparThresholds) -> DparDecision:
    """The DPAR decision for one window (see the module docstring for the rules and why).

    ``times[i]`` is rank i's :func:`window_median` compute time per step, or ``None`` (or NaN) when
    it has no measurement (struck out, or did no step this window). ``memory`` is the previous
    decision's memory (:meth:`DparMemory.initial` at the start). Deterministic: the same arguments
    give an identical decision on every rank.

    Raises ``ValueError`` for invalid thresholds (naming the field), a ``memory`` whose length or
    contents do not fit, or a time that is negative or infinite.
    """
    t = _clean_times(list(times))
    n = len(t)
    if n < 1:
        raise ValueError("times must have one entry per rank (got none)")
    memory._check(n)
    thresholds.validate(n)
    th = thresholds
    min_active = th.min_active_for(n)

    states = list(memory.states)
    slow_streak = [int(x) for x in memory.slow_streak]
    recovered = [int(x) for x in memory.recovered_streak]

    # Rule 1: the reference.
    active_times = [t[i] for i in range(n) if states[i] == ACTIVE and t[i] is not None]
    if not active_times:
        active_times = [t[i] for i in range(n) if states[i] != STRUCK_OUT and t[i] is not None]
    if not active_times:
        return DparDecision(states=tuple(states), transitions=(), group_time=math.nan,
                            memory=DparMemory(states, slow_streak, recovered))
    g = float(np.median(np.asarray(active_times, dtype=float)))
    penalty = 1.0 + float(th.data_penalty)
    exclude_cost = g * penalty

    def keep_cost(i: int, n_act: int) -> float:
        return math.inf if t[i] is None else n_act * (t[i] - g)

    transitions: List[Transition] = []

    # Rule 2: ranks that were SLOW at the start of the window.
    n_active_start = sum(1 for s in states if s == ACTIVE)
    for i in range(n):
        if memory.states[i] != SLOW:
            continue
        r = _ratio(t[i], g)
        recovered[i] = recovered[i] + 1 if r <= th.readmit_ratio else 0
        slow_streak[i] = slow_streak[i] + 1 if r >= th.strikeout_ratio else 0
        if recovered[i] >= th.readmit_windows:
            new, reason = ACTIVE, REASON_RECOVERED
        elif slow_streak[i] >= th.strikeout_windows:
            new, reason = STRUCK_OUT, REASON_STRUCK_OUT
        else:
            continue
        states[i] = new
        transitions.append(Transition(i, SLOW, new, r, keep_cost(i, n_active_start), exclude_cost, reason))

    # Rule 3: exclusion candidates, slowest first, ties by rank.
    candidates = sorted(
        (i for i in range(n) if states[i] == ACTIVE and t[i] is not None and _ratio(t[i], g) >= th.slow_ratio),
        key=lambda i: (-_ratio(t[i], g), i))
    n_active = sum(1 for s in states if s == ACTIVE)
    for i in candidates:
        kc = keep_cost(i, n_active)
        if not kc > exclude_cost or n_active - 1 < min_active:
            continue  # kept: no Transition (transitions are exactly the state changes)
        r = _ratio(t[i], g)
        states[i] = SLOW
        recovered[i] = 0
        slow_streak[i] = 1 if r >= th.strikeout_ratio else 0  # the exclusion window counts
        transitions.append(Transition(i, ACTIVE, SLOW, r, kc, exclude_cost, REASON_EXCLUDED))
        n_active -= 1

    # Counters only mean something while SLOW.
    for i in range(n):
        if states[i] != SLOW:
            slow_streak[i] = 0
            recovered[i] = 0

    transitions.sort(key=lambda tr: tr.rank)
    return DparDecision(states=tuple(states), transitions=tuple(transitions), group_time=g,
                        memory=DparMemory(states, slow_streak, recovered))


class DparMembership:
    """DPAR's membership over a job: every worker's state, the synchronous group it makes, who still
    computes outside the group, and the decision at each boundary. ``DparStrategy`` keeps one on every
    rank and the simulator one per run; both feed it the same gathered window medians.

    ``join_fixed``: whether Horovod's ``join()`` is safe with several ranks out (the project's patched
    build); if not, the floor is raised so that at most one rank is out above 4 workers
    (``policies/group_floor.py``). ``configured_floor`` / ``thresholds.min_active`` tell whether it was.
    """

    def __init__(self, world_size: int, thresholds: DparThresholds, join_fixed: bool = True) -> None:
        thresholds.validate(world_size)
        self.configured_floor = thresholds.min_active_for(world_size)
        self.thresholds = replace(thresholds, min_active=join_safe_floor(world_size, self.configured_floor, join_fixed))
        self.memory = DparMemory.initial(world_size)

    @property
    def world_size(self) -> int:
        return len(self.memory.states)

    @property
    def states(self) -> List[str]:
        return list(self.memory.states)

    def group(self) -> Tuple[int, ...]:
        """The ACTIVE ranks (sorted): the members of every step's all-reduce until the next boundary."""
        return tuple(r for r, s in enumerate(self.memory.states) if s == ACTIVE)

    def computes_outside_group(self, rank: int) -> bool:
        """SLOW ranks keep stepping alone (their speed is still measured); STRUCK_OUT ranks do not."""
        return self.memory.states[rank] != STRUCK_OUT

    def decide(self, window_medians: Sequence[Optional[float]]) -> DparDecision:
        """A boundary's decision from every rank's median compute per step (None: no measurement)."""
        decision = decide(window_medians, self.memory, self.thresholds)
        self.memory = decision.memory
        return decision

    def merges(self, old_group: Sequence[int], new_group: Sequence[int], model_read: bool = True) -> bool:
        """DPAR's merge rule: a rank that was outside the group continues from the old group's model (its
        leader broadcasts the training state; local updates outside it are dropped) when it comes back, and
        before anything reads the model (``model_read``: a validation, checkpoint, epoch end or the end of
        the run; ``policies/boundary.model_read_after``), so every rank holds the group's model there. A
        rank that leaves the group holds the group's model already, and at a mere window end nothing reads
        an outside rank's copy: no broadcast."""
        outside_before = len(old_group) < self.world_size
        return outside_before and (bool(set(new_group) - set(old_group)) or model_read)

    @staticmethod
    def transition_event(transition: Transition, group_time: float) -> dict:
        """The logged fields of one transition (the strategy and the simulator log the same)."""
        return {"rank": transition.rank, "from_state": transition.from_state, "to_state": transition.to_state,
                "ratio": transition.ratio, "keep_cost": transition.keep_cost,
                "exclude_cost": transition.exclude_cost, "reason": transition.reason, "group_time": group_time}

    def to_dict(self) -> dict:
        return self.memory.to_dict()

    def restore(self, memory: dict) -> None:
        restored = DparMemory.from_dict(memory)
        if len(restored.states) != self.world_size:
            raise ValueError(f"a dpar memory of {len(restored.states)} ranks cannot be restored on {self.world_size}")
        self.memory = restored
