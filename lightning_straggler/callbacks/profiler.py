"""``WorkerProfiler``: per-rank compute / communication / wait / samples, gathered to rank 0.

The strategy records every step (``strategy.recorder``); this callback ships the new records to rank 0
every ``gather_every_n_steps`` optimizer steps in one named all-gather, logs per-rank means through
Lightning's loggers, and at the end prints a per-rank table, draws a timeline PNG and puts the summary
in the strategy's run report (which ``summary.json`` is built from).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional

import torch
from lightning.pytorch import Callback

from lightning_straggler.profiling import (
    COLUMNS,
    STEP_TIMES_FILE,
    StepRecord,
    format_table,
    plot_timeline,
    split_wait,
    summarise,
    write_step_times,
)

log = logging.getLogger(__name__)


class WorkerProfiler(Callback):
    def __init__(self, gather_every_n_steps: int = 25, output_dir: Optional[str] = None, plot: bool = True,
                 monitor: str = "val_acc", print_table: bool = True) -> None:
        if gather_every_n_steps < 1:
            raise ValueError(f"gather_every_n_steps must be >= 1 (got {gather_every_n_steps})")
        self.gather_every_n_steps = gather_every_n_steps
        self.output_dir = output_dir
        self.plot = plot
        self.monitor = monitor
        self.print_table = print_table
        self.records: List[StepRecord] = []  # everyone's records, on rank 0
        self.val_history: List[Dict[str, float]] = []
        self._train_start = 0.0
        self._gathered_at = 0

    @staticmethod
    def _strategy(trainer):
        from lightning_straggler.strategies.horovod_base import HorovodStrategy

        strategy = trainer.strategy
        # a Horovod strategy, or one with the same recorder / gather clock / collectives (ddp_baseline)
        if not isinstance(strategy, HorovodStrategy) and not all(
                hasattr(strategy, a) for a in ("recorder", "comm", "profile_gather_due", "profile_clock", "run_report")):
            raise TypeError(f"WorkerProfiler needs a lightning_straggler strategy, not {type(strategy).__name__}")
        return strategy

    def on_train_start(self, trainer, pl_module) -> None:
        self._strategy(trainer)
        self._train_start = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = self._strategy(trainer)
        if strategy.profile_gather_due(self._gathered_at, self.gather_every_n_steps):
            self._gather(trainer, strategy)

    def _gather(self, trainer, strategy) -> List[StepRecord]:
        """All ranks call this at the same step counts; rank 0 keeps everyone's new records."""
        self._gathered_at = strategy.profile_clock()
        mine = strategy.recorder.take_unsent()
        rows = torch.tensor([r.as_row() for r in mine], dtype=torch.float64).reshape(len(mine), len(COLUMNS))
        every = strategy.comm.allgather(rows, tag="profile")
        if trainer.global_rank != 0:
            return []
        new = [StepRecord.from_row(row) for row in every.tolist()]
        self.records.extend(new)
        if trainer.logger is not None and new:
            self._log_window(trainer, new)
        return new

    def _log_window(self, trainer, new: List[StepRecord]) -> None:
        wait = split_wait(self.records)
        metrics: Dict[str, float] = {}
        for rank in sorted({r.rank for r in new}):
            mine = [r for r in new if r.rank == rank]
            n = len(mine)
            w = [wait.get((r.rank, r.step), 0.0) for r in mine]
            metrics[f"profile/rank{rank}_compute_ms"] = 1e3 * sum(r.compute_s for r in mine) / n
            metrics[f"profile/rank{rank}_comm_ms"] = 1e3 * sum(r.comm_s - x for r, x in zip(mine, w)) / n
            metrics[f"profile/rank{rank}_wait_ms"] = 1e3 * sum(w) / n
        trainer.logger.log_metrics(metrics, step=trainer.global_step)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self.val_history.append({"elapsed_s": time.time() - self._train_start,
                                     "step": int(trainer.global_step), self.monitor: float(value)})

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = self._strategy(trainer)
        self._gather(trainer, strategy)
        if trainer.global_rank != 0:
            return
        train_time = time.time() - self._train_start
        per_rank = summarise(self.records)
        report: Dict[str, Any] = {
            "train_time_s": train_time,
            "per_rank": {str(k): v for k, v in per_rank.items()},
            "val_history": list(self.val_history),
            "timeline_png": None,
            "step_times": None,
        }
        out = self.output_dir or trainer.default_root_dir
        if self.records:  # every rank's every step, for the advisor (lightning_straggler.advise)
            os.makedirs(out, exist_ok=True)
            report["step_times"] = write_step_times(self.records, os.path.join(out, STEP_TIMES_FILE))
        if self.plot and self.records:
            os.makedirs(out, exist_ok=True)
            report["timeline_png"] = plot_timeline(
                self.records, os.path.join(out, "timeline.png"),
                title=f"{strategy.strategy_name}: per-rank compute / wait / communication")
        strategy.run_report["profile"] = report
        if self.print_table:
            print(f"\nPer-rank profile ({strategy.strategy_name}, {len(per_rank)} workers, {train_time:.1f} s of training):")
            print(format_table(per_rank), flush=True)
