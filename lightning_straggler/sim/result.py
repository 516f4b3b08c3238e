"""The record of one simulated run, and the ideal it is measured against.

Throughput counts only samples whose gradients reach the model, as the real ``summary.json``
``train_samples`` does (a DPAR worker's discarded local steps and BOA placeholders do not count;
an AWAR straggler's local steps do, they enter the weighted average; a backup worker's late
gradient does not).

Ideal: ``lightning_straggler.ideal.ideal_throughput``, the one definition the benchmarks use too, with
the workload's own rates (each worker alone) and the network model's all-reduce::

    rate_i = batch_per_worker * steps / sum_s (compute(i, s) + loop_overhead_s)
    ideal  = G / (G / sum_i rate_i + allreduce_s(N, grad_bytes)),   G = N * batch_per_worker

    efficiency = throughput / ideal

Asynchronous SGD pays no all-reduce and can exceed 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lightning_straggler.ideal import ideal_throughput as project_ideal
from lightning_straggler.sim.network import Network
from lightning_straggler.sim.workload import Workload


def ideal_throughput(workload: Workload, network: Network) -> float:
    """The project's ideal (lightning_straggler.ideal) for a simulated workload on a network model."""
    return project_ideal(workload.rates(), workload.global_batch,
                         network.allreduce_s(workload.world_size, workload.grad_bytes))


@dataclass
class SimResult:
    algorithm: str
    world_size: int
    network: str
    wall_s: float
    train_samples: float
    step_times_s: np.ndarray  # time between consecutive steps of the synchronous group (or mean per worker step)
    ideal_samples_per_s: float
    per_rank_steps: list[int] = field(default_factory=list)  # steps each rank computed
    step_samples: np.ndarray | None = None  # counted samples per entry of step_times_s (default: even split)
    events: list[dict] = field(default_factory=list)
    notes: str = ""
    rank_step_end_s: np.ndarray | None = None  # [steps, ranks]: when each rank finished each step (where recorded)

    @property
    def throughput_samples_per_s(self) -> float:
        return self.train_samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def efficiency(self) -> float:
        return self.throughput_samples_per_s / self.ideal_samples_per_s if self.ideal_samples_per_s > 0 else 0.0

    def tail_throughput(self, fraction: float = 0.5) -> float:
        """Throughput over the last ``fraction`` of the steps: the steady state, without the first
        detection / profiling windows that a short simulated run over-weights."""
        st = np.asarray(self.step_times_s, dtype=float)
        if st.size == 0:
            return 0.0
        per_step = (np.full(st.size, self.train_samples / st.size) if self.step_samples is None
                    else np.asarray(self.step_samples, dtype=float))
        k = int(st.size * (1.0 - fraction))
        return float(per_step[k:].sum() / st[k:].sum()) if st[k:].sum() > 0 else 0.0

    def summary(self) -> dict:
        st = np.asarray(self.step_times_s, dtype=float)
        return {
            "algorithm": self.algorithm, "world_size": self.world_size, "network": self.network,
            "wall_s": self.wall_s, "train_samples": self.train_samples,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "ideal_samples_per_s": self.ideal_samples_per_s, "efficiency": self.efficiency,
            "tail_samples_per_s": self.tail_throughput(),
            "tail_efficiency": self.tail_throughput() / self.ideal_samples_per_s if self.ideal_samples_per_s > 0 else 0.0,
            "step_s": {"mean": float(st.mean()) if st.size else 0.0,
                       "p50": float(np.percentile(st, 50)) if st.size else 0.0,
                       "p95": float(np.percentile(st, 95)) if st.size else 0.0},
            "events": len(self.events), "notes": self.notes,
        }
