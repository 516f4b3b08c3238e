"""``adaptive``: BOA's batch sizes, re-planned within a few steps of a change in any worker's speed.

Pure decision logic (no torch, no Horovod). Every rank sees every rank's (batch size, compute seconds)
of every step (the strategy adds them to the step's gradient all-reduce), feeds them to a
:class:`SpeedChangeDetector` in the same order, and so knows at the same step that a re-plan is due.

What comes from where:
* the time model t_i(b) = a_i + c_i b, the batch solver, worker-set tuning (a worker that costs more
  than it adds gets no samples) and the gain gate: BOA (``policies/boa.py``, unchanged);
* "a worker is slow when it is ``ratio`` x its reference": DPAR's detection, here against the
  worker's OWN recent per-sample time rather than the group's, so persistent differences (a slower GPU
  generation) are not a change, only a worker that changes speed is;
* new here: the check runs every step on numbers every rank already has, and a worker whose speed
  changed has its older measurements dropped, so the next plan is fitted on its new speed only: a
  re-plan comes ``react_steps`` steps after the change instead of at the next window (BOA re-plans
  every ``window_steps`` on windows of history, so a collapse is diluted by the old windows' points).

The rule, per rank r and step, with p = t / b (its per-sample time in that step; b is what it computed,
a placeholder sample for a left-out worker):
  ref_r = median of p over its kept history (before this step; no reference until it has ``react_steps``
  points); m_r = p / ref_r, and rel_r = m_r / (median of m over the ranks with a reference), so a
  slowdown of everyone at once (machine load, a pause) is nobody's change (re-planning cannot help it);
  slower when rel_r >= ratio, faster when rel_r <= 1 / ratio; ``up_r`` / ``down_r`` count such steps in a
  row (either resets the other). When either reaches ``react_steps``: r's history is cut
  to those last ``react_steps`` points and its streaks start again; the step is a re-plan step.
History keeps at most ``history_steps`` points per rank.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

DEFAULT_REACT_STEPS = 2
DEFAULT_REACT_RATIO = 1.5
DEFAULT_HISTORY_STEPS = 30


class SpeedChangeDetector:
    """Per-rank (batch, seconds) history and the change rule of the module docstring."""

    def __init__(self, world_size: int, react_steps: int = DEFAULT_REACT_STEPS, ratio: float = DEFAULT_REACT_RATIO,
                 history_steps: int = DEFAULT_HISTORY_STEPS) -> None:
        check_settings(react_steps, ratio, history_steps)
        self.world_size, self.react_steps, self.ratio, self.history_steps = world_size, react_steps, ratio, history_steps
        self.history: list[list[tuple[float, float]]] = [[] for _ in range(world_size)]
        self.up = [0] * world_size
        self.down = [0] * world_size

    def reference(self, rank: int) -> float | None:
        points = self.history[rank]
        if len(points) < self.react_steps:
            return None
        return statistics.median(t / b for b, t in points)

    def observe(self, batch_sizes: Sequence[float], seconds: Sequence[float]) -> list[int]:
        """One step of every rank; returns the ranks whose speed changed at this step (sorted)."""
        if len(batch_sizes) != self.world_size or len(seconds) != self.world_size:
            raise ValueError(f"expected {self.world_size} batch sizes and times, got {len(batch_sizes)} and {len(seconds)}")
        for r, b in enumerate(batch_sizes):
            if float(b) <= 0:
                raise ValueError(f"rank {r} computed {b} samples: every rank computes at least one (a placeholder)")
        per_sample = [float(t) / float(b) for b, t in zip(batch_sizes, seconds)]
        refs = [self.reference(r) for r in range(self.world_size)]
        moved = [p / ref if ref else None for p, ref in zip(per_sample, refs)]  # this step against its own speed
        known = [m for m in moved if m is not None]
        common = statistics.median(known) if known else 1.0  # everyone slower at once (load, a pause): no one's change
        changed = []
        for r in range(self.world_size):
            b, t = float(batch_sizes[r]), float(seconds[r])
            rel = None if moved[r] is None or common <= 0 else moved[r] / common
            slower = rel is not None and rel >= self.ratio
            faster = rel is not None and rel * self.ratio <= 1.0
            self.up[r] = self.up[r] + 1 if slower else 0
            self.down[r] = self.down[r] + 1 if faster else 0
            self.history[r] = (self.history[r] + [(b, t)])[-self.history_steps:]
            if max(self.up[r], self.down[r]) >= self.react_steps:
                self.history[r] = self.history[r][-self.react_steps:]  # the new speed only
                self.up[r] = self.down[r] = 0
                changed.append(r)
        return changed

    def amend_last(self, rank: int, seconds: float) -> None:
        """Replace the seconds of ``rank``'s newest point: a rank cut from a step by the deadline
        (``policies/deadline.py``) is first seen with the time it had been given, a lower bound; its real
        compute time arrives with the next step. Streaks already counted stay."""
        if self.history[rank]:
            b, _ = self.history[rank][-1]
            self.history[rank][-1] = (b, float(seconds))

    def points(self) -> list[list[tuple[float, float]]]:
        """Each rank's kept (batch size, seconds) points: what the time models are fitted on."""
        return [list(h) for h in self.history]

    def to_dict(self) -> dict:
        return {"history": [[list(p) for p in h] for h in self.history], "up": list(self.up), "down": list(self.down)}

    def restore(self, saved: dict) -> None:
        if len(saved["history"]) != self.world_size:
            raise ValueError(f"adaptive state is for {len(saved['history'])} ranks, this run has {self.world_size}")
        self.history = [[(float(b), float(t)) for b, t in h] for h in saved["history"]]
        self.up, self.down = [int(x) for x in saved["up"]], [int(x) for x in saved["down"]]


def check_settings(react_steps, ratio, history_steps) -> None:
    """The detector's settings, with messages naming each (config.py prefixes ``algorithm.``)."""
    if not isinstance(react_steps, int) or isinstance(react_steps, bool) or react_steps < 1:
        raise ValueError(f"react_steps must be an integer >= 1 (got {react_steps!r})")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 1 or ratio != ratio or ratio == float("inf"):
        raise ValueError(f"react_ratio must be a finite number > 1 (got {ratio!r})")
    if not isinstance(history_steps, int) or isinstance(history_steps, bool) or history_steps < react_steps:
        raise ValueError(f"history_steps must be an integer >= react_steps ({react_steps}) (got {history_steps!r})")
