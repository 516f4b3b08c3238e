"""``StragglerInjector``: makes ranks slow on a schedule, and optionally emulates device time.

The delay is a sleep inserted after backward and before any collective, so the profiler counts it as
compute. A slowdown factor f adds (f - 1) x the rank's measured compute of that batch; with
``device_ms_per_sample`` every batch also takes f x that many milliseconds per sample, so several
workers sharing two CPU cores behave like accelerators of known relative speed.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from lightning.pytorch import Callback

from lightning_straggler.policies.injection import StragglerSchedule, added_delay_s
from lightning_straggler.profiling import batch_size_of


class StragglerInjector(Callback):
    def __init__(self, schedule: Optional[StragglerSchedule] = None, device_ms_per_sample: float = 0.0) -> None:
        if device_ms_per_sample < 0:
            raise ValueError(f"device_ms_per_sample must be >= 0 (got {device_ms_per_sample})")
        self.schedule = schedule or StragglerSchedule()
        self.device_ms_per_sample = float(device_ms_per_sample)
        self.slowdown_s = 0.0  # sleep added by slowdown factors on this rank
        self.device_s = 0.0  # emulated device time on this rank
        self.longest_s = 0.0  # this rank's longest batch, from its compute's start to the end of its sleep
        self._t0 = 0.0
        self._samples = 0
        self._step = 0
        self._delayed = False

    @staticmethod
    def _rank_step(trainer):
        steps = getattr(trainer.strategy, "steps_done", None)
        return trainer.global_rank, (trainer.global_step if steps is None else steps)

    def on_train_start(self, trainer, pl_module) -> None:
        # ddp (lightning_straggler.ddp_baseline): its gradient all-reduce runs inside backward, so the delay
        # goes where the first gradient bucket is ready, still before any collective
        register = getattr(trainer.strategy, "register_pre_sync", None)
        if register is not None:
            register(lambda: self._delay(trainer))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()
        self._samples = batch_size_of(batch)
        self._delayed = False

    def on_after_backward(self, trainer, pl_module) -> None:
        self._delay(trainer)

    def _delay(self, trainer) -> None:
        if self._delayed:  # once per batch (ddp: already in its gradient hook)
            return
        self._delayed = True
        skip = getattr(trainer.strategy, "skip_this_batch", None)
        if skip is not None and skip():
            return  # a batch the strategy passed over without computing takes no device time
        rank, step = self._rank_step(trainer)
        factor = self.schedule.factor(rank, step)
        # Lightning calls the strategy's batch-start hook after the callbacks': dpar/awar boundaries (joins,
        # exchanges, a hold for the group) run there and are waiting, not this rank's compute to stretch
        started = max(self._t0, getattr(trainer.strategy, "batch_compute_started", 0.0))
        measured = time.perf_counter() - started
        delay = added_delay_s(factor, measured, self.device_ms_per_sample, self._samples)
        if delay > 0:
            time.sleep(delay)
            device = factor * self.device_ms_per_sample * self._samples / 1000.0
            self.device_s += device
            self.slowdown_s += delay - device
        self.longest_s = max(self.longest_s, time.perf_counter() - started)

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        mine = torch.tensor([[float(trainer.global_rank), self.slowdown_s, self.device_s, self.longest_s]],
                            dtype=torch.float64)
        comm = getattr(strategy, "comm", None)
        every = comm.allgather(mine, tag="injector") if comm is not None and comm.initialized else mine
        if trainer.global_rank != 0:
            return
        report = getattr(strategy, "run_report", None)
        if report is None:
            return
        where = ("when DDP's first gradient bucket is ready (backward's compute done, before its all-reduce)"
                 if hasattr(strategy, "register_pre_sync") else "after backward")
        report["emulated"] = {
            "schedule": self.schedule.describe(),
            "slowdown": f"sleep of (factor - 1) x the rank's measured compute of each batch, {where}",
            "device_ms_per_sample": self.device_ms_per_sample,
            "device_time": (f"sleep of factor x device_ms_per_sample per sample, {where}"
                            if self.device_ms_per_sample > 0 else "none: real CPU compute only"),
            "per_rank_seconds": {str(int(r)): {"slowdown_s": s, "device_s": d, "longest_batch_s": longest}
                                 for r, s, d, longest in every.tolist()},
        }
