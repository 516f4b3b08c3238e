"""Straggler schedules: the slowdown factor of a rank at a step, deterministic for a seed.

The factor depends only on (scenario, seed, rank, step): a rank that runs ahead of or behind the
others (an excluded straggler doing local steps) still gets its own schedule, and a resumed run
continues the same schedule without saved RNG state.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class SlowdownEvent:
    rank: int
    factor: float
    start_step: int = 0
    end_step: Optional[int] = None  # exclusive; None = until the end

    def active(self, rank: int, step: int) -> bool:
        return rank == self.rank and step >= self.start_step and (self.end_step is None or step < self.end_step)


class StragglerSchedule:
    """Base: no straggler."""

    scenario = "none"

    def factor(self, rank: int, step: int) -> float:
        return 1.0

    def describe(self) -> dict:
        return {"scenario": self.scenario}


class StaticSchedule(StragglerSchedule):
    """A fixed factor per rank (e.g. a cluster that mixes GPU generations). Ranks past the list run at 1.0."""

    scenario = "static"

    def __init__(self, factors: Sequence[float]) -> None:
        self.factors = [float(f) for f in factors]

    def factor(self, rank: int, step: int) -> float:
        return self.factors[rank] if rank < len(self.factors) else 1.0

    def describe(self) -> dict:
        return {"scenario": self.scenario, "factors": self.factors}


class TransientSchedule(StragglerSchedule):
    """Listed events; overlapping events on one rank take the largest factor."""

    scenario = "transient"

    def __init__(self, events: Sequence[SlowdownEvent]) -> None:
        self.events = list(events)

    def factor(self, rank: int, step: int) -> float:
        return max([e.factor for e in self.events if e.active(rank, step)], default=1.0)

    def describe(self) -> dict:
        return {"scenario": self.scenario, "events": [e.__dict__ for e in self.events]}


class RandomSchedule(StragglerSchedule):
    """Per window of ``window_steps`` steps, each rank becomes slow with probability ``probability``,
    with a factor drawn uniformly from [factor_min, factor_max], for a duration drawn uniformly from
    [duration_min, duration_max] steps. Each (rank, window) draw has its own seeded generator, so the
    factor is a pure function of (seed, rank, step).
    """

    scenario = "random"

    def __init__(self, seed: int, probability: float, factor_min: float, factor_max: float,
                 duration_min: int, duration_max: int, window_steps: int) -> None:
        self.seed = int(seed)
        self.probability = float(probability)
        self.factor_min, self.factor_max = float(factor_min), float(factor_max)
        self.duration_min, self.duration_max = int(duration_min), int(duration_max)
        self.window_steps = int(window_steps)
        # draws are pure in (rank, window); kept because factor() asks for the same few windows at every step
        self._drawn: Dict[Tuple[int, int], Optional[SlowdownEvent]] = {}

    def event(self, rank: int, window: int) -> Optional[SlowdownEvent]:
        key = (int(rank), int(window))
        if key not in self._drawn:
            self._drawn[key] = self._draw(*key)
        return self._drawn[key]

    def _draw(self, rank: int, window: int) -> Optional[SlowdownEvent]:
        rng = np.random.default_rng([self.seed, rank, window])
        slow, f, d = rng.random(), rng.random(), rng.integers(self.duration_min, self.duration_max + 1)
        if slow >= self.probability:
            return None
        start = window * self.window_steps
        return SlowdownEvent(rank, self.factor_min + f * (self.factor_max - self.factor_min), start, start + int(d))

    def factor(self, rank: int, step: int) -> float:
        if step < 0:
            return 1.0
        last = step // self.window_steps
        first = max(0, (step - self.duration_max) // self.window_steps)
        events = (self.event(rank, w) for w in range(first, last + 1))
        return max([e.factor for e in events if e is not None and e.active(rank, step)], default=1.0)

    def events_until(self, world_size: int, steps: int) -> List[SlowdownEvent]:
        """Every event that starts before ``steps`` (for the summary and for tests)."""
        out = []
        for w in range(0, (steps + self.window_steps - 1) // self.window_steps):
            for rank in range(world_size):
                e = self.event(rank, w)
                if e is not None:
                    out.append(e)
        return out

    def describe(self) -> dict:
        return {"scenario": self.scenario, "seed": self.seed, "probability": self.probability,
                "factor_range": [self.factor_min, self.factor_max],
                "duration_range": [self.duration_min, self.duration_max], "window_steps": self.window_steps}


class TraceSchedule(StragglerSchedule):
    """Trace-like slowdowns: every rank alternates healthy gaps and slow episodes whose lengths are
    heavy-tailed, as measured slowdowns in shared clusters are (most episodes short, a few very long).

    Per rank, a seeded sequence: gap, episode, gap, episode, ... Gaps and episodes are Pareto-distributed
    with tail index ``tail_index`` (alpha; smaller = heavier tail, alpha <= 2 has infinite variance) and
    scales ``gap_min`` and ``duration_min`` steps (their minimum lengths); episodes are capped at
    ``duration_max`` steps. An episode's factor is log-uniform in [factor_min, factor_max] (in a 1.5-6 range
    as many 1.5-3x as 3-6x slowdowns). The factor is a pure function of (seed, rank, step).
    """

    scenario = "trace"

    def __init__(self, seed: int, tail_index: float, gap_min: int, duration_min: int, duration_max: int,
                 factor_min: float, factor_max: float) -> None:
        if not (gap_min >= 1 and 1 <= duration_min <= duration_max):
            raise ValueError(f"trace needs gap_min >= 1 and 1 <= duration_min <= duration_max "
                             f"(got {gap_min}, {duration_min}, {duration_max})")
        if not (0.5 <= tail_index <= 10 and 1.0 <= factor_min <= factor_max < math.inf):
            raise ValueError(f"trace needs tail_index in [0.5, 10] and 1 <= factor_min <= factor_max < inf "
                             f"(got {tail_index}, {factor_min}, {factor_max})")
        self.seed, self.tail_index = int(seed), float(tail_index)
        self.gap_min, self.duration_min, self.duration_max = int(gap_min), int(duration_min), int(duration_max)
        self.factor_min, self.factor_max = float(factor_min), float(factor_max)
        self._episodes: dict = {}  # rank -> (episodes in order, their start steps, rng, next free step)

    def _pareto_steps(self, rng: np.random.Generator, scale: int) -> int:
        return int(scale * (1.0 - rng.random()) ** (-1.0 / self.tail_index))  # inverse CDF, >= scale

    def episodes(self, rank: int, until_step: int) -> List[SlowdownEvent]:
        """Rank's episodes in order, at least up to the first one that starts after ``until_step``."""
        events, starts, rng, cursor = self._episodes.get(rank) or ([], [], np.random.default_rng([self.seed, rank]), 0)
        while cursor <= until_step:
            start = cursor + self._pareto_steps(rng, self.gap_min)
            length = min(self.duration_max, self._pareto_steps(rng, self.duration_min))
            factor = float(np.exp(rng.uniform(np.log(self.factor_min), np.log(self.factor_max))))
            events.append(SlowdownEvent(rank, factor, start, start + length))
            starts.append(start)
            cursor = start + length
        self._episodes[rank] = (events, starts, rng, cursor)
        return events

    def factor(self, rank: int, step: int) -> float:
        if step < 0:
            return 1.0
        events = self.episodes(rank, step)
        i = bisect.bisect_right(self._episodes[rank][1], step) - 1  # episodes do not overlap: the last one started
        return events[i].factor if i >= 0 and events[i].active(rank, step) else 1.0

    def events_until(self, world_size: int, steps: int) -> List[SlowdownEvent]:
        """Every episode that starts before ``steps`` (for the summary and for tests)."""
        return [e for rank in range(world_size) for e in self.episodes(rank, steps) if e.start_step < steps]

    def describe(self) -> dict:
        return {"scenario": self.scenario, "seed": self.seed, "tail_index": self.tail_index, "gap_min": self.gap_min,
                "duration_range": [self.duration_min, self.duration_max],
                "factor_range": [self.factor_min, self.factor_max]}


def added_delay_s(factor: float, measured_compute_s: float, device_ms_per_sample: float, samples: int) -> float:
    """Sleep that turns a step into one on a device ``factor`` times slower.

    Real compute is slowed by sleeping (factor - 1) x its measured time; emulated device time is
    ``device_ms_per_sample`` per sample, scaled by the factor.
    """
    return max(0.0, factor - 1.0) * max(0.0, measured_compute_s) + factor * device_ms_per_sample * samples / 1000.0
