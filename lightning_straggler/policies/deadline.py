"""``adaptive``'s step deadline: when a step closes without a late worker, and how the arrived gradients
are weighted. Pure decision logic (no torch, no Horovod); the strategy and the simulator call it.

The rule (new here; the idea of closing a collective with the contributions that have arrived is
eager-SGD's partial collectives, Li et al., PPoPP 2020):
* the step period P = the median, over the last ``history_steps`` steps, of the time between the
  closings of consecutive steps' all-reduces (every rank sees the same closings, a collective ends
  everywhere at once); no deadline before ``MIN_HISTORY`` periods have been seen;
* a step stays open for a rank until ``factor`` x P after the group's last collective ended (the previous
  step's all-reduce, or whatever came after it: a validation, a re-plan); a rank that has not handed its
  gradients in by then is cut from the step: its helper thread hands in zeros for it, so no one waits
  for it. A rank already past its deadline when it starts a step (it is behind) is cut at once and skips
  the step's compute: it catches up instead of staying a step late;
* the step's gradient is the sum of the arrived ranks' gradients weighted by their samples, over the
  arrived samples: with every rank on time exactly BOA's weights (b_i / B, a single-process step on the
  global batch); with ranks cut, B / (sum of the arrived b_i) times BOA's weighted sum;
* a late rank's own gradient of that step is dropped, not applied a step later: eager-SGD found that
  stale gradients added to the next step slow convergence unless they are rare, and dropping keeps every
  rank's parameters and optimizer state identical (each applies the same update). The drops are counted
  in the run's summary.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

DEFAULT_FACTOR = 0.0  # off: see README (adaptive) for what it cost and gained here; 3 is the measured setting
DEFAULT_HISTORY_STEPS = 20
MIN_HISTORY = 5
MIN_DEADLINE_S = 0.005  # below this the helper thread's wake-up jitter is the deadline


class StepDeadline:
    """The step period from the closings of recent steps, and the deadline it gives."""

    def __init__(self, factor: float = DEFAULT_FACTOR, history_steps: int = DEFAULT_HISTORY_STEPS) -> None:
        check_settings(factor, history_steps)
        self.factor, self.history_steps = float(factor), int(history_steps)
        self.periods_s: list[float] = []

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def observe(self, period_s: float) -> None:
        """Seconds between the closings of the previous step's all-reduce and this one's."""
        self.periods_s = (self.periods_s + [float(period_s)])[-self.history_steps:]

    def seconds(self) -> float | None:
        """How long after the group's last collective a step stays open (None: no deadline yet, or disabled)."""
        if not self.enabled or len(self.periods_s) < MIN_HISTORY:
            return None
        return max(MIN_DEADLINE_S, self.factor * statistics.median(self.periods_s))

    def to_dict(self) -> dict:
        return {"periods_s": list(self.periods_s)}

    def restore(self, saved: dict) -> None:
        self.periods_s = [float(x) for x in saved["periods_s"]][-self.history_steps:]


def arrived_scale(batch_sizes: Sequence[int], arrived: Sequence[bool]) -> float | None:
    """What BOA's weighted gradient sum (weights b_i / B over every rank) is multiplied by when only the
    ``arrived`` ranks contributed: B / sum of their b_i (1.0 when all arrived); None when no samples
    arrived (the step changes nothing)."""
    total = sum(int(b) for b in batch_sizes)
    got = sum(int(b) for b, a in zip(batch_sizes, arrived) if a)
    if got <= 0:
        return None
    return 1.0 if got == total else total / got


def check_settings(factor, history_steps) -> None:
    """Messages name each setting (config.py prefixes ``algorithm.``)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor != factor or \
            not (factor == 0 or 1 < factor <= 1000):
        raise ValueError(f"deadline_factor must be 0 (no deadline) or a number in (1, 1000] (got {factor!r})")
    if not isinstance(history_steps, int) or isinstance(history_steps, bool) or history_steps < MIN_HISTORY:
        raise ValueError(f"deadline_history_steps must be an integer >= {MIN_HISTORY} (got {history_steps!r})")
