"""Per-step timing records and the arithmetic that summarises them (no Horovod, no Lightning).

A rank records, for every optimizer step: when it started, its *compute* time (batch start until its
gradients are ready, before any collective; emulated device time included), the time it spent inside
the step's collectives, the samples it processed and the group it synchronised with.

Waiting is separated from communication after gathering: in a group all-reduce the member that
arrives last blocks only for the transfer itself, so for every member
``wait = comm - min(comm over the group in that step)`` and ``comm - wait`` is the transfer time.
Groups of one step are told apart by their smallest rank (groups of one step are disjoint).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

# Column order of the packed tensor exchanged between ranks.
COLUMNS = ("rank", "step", "start_s", "compute_s", "comm_s", "samples", "group_leader")


@dataclass
class StepRecord:
    rank: int
    step: int
    start_s: float  # wall-clock time.time() at batch start
    compute_s: float
    comm_s: float
    samples: int
    group_leader: int  # smallest rank of the group synchronised with (own rank when alone)

    def as_row(self) -> List[float]:
        return [float(getattr(self, c)) for c in COLUMNS]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> "StepRecord":
        r = dict(zip(COLUMNS, row))
        return cls(int(r["rank"]), int(r["step"]), float(r["start_s"]), float(r["compute_s"]),
                   float(r["comm_s"]), int(r["samples"]), int(r["group_leader"]))


class StepRecorder:
    """Collects this rank's step records; the strategy marks the phases, policies read the numbers."""

    def __init__(self, rank: int = 0, clock=time.perf_counter, wall=time.time) -> None:
        self.rank = rank
        self._clock = clock
        self._wall = wall
        self.records: List[StepRecord] = []
        self._sent = 0
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._t0: Optional[float] = None
        self._wall0 = 0.0
        self._compute_end: Optional[float] = None
        self._comm = 0.0
        self._samples = 0

    def begin_batch(self, samples: int) -> None:
        """Called at every batch start; with gradient accumulation a step spans several batches."""
        if self._t0 is None:
            self._t0 = self._clock()
            self._wall0 = self._wall()
        self._samples += int(samples)

    def mark_compute_end(self) -> None:
        self._compute_end = self._clock()

    def samples_of_current_step(self) -> int:
        return self._samples

    def compute_of_current_step(self) -> float:
        """Compute time of the step in flight, up to :meth:`mark_compute_end` (or now)."""
        end = self._compute_end if self._compute_end is not None else self._clock()
        return end - self._t0 if self._t0 is not None else 0.0

    def add_comm(self, seconds: float) -> None:
        self._comm += float(seconds)

    def end_step(self, step: int, group_leader: Optional[int] = None) -> Optional[StepRecord]:
        if self._t0 is None:
            return None
        compute_end = self._compute_end if self._compute_end is not None else self._clock()
        record = StepRecord(self.rank, int(step), self._wall0, compute_end - self._t0, self._comm,
                            self._samples, self.rank if group_leader is None else int(group_leader))
        self.records.append(record)
        self._reset_pending()
        return record

    def discard_step(self) -> None:
        """Forget the step in progress (a batch the strategy skipped without computing)."""
        self._reset_pending()

    def take_unsent(self) -> List[StepRecord]:
        out = self.records[self._sent:]
        self._sent = len(self.records)
        return out

    def recent_compute(self, n: int) -> List[float]:
        return [r.compute_s for r in self.records[-n:]]


def split_wait(records: Iterable[StepRecord]) -> Dict[tuple, float]:
    """Wait time for each (rank, step): time in the collective beyond the group's fastest member."""
    groups: Dict[tuple, List[StepRecord]] = defaultdict(list)
    for r in records:
        groups[(r.step, r.group_leader)].append(r)
    wait = {}
    for members in groups.values():
        floor = min(m.comm_s for m in members)
        for m in members:
            wait[(m.rank, m.step)] = m.comm_s - floor
    return wait


STEP_TIMES_FILE = "step_times.csv.gz"


def write_step_times(records: Sequence[StepRecord], path: str) -> str:
    """Every record, one CSV row each (the columns of ``COLUMNS``; ``start_s`` relative to the first
    step), gzipped: about 10 bytes per record. What ``lightning_straggler.advise`` replays."""
    import gzip

    origin = min((r.start_s for r in records), default=0.0)
    with gzip.open(path, "wt", newline="") as f:
        f.write(",".join(COLUMNS) + "\n")
        for r in sorted(records, key=lambda r: (r.rank, r.step)):
            f.write(f"{r.rank},{r.step},{r.start_s - origin:.4f},{r.compute_s:.6f},{r.comm_s:.6f},"
                    f"{r.samples},{r.group_leader}\n")
    return path


def read_step_times(path: str) -> List[StepRecord]:
    """The records written by :func:`write_step_times`."""
    import csv
    import gzip

    with gzip.open(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    if not rows or tuple(rows[0]) != COLUMNS:
        raise ValueError(f"{path}: not a step-times file (expected the header {','.join(COLUMNS)})")
    return [StepRecord.from_row([float(x) for x in row]) for row in rows[1:] if row]


def _stats(values: Sequence[float]) -> dict:
    if len(values) == 0:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "total": 0.0}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p95": float(np.percentile(a, 95)), "total": float(a.sum())}


@dataclass
class RankSummary:
    rank: int
    steps: int
    samples: int
    compute_s: dict = field(default_factory=dict)
    comm_s: dict = field(default_factory=dict)
    wait_s: dict = field(default_factory=dict)


def summarise(records: Sequence[StepRecord]) -> Dict[int, dict]:
    """Per-rank mean/p50/p95/total of compute, communication (transfer only) and wait seconds."""
    wait = split_wait(records)
    by_rank: Dict[int, List[StepRecord]] = defaultdict(list)
    for r in records:
        by_rank[r.rank].append(r)
    out = {}
    for rank in sorted(by_rank):
        rs = by_rank[rank]
        waits = [wait[(r.rank, r.step)] for r in rs]
        out[rank] = asdict(RankSummary(
            rank=rank, steps=len(rs), samples=int(sum(r.samples for r in rs)),
            compute_s=_stats([r.compute_s for r in rs]),
            comm_s=_stats([r.comm_s - w for r, w in zip(rs, waits)]),
            wait_s=_stats(waits)))
    return out


def format_table(per_rank: Dict[int, dict]) -> str:
    """A console table: one row per rank, milliseconds."""
    head = f"{'rank':>4} {'steps':>6} {'samples':>8} {'compute ms p50/p95':>19} {'comm ms p50/p95':>16} {'wait ms p50/p95':>16} {'wait %':>7}"
    lines = [head, "-" * len(head)]
    for rank, s in sorted(per_rank.items(), key=lambda kv: int(kv[0])):
        busy = s["compute_s"]["total"] + s["comm_s"]["total"] + s["wait_s"]["total"]
        wait_pct = 100.0 * s["wait_s"]["total"] / busy if busy > 0 else 0.0
        lines.append(
            f"{int(rank):>4} {s['steps']:>6} {s['samples']:>8} "
            f"{1e3 * s['compute_s']['p50']:>9.1f}/{1e3 * s['compute_s']['p95']:<9.1f}"
            f"{1e3 * s['comm_s']['p50']:>8.1f}/{1e3 * s['comm_s']['p95']:<7.1f}"
            f"{1e3 * s['wait_s']['p50']:>8.1f}/{1e3 * s['wait_s']['p95']:<7.1f}{wait_pct:>7.1f}")
    return "\n".join(lines)


def plot_timeline(records: Sequence[StepRecord], path: str, title: str = "") -> str:
    """Per-rank timeline of compute / communication / wait as a PNG (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wait = split_wait(records)
    ranks = sorted({r.rank for r in records})
    origin = min((r.start_s for r in records), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * max(1, len(ranks))))
    colors = {"compute": "#4c72b0", "comm": "#55a868", "wait": "#c44e52"}
    for r in records:
        w = wait[(r.rank, r.step)]
        x = r.start_s - origin
        y = ranks.index(r.rank)
        for phase, dur in (("compute", r.compute_s), ("wait", w), ("comm", max(0.0, r.comm_s - w))):
            if dur > 0:
                ax.broken_barh([(x, dur)], (y - 0.35, 0.7), color=colors[phase], linewidth=0)
            x += dur
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds since first step")
    ax.set_title(title or "per-rank timeline")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", ncol=3, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor."""
    from torch import Tensor  # here: the step arithmetic below needs no torch

    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = batch_size_of(item)
            if n:
                return n
    return 0
