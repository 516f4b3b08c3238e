"""What is simulated: workers, their compute times per step, the run's length and its sync points.

Compute time of rank r at its step s with local batch b (seconds)::

    compute(r, s, b) = factor(r, s) * jitter(r, s) * (overhead_s + per_sample_s * b)

``factor`` comes from a straggler schedule of ``policies/injection.py`` (the same classes, built from
the same dict the Hydra ``conf/straggler/*.yaml`` files produce), so a simulated worker is slowed
exactly when the real injector would slow it. Like the injector, the factor scales the whole step
(the injector sleeps (f-1) x the real compute plus f x the emulated device time). ``jitter`` is
lognormal with mean 1 and coefficient of variation ``jitter_cv`` (0: none), drawn per (rank, step)
from ``seed``. ``loop_overhead_s`` is paid once per step by every worker and is not slowed by the factor
(framework and Python time outside forward/backward, and validation amortised per step when a
workload is calibrated from a measured run).

The step index s is the rank's position in the run (batches since the start): the strategies count
passed-over batches in ``steps_done`` too, so the injector's schedule is indexed the same way.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Union

import numpy as np

from lightning_straggler.policies import injection as inj

ScheduleLike = Union[inj.StragglerSchedule, Mapping[str, Any], None]


class MatrixSchedule(inj.StragglerSchedule):
    """Factors given as a [rank, step] matrix, e.g. measured compute times relative to a full-speed step
    (``lightning_straggler.advise`` replays a run from its ``step_times.csv.gz`` this way). Steps past the
    matrix take its last column; ranks past it run at 1.0."""

    scenario = "measured"

    def __init__(self, matrix) -> None:
        m = np.asarray(matrix, dtype=float)
        if m.ndim != 2 or m.shape[1] < 1 or not np.all(np.isfinite(m)) or np.any(m <= 0):
            raise ValueError(f"a factor matrix must be 2-D [rank, step] with finite factors > 0 (shape {m.shape})")
        self.matrix = m

    def factor(self, rank: int, step: int) -> float:
        if rank >= self.matrix.shape[0] or step < 0:
            return 1.0
        return float(self.matrix[rank, min(step, self.matrix.shape[1] - 1)])

    def describe(self) -> dict:
        return {"scenario": self.scenario, "shape": list(self.matrix.shape)}


def schedule_from_config(straggler: ScheduleLike) -> inj.StragglerSchedule:
    """A schedule object from a ``straggler`` config dict (``conf/straggler/*.yaml``, or the
    ``config.straggler`` of a summary.json), or the object itself. Built by the project's own
    ``StragglerConfig.schedule()`` so the mapping from config to schedule is not duplicated."""
    if straggler is None:
        return inj.StragglerSchedule()
    if isinstance(straggler, inj.StragglerSchedule):
        return straggler
    from lightning_straggler.config import SlowdownEventConfig, StragglerConfig

    known = set(StragglerConfig.__dataclass_fields__)
    kwargs = {k: v for k, v in dict(straggler).items() if k in known}
    kwargs["events"] = [SlowdownEventConfig(**dict(e)) for e in kwargs.get("events", [])]
    kwargs["factors"] = [float(f) for f in kwargs.get("factors", [])]
    return StragglerConfig(**kwargs).schedule()


def factor_matrix(schedule: inj.StragglerSchedule, world_size: int, steps: int) -> np.ndarray:
    """``F[r, s] = schedule.factor(r, s)`` for every rank and step, computed in bulk.

    Static and transient schedules and the random and trace schedules' own events (``events_until``,
    drawn by the schedule's seeded generators) are laid onto the matrix directly; any other schedule is
    asked step by step. Overlapping events take the largest factor, as ``factor`` does.
    """
    out = np.ones((world_size, steps))
    if type(schedule) is inj.StragglerSchedule:
        return out
    if isinstance(schedule, MatrixSchedule):
        m = schedule.matrix
        k, cols = min(world_size, m.shape[0]), min(steps, m.shape[1])
        out[:k, :cols] = m[:k, :cols]
        out[:k, cols:] = m[:k, -1:]
        return out
    if isinstance(schedule, inj.StaticSchedule):
        k = min(world_size, len(schedule.factors))
        out[:k, :] = np.asarray(schedule.factors[:k], dtype=float)[:, None]
        return out
    if isinstance(schedule, (inj.TransientSchedule, inj.RandomSchedule, inj.TraceSchedule)):
        events = schedule.events if isinstance(schedule, inj.TransientSchedule) else schedule.events_until(world_size, steps)
        for e in events:
            if 0 <= e.rank < world_size:
                end = steps if e.end_step is None else min(steps, e.end_step)
                start = max(0, e.start_step)
                if start < end:
                    np.maximum(out[e.rank, start:end], e.factor, out=out[e.rank, start:end])
        return out
    for r in range(world_size):
        for s in range(steps):
            out[r, s] = schedule.factor(r, s)
    return out


@dataclass
class Workload:
    world_size: int
    batch_per_worker: int
    per_sample_s: float  # compute per sample on a full-speed worker
    steps: int  # batches (positions) in the run, counted on the full-speed group
    grad_bytes: float  # gradient size = parameter size, bytes
    overhead_s: float = 0.0  # fixed compute per step, slowed by the factor like the samples
    loop_overhead_s: float = 0.0  # per step, not slowed (framework, amortised validation)
    state_bytes: float | None = None  # parameters + optimizer state broadcast at merges (default 2 x grad: SGD momentum)
    straggler: ScheduleLike = None
    jitter_cv: float = 0.0
    seed: int = 0
    steps_per_epoch: int = 0  # 0 = one epoch; epoch ends are sync points (dssync, dpar, awar)
    val_every_steps: int = 0  # 0 = no validation; validations are sync points too
    skip_batch_s: float = 0.0  # cost of passing over one batch (an excluded worker catching up)
    boundary_bytes: float = 64.0  # per-rank payload of a boundary's statistics all-gather (5 float64 = 40 B, padded)
    state_tensors: int = 1  # tensors in the module's state_dict: dpar's state broadcast sends each separately
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("world_size", "batch_per_worker", "steps"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        for name in ("per_sample_s", "overhead_s", "loop_overhead_s", "grad_bytes", "jitter_cv", "skip_batch_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (got {value!r})")
        if not isinstance(self.state_tensors, (int, np.integer)) or self.state_tensors < 1:
            raise ValueError(f"state_tensors must be an integer >= 1 (got {self.state_tensors!r})")
        if self.per_sample_s == 0 and self.overhead_s == 0:
            raise ValueError("per_sample_s and overhead_s cannot both be 0 (a step would take no time)")
        self.schedule = schedule_from_config(self.straggler)

    @property
    def model_state_bytes(self) -> float:
        return 2.0 * self.grad_bytes if self.state_bytes is None else float(self.state_bytes)

    @property
    def optimizer_state_bytes(self) -> float:
        """What ``optimizer.state_dict()`` pickles (momentum buffers: the state beyond the parameters)."""
        return max(0.0, self.model_state_bytes - self.grad_bytes)

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_per_worker

    @cached_property
    def factors(self) -> np.ndarray:
        """[rank, step] slowdown factors (one column past the end for workers that run ahead)."""
        return factor_matrix(self.schedule, self.world_size, self.steps + 1)

    @cached_property
    def jitter(self) -> np.ndarray:
        shape = (self.world_size, self.steps + 1)
        if self.jitter_cv <= 0:
            return np.ones(shape)
        sigma = math.sqrt(math.log1p(self.jitter_cv ** 2))
        rng = np.random.default_rng([self.seed, 7919])
        return np.exp(rng.standard_normal(shape) * sigma - sigma ** 2 / 2)

    def base_step_s(self, batch) -> Any:
        """Compute of one step at full speed without jitter."""
        return self.overhead_s + self.per_sample_s * np.asarray(batch, dtype=float)

    def compute_s(self, ranks, steps, batch=None) -> np.ndarray:
        """Compute seconds of ``ranks`` at ``steps`` (broadcastable index arrays) with local batch ``batch``."""
        b = self.batch_per_worker if batch is None else batch
        return self.factors[ranks, steps] * self.jitter[ranks, steps] * self.base_step_s(b)

    def rates(self) -> np.ndarray:
        """Each worker's own sample rate over the run, alone (no communication): samples per second."""
        per_step = self.factors[:, :self.steps] * self.jitter[:, :self.steps] * self.base_step_s(self.batch_per_worker)
        per_step = per_step + self.loop_overhead_s
        return self.batch_per_worker * self.steps / per_step.sum(axis=1)

    def _in_epoch(self, position: int) -> int:
        return position % self.steps_per_epoch + 1 if self.steps_per_epoch > 0 else position + 1

    def last_of_epoch(self, position: int) -> bool:
        return self.steps_per_epoch > 0 and self._in_epoch(position) == self.steps_per_epoch

    def validation_follows(self, position: int) -> bool:
        return self.val_every_steps > 0 and self._in_epoch(position) % self.val_every_steps == 0

    def is_sync_point(self, position: int) -> bool:
        """Epoch ends, validations and the last step: where dssync, dpar and awar synchronise everyone."""
        return position + 1 >= self.steps or self.last_of_epoch(position) or self.validation_follows(position)
