"""Dataclass schemas behind ``conf/`` and the checks that run before any worker starts.

``load_config`` merges a Hydra/OmegaConf config into the schemas (unknown keys and wrong types are
rejected by OmegaConf) and then checks ranges; every error names the setting and what is allowed.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Type

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_straggler.policies.awar import AwarThresholds as _AWAR  # pure policies: no torch, no Lightning
from lightning_straggler.policies.dpar import DparThresholds as _DPAR
from lightning_straggler.policies.boundary import DEFAULT_REACT_STEPS
from lightning_straggler.policies.adaptive import DEFAULT_HISTORY_STEPS as _ADAPTIVE_HISTORY_STEPS
from lightning_straggler.policies.adaptive import DEFAULT_REACT_RATIO as _ADAPTIVE_REACT_RATIO
from lightning_straggler.policies.adaptive import DEFAULT_REACT_STEPS as _ADAPTIVE_REACT_STEPS
from lightning_straggler.policies.deadline import DEFAULT_FACTOR as _DEADLINE_FACTOR
from lightning_straggler.policies.deadline import DEFAULT_HISTORY_STEPS as _DEADLINE_HISTORY_STEPS


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range. The message names it and the allowed values."""


def _finite(x: Any) -> bool:
    """A real number that is neither NaN nor infinite (a factor of inf would make a worker sleep forever)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


SEED_RANGE = f"an integer in 0..{2 ** 32 - 1}"  # numpy's and Lightning's seed range


def _seed_ok(seed: Any) -> bool:
    return isinstance(seed, int) and 0 <= seed < 2 ** 32


def _check(ok: bool, setting: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{setting} must be {allowed} (got {value!r})")


# --- algorithms ---------------------------------------------------------------------------------
@dataclass
class RingConfig:
    name: str = "ring"

    def validate(self, world_size: int) -> None:
        pass


DSSYNC_SYNC_MODES = ("params", "grads")
DSSYNC_EXCHANGES = ("sets", "aligned", "alltoall", "direct")


@dataclass
class DSSyncConfig:
    name: str = "dssync"
    group_size: int = 2
    schedule: str = "butterfly"  # butterfly | random
    num_partitions: Optional[int] = None  # random: partitions in the cycle (default 4); butterfly: derived
    seed: int = 0
    sync: str = "params"  # params (the paper's code) | grads
    global_every_steps: int = 0  # average over all workers every N steps (0 = off)
    global_at_epoch_end: bool = True
    exchange: str = "sets"  # sets (a process set per group) | aligned (the same, started together) | alltoall

    def validate(self, world_size: int) -> None:
        from lightning_straggler.policies.dssync import KINDS, DSSyncSchedule

        _check(1 <= self.group_size <= world_size, "algorithm.group_size", f"in 1..{world_size} (trainer.devices={world_size}, the number of workers)", self.group_size)
        _check(self.schedule in KINDS, "algorithm.schedule", f"one of {', '.join(KINDS)}", self.schedule)
        _check(self.sync in DSSYNC_SYNC_MODES, "algorithm.sync", f"one of {', '.join(DSSYNC_SYNC_MODES)}", self.sync)
        _check(self.exchange in DSSYNC_EXCHANGES, "algorithm.exchange", f"one of {', '.join(DSSYNC_EXCHANGES)}",
               self.exchange)
        _check(self.global_every_steps >= 0, "algorithm.global_every_steps", ">= 0 (0 = off)", self.global_every_steps)
        _check(_seed_ok(self.seed), "algorithm.seed", SEED_RANGE, self.seed)
        try:
            DSSyncSchedule(world_size, self.group_size, self.schedule, self.num_partitions, self.seed)
        except ValueError as e:
            raise ConfigError(f"algorithm.{e}") from None


@dataclass
class BoaConfig:
    name: str = "boa"
    global_batch: int = 0  # 0 = workers x data.batch_size
    min_local_batch: int = 1
    max_local_batch: int = 0  # memory cap per worker (0 = none)
    window_steps: int = 10  # steps between profile gathers / re-planning (0 = never re-plan)
    rebalance_gain: float = 0.05  # re-plan only when the predicted step time improves by more than this
    tune_workers: bool = False  # drop workers that cost more than they add
    history_windows: int = 3  # windows of measurements the time models are fitted on
    initial_batch_sizes: Optional[List[int]] = None  # default: the global batch split evenly
    seed: int = 0  # the shared per-epoch permutation

    def validate(self, world_size: int) -> None:
        _check(self.min_local_batch >= 1, "algorithm.min_local_batch", ">= 1", self.min_local_batch)
        _check(self.max_local_batch == 0 or self.max_local_batch >= self.min_local_batch, "algorithm.max_local_batch",
               f"0 (no cap) or >= min_local_batch ({self.min_local_batch})", self.max_local_batch)
        low = world_size * self.min_local_batch
        high = world_size * self.max_local_batch if self.max_local_batch else None
        _check(self.global_batch >= low and (high is None or self.global_batch <= high), "algorithm.global_batch",
               f"in {low}..{high if high else 'inf'} (trainer.devices={world_size} workers x "
               f"[algorithm.min_local_batch={self.min_local_batch}, "
               f"algorithm.max_local_batch={self.max_local_batch or 'no cap'}])",
               self.global_batch)
        _check(self.window_steps >= 0, "algorithm.window_steps", ">= 0 (0 = never re-plan)", self.window_steps)
        _check(_finite(self.rebalance_gain) and self.rebalance_gain >= 0, "algorithm.rebalance_gain", "a finite number >= 0",
               self.rebalance_gain)
        _check(self.history_windows >= 1, "algorithm.history_windows", ">= 1", self.history_windows)
        _check(_seed_ok(self.seed), "algorithm.seed", SEED_RANGE, self.seed)
        if self.initial_batch_sizes is not None:
            sizes = self.initial_batch_sizes
            _check(len(sizes) == world_size and all(b >= 0 for b in sizes) and sum(sizes) == self.global_batch,
                   "algorithm.initial_batch_sizes",
                   f"null or {world_size} sizes >= 0 summing to global_batch ({self.global_batch})", sizes)


@dataclass
class AdaptiveConfig:
    name: str = "adaptive"
    # what adaptive adds (policies/adaptive.py; defaults there)
    react_steps: int = _ADAPTIVE_REACT_STEPS  # re-plan after a worker's speed changed for this many steps in a row
    react_ratio: float = _ADAPTIVE_REACT_RATIO  # ... by this factor (slower or faster than its own recent speed)
    history_steps: int = _ADAPTIVE_HISTORY_STEPS  # per-step points per worker the time models are fitted on
    # the step deadline (policies/deadline.py): a step closes without a rank later than factor x the step period
    deadline_factor: float = _DEADLINE_FACTOR  # 0 = no deadline (every step waits for every rank)
    deadline_history_steps: int = _DEADLINE_HISTORY_STEPS  # steps the period's median is taken over
    # BOA's settings (as BoaConfig; worker-set tuning on: a collapsed worker gets no samples)
    global_batch: int = 0
    min_local_batch: int = 1
    max_local_batch: int = 0
    window_steps: int = 10  # also re-plan every N steps (0 = only on speed changes)
    rebalance_gain: float = 0.05
    tune_workers: bool = True
    initial_batch_sizes: Optional[List[int]] = None
    seed: int = 0

    def validate(self, world_size: int) -> None:
        from lightning_straggler.policies.adaptive import check_settings
        from lightning_straggler.policies.deadline import check_settings as check_deadline

        try:
            check_settings(self.react_steps, self.react_ratio, self.history_steps)
            check_deadline(self.deadline_factor, self.deadline_history_steps)
        except ValueError as e:
            raise ConfigError(f"algorithm.{e}") from None
        boa = {f.name: getattr(self, f.name) for f in fields(BoaConfig) if f.name != "name" and hasattr(self, f.name)}
        BoaConfig(**boa).validate(world_size)


def _check_react_steps(value) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, "algorithm.react_steps",
           "an integer >= 0 (0 = decide only at window ends)", value)


@dataclass
class DparConfig:
    name: str = "dpar"
    window_steps: int = 20  # steps between decision boundaries
    react_steps: int = DEFAULT_REACT_STEPS  # nobody excluded: decide early after this many slow steps in a row (0 = off)
    # the thresholds' defaults are the policy's own (policies/dpar.py DparThresholds): one source
    slow_ratio: float = _DPAR.slow_ratio  # exclude when a worker's window median >= slow_ratio x the group's ...
    strikeout_ratio: float = _DPAR.strikeout_ratio  # strike out when >= strikeout_ratio x the group's ...
    strikeout_windows: int = _DPAR.strikeout_windows  # ... for this many consecutive windows
    readmit_ratio: float = _DPAR.readmit_ratio  # re-admit when <= readmit_ratio x the group's ...
    readmit_windows: int = _DPAR.readmit_windows  # ... for this many consecutive windows
    min_active: int = _DPAR.min_active  # never fewer active workers (0 = half, rounded up)
    data_penalty: float = _DPAR.data_penalty  # cost of omitting a worker's data shard, as a fraction of a worker-step
    scale_lr: bool = False  # scale the learning rate with the active count
    reshard: bool = False  # active workers take over excluded workers' shards from the next epoch

    def validate(self, world_size: int) -> None:
        from lightning_straggler.policies.dpar import DparThresholds

        _check(self.window_steps >= 1, "algorithm.window_steps", ">= 1", self.window_steps)
        _check_react_steps(self.react_steps)
        try:
            DparThresholds(self.slow_ratio, self.strikeout_ratio, self.strikeout_windows, self.readmit_ratio,
                           self.readmit_windows, self.min_active, self.data_penalty).validate(world_size)
        except ValueError as e:
            raise ConfigError(f"algorithm.{e}") from None


@dataclass
class AwarConfig:
    name: str = "awar"
    period_steps: int = 20  # also merge every N steps (0 = only at epoch ends, validation and the end)
    react_steps: int = DEFAULT_REACT_STEPS  # nobody outside: decide early after this many slow steps in a row (0 = off)
    # the thresholds' defaults are the policy's own (policies/awar.py AwarThresholds): one source
    slow_ratio: float = _AWAR.slow_ratio  # straggler when its median compute >= slow_ratio x the group's
    recover_ratio: float = _AWAR.recover_ratio  # rejoins the group when <= recover_ratio x the group's
    min_group: int = _AWAR.min_group  # never fewer in the synchronous group (0 = half, rounded up)
    weighting: str = "updates"  # updates (the thesis) | samples

    def validate(self, world_size: int) -> None:
        from lightning_straggler.policies.awar import WEIGHTINGS, AwarThresholds

        _check(self.period_steps >= 0, "algorithm.period_steps", ">= 0 (0 = only at epoch ends)", self.period_steps)
        _check_react_steps(self.react_steps)
        _check(self.weighting in WEIGHTINGS, "algorithm.weighting", f"one of {', '.join(WEIGHTINGS)}", self.weighting)
        try:
            AwarThresholds(self.slow_ratio, self.recover_ratio, self.min_group).validate(world_size)
        except ValueError as e:
            raise ConfigError(f"algorithm.{e}") from None


@dataclass
class DDPConfig:
    """Lightning's own DDPStrategy over torch.distributed (lightning_straggler.ddp_baseline): the baseline."""

    name: str = "ddp"
    model_averaging_period: int = 0  # 0 = plain DDP; N >= 1: post-local SGD, parameters averaged every N steps
    warmup_steps: int = 0  # post-local SGD only: steps of plain gradient all-reduce before local SGD starts

    def validate(self, world_size: int) -> None:
        _check(isinstance(self.model_averaging_period, int) and self.model_averaging_period >= 0,
               "algorithm.model_averaging_period", ">= 0 (0 = off: plain DDP)", self.model_averaging_period)
        _check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "algorithm.warmup_steps", ">= 0",
               self.warmup_steps)
        _check(self.warmup_steps == 0 or self.model_averaging_period > 0, "algorithm.warmup_steps",
               "0 unless algorithm.model_averaging_period > 0 (it is the warm-up of post-local SGD)", self.warmup_steps)


# name -> schema; later algorithms add their entry here and a strategy in strategies/ (ddp: ddp_baseline.py).
ALGORITHM_SCHEMAS: Dict[str, Type] = {"ring": RingConfig, "dssync": DSSyncConfig, "boa": BoaConfig,
                                      "dpar": DparConfig, "awar": AwarConfig, "adaptive": AdaptiveConfig,
                                      "ddp": DDPConfig}


# --- straggler scenarios ----------------------------------------------------------------------
SCENARIOS = ("none", "static", "transient", "random", "trace")


@dataclass
class SlowdownEventConfig:
    rank: int = 0
    factor: float = 2.0
    start_step: int = 0
    end_step: Optional[int] = None


@dataclass
class StragglerConfig:
    scenario: str = "none"
    factors: List[float] = field(default_factory=list)  # static
    events: List[SlowdownEventConfig] = field(default_factory=list)  # transient
    seed: int = 0  # random, trace
    probability: float = 0.1  # random
    factor_min: float = 2.0  # random, trace
    factor_max: float = 4.0  # random, trace
    duration_min: int = 10  # random, trace (an episode's minimum, the Pareto scale)
    duration_max: int = 40  # random, trace (the cap)
    window_steps: int = 20  # random
    gap_min: int = 100  # trace: minimum steps between episodes (the gaps' Pareto scale)
    tail_index: float = 1.5  # trace: Pareto tail index of gaps and episodes (smaller = heavier tail)
    device_ms_per_sample: float = 0.0  # emulated accelerator time per sample (scaled by the factor)

    def validate(self, world_size: int) -> None:
        _check(self.scenario in SCENARIOS, "straggler.scenario", f"one of {', '.join(SCENARIOS)}", self.scenario)
        _check(_finite(self.device_ms_per_sample) and self.device_ms_per_sample >= 0, "straggler.device_ms_per_sample",
               "a finite number >= 0", self.device_ms_per_sample)
        if self.scenario == "static":
            _check(len(self.factors) > 0, "straggler.factors", "a non-empty list of per-rank factors for scenario=static", self.factors)
            _check(len(self.factors) <= world_size, "straggler.factors",
                   f"at most one factor per worker ({world_size} workers)", self.factors)
            for i, f in enumerate(self.factors):
                _check(_finite(f) and f >= 1.0, f"straggler.factors[{i}]", "a finite number >= 1.0 (a slowdown factor)", f)
        if self.scenario == "transient":
            _check(len(self.events) > 0, "straggler.events", "a non-empty list of {rank, factor, start_step, end_step} for scenario=transient", self.events)
            for i, e in enumerate(self.events):
                _check(0 <= e.rank < world_size, f"straggler.events[{i}].rank", f"a worker rank in 0..{world_size - 1}", e.rank)
                _check(_finite(e.factor) and e.factor >= 1.0, f"straggler.events[{i}].factor", "a finite number >= 1.0",
                       e.factor)
                _check(e.start_step >= 0, f"straggler.events[{i}].start_step", ">= 0", e.start_step)
                _check(e.end_step is None or e.end_step > e.start_step, f"straggler.events[{i}].end_step",
                       f"> start_step ({e.start_step}) or null", e.end_step)
            _check(len({e.rank for e in self.events}) <= world_size, "straggler.events",
                   f"events for at most {world_size} distinct ranks", len({e.rank for e in self.events}))
        if self.scenario == "random":
            _check(0.0 <= self.probability <= 1.0, "straggler.probability", "in [0, 1]", self.probability)
            _check(self.factor_min >= 1.0, "straggler.factor_min", ">= 1.0", self.factor_min)
        if self.scenario == "trace":
            _check(_finite(self.factor_min) and self.factor_min >= 1.0, "straggler.factor_min", "a finite number >= 1.0",
                   self.factor_min)
        if self.scenario in ("random", "trace"):  # both draw episodes: factors, seed, durations
            _check(_finite(self.factor_max) and self.factor_max >= self.factor_min, "straggler.factor_max",
                   f"a finite number >= factor_min ({self.factor_min})", self.factor_max)
            _check(_seed_ok(self.seed), "straggler.seed", SEED_RANGE, self.seed)
            _check(self.duration_min >= 1, "straggler.duration_min", ">= 1 step", self.duration_min)
            _check(self.duration_max >= self.duration_min, "straggler.duration_max", f">= duration_min ({self.duration_min})", self.duration_max)
        if self.scenario == "random":
            _check(self.window_steps >= 1, "straggler.window_steps", ">= 1 step", self.window_steps)
        if self.scenario == "trace":
            _check(self.gap_min >= 1, "straggler.gap_min", ">= 1 step", self.gap_min)
            _check(_finite(self.tail_index) and 0.5 <= self.tail_index <= 10, "straggler.tail_index",
                   "a number in [0.5, 10] (Pareto tail index; smaller = heavier tail)", self.tail_index)

    def schedule(self):
        from lightning_straggler.policies import injection as inj

        if self.scenario == "static":
            return inj.StaticSchedule(self.factors)
        if self.scenario == "transient":
            return inj.TransientSchedule([inj.SlowdownEvent(e.rank, e.factor, e.start_step, e.end_step) for e in self.events])
        if self.scenario == "random":
            return inj.RandomSchedule(self.seed, self.probability, self.factor_min, self.factor_max,
                                      self.duration_min, self.duration_max, self.window_steps)
        if self.scenario == "trace":
            return inj.TraceSchedule(self.seed, self.tail_index, self.gap_min, self.duration_min, self.duration_max,
                                     self.factor_min, self.factor_max)
        return inj.StragglerSchedule()


# --- model, data, trainer, profiler -----------------------------------------------------------
@dataclass
class ModelConfig:
    name: str = "mlp"
    hidden: List[int] = field(default_factory=lambda: [256, 256])
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0

    def validate(self) -> None:
        _check(self.name in ("mlp", "cnn"), "model.name", "one of mlp, cnn", self.name)
        _check(self.optimizer in ("sgd", "adam"), "model.optimizer", "one of sgd, adam", self.optimizer)
        _check(_finite(self.lr) and self.lr > 0, "model.lr", "a finite number > 0", self.lr)
        _check(0.0 <= self.momentum < 1.0, "model.momentum", "in [0, 1)", self.momentum)
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, "model.weight_decay", "a finite number >= 0",
               self.weight_decay)
        _check(all(h >= 1 for h in self.hidden), "model.hidden", "a list of positive layer widths", self.hidden)


@dataclass
class DataConfig:
    name: str = "mnist1d"
    num_samples: int = 10000  # generated samples, 80% train / 20% validation
    batch_size: int = 32  # per worker
    seed: int = 42
    features: int = 40  # synthetic only
    classes: int = 10  # synthetic only
    cache_dir: Optional[str] = None  # default ~/.cache/lightning-straggler/data

    def validate(self) -> None:
        _check(self.name in ("mnist1d", "synthetic"), "data.name", "one of mnist1d, synthetic", self.name)
        _check(self.num_samples >= 10, "data.num_samples", ">= 10", self.num_samples)
        _check(self.batch_size >= 1, "data.batch_size", ">= 1", self.batch_size)
        _check(_seed_ok(self.seed), "data.seed", SEED_RANGE, self.seed)
        _check(self.features >= 1, "data.features", ">= 1", self.features)
        _check(self.classes >= 2, "data.classes", ">= 2", self.classes)


def max_local_workers() -> int:
    """How many worker processes a local launch may start: 8 per core unless LS_MAX_LOCAL_WORKERS says."""
    return int(os.environ.get("LS_MAX_LOCAL_WORKERS", 8 * (os.cpu_count() or 1)))


# Horovod counts stall time in whole seconds; below 2 s a busy but healthy rank can look stalled.
STALL_TIMEOUT_RANGE = (2.0, 86400.0)
NONFINITE_POLICIES = ("error", "skip")  # the strategies import these from here (this module needs no torch)
RANK_STATES = ("gathered", "files")  # where a checkpoint keeps each rank's own state (trainer.rank_states)


def check_stall_timeout(stall_timeout_s: float) -> None:
    """The strategies' constructor check of ``stall_timeout_s`` (``trainer.stall_timeout_s`` in a config)."""
    low, high = STALL_TIMEOUT_RANGE
    if not (isinstance(stall_timeout_s, (int, float)) and low <= stall_timeout_s <= high):
        raise ValueError(f"stall_timeout_s must be in [{low:g}, {high:g}] seconds (got {stall_timeout_s!r})")


# Horovod's background cycle (HOROVOD_CYCLE_TIME, milliseconds; Horovod's default is 1).
CYCLE_TIME_RANGE = (0.1, 1000.0)


def check_cycle_time(cycle_time_ms: Optional[float]) -> None:
    """The strategies' constructor check of ``horovod_cycle_time_ms`` (``trainer.horovod_cycle_time_ms``)."""
    low, high = CYCLE_TIME_RANGE
    if cycle_time_ms is not None and not (_finite(cycle_time_ms) and low <= cycle_time_ms <= high):
        raise ValueError(f"horovod_cycle_time_ms must be None or in [{low:g}, {high:g}] milliseconds "
                         f"(got {cycle_time_ms!r})")


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    devices: int = 4
    max_epochs: int = 4
    max_steps: int = -1
    val_check_interval: float = 0.5
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    gradient_clip_val: Optional[float] = None
    stall_timeout_s: float = 300.0  # a collective some ranks never join ends the job after this long
    job_timeout_s: float = 0.0  # wall-clock limit for the whole job, restarts included (0 = none)
    checkpoint_every_n_steps: int = 0  # also write last.ckpt every N optimizer steps (0 = epoch ends only)
    restart_on_failure: int = 0  # restart from last.ckpt without the dead workers, up to N times
    nonfinite: str = "error"  # a non-finite loss or gradient on a rank: error (stop, naming the rank) | skip (the step)
    horovod_cycle_time_ms: Optional[float] = None  # Horovod's coordination cycle for started workers (None: its own)
    rank_states: str = "gathered"  # each rank's own state in a checkpoint: gathered (into it) | files (beside it)

    def validate(self) -> None:
        _check(self.accelerator in ("cpu", "gpu", "cuda"), "trainer.accelerator", "one of cpu, gpu, cuda", self.accelerator)
        limit = max_local_workers()
        _check(1 <= self.devices <= limit, "trainer.devices",
               f"in 1..{limit} (local worker processes; set LS_MAX_LOCAL_WORKERS to change the limit)", self.devices)
        if self.accelerator in ("gpu", "cuda"):
            import torch

            have = torch.cuda.device_count()
            _check(self.devices <= have, "trainer.devices", f"<= {have} (CUDA devices visible)", self.devices)
        _check(self.max_epochs >= 1, "trainer.max_epochs", ">= 1", self.max_epochs)
        _check(self.max_steps == -1 or self.max_steps >= 1, "trainer.max_steps", "-1 (no limit) or >= 1", self.max_steps)
        _check(0 < self.val_check_interval <= 1.0 or float(self.val_check_interval).is_integer(),
               "trainer.val_check_interval", "a fraction in (0, 1] or a whole number of steps", self.val_check_interval)
        _check(self.log_every_n_steps >= 1, "trainer.log_every_n_steps", ">= 1", self.log_every_n_steps)
        _check(STALL_TIMEOUT_RANGE[0] <= self.stall_timeout_s <= STALL_TIMEOUT_RANGE[1], "trainer.stall_timeout_s",
               "in [%g, %g] seconds" % STALL_TIMEOUT_RANGE, self.stall_timeout_s)
        _check(self.horovod_cycle_time_ms is None or (_finite(self.horovod_cycle_time_ms) and CYCLE_TIME_RANGE[0]
               <= self.horovod_cycle_time_ms <= CYCLE_TIME_RANGE[1]), "trainer.horovod_cycle_time_ms",
               "null (Horovod's own, 1 ms) or in [%g, %g] milliseconds" % CYCLE_TIME_RANGE, self.horovod_cycle_time_ms)
        _check(self.job_timeout_s == 0 or self.job_timeout_s >= 10, "trainer.job_timeout_s",
               "0 (no limit) or >= 10 seconds", self.job_timeout_s)
        _check(self.checkpoint_every_n_steps >= 0, "trainer.checkpoint_every_n_steps", ">= 0 (0 = epoch ends only)",
               self.checkpoint_every_n_steps)
        _check(0 <= self.restart_on_failure <= self.devices - 1, "trainer.restart_on_failure",
               f"in 0..{self.devices - 1} (each restart goes on without at least one of the {self.devices} workers)",
               self.restart_on_failure)
        _check(self.nonfinite in NONFINITE_POLICIES, "trainer.nonfinite", f"one of {', '.join(NONFINITE_POLICIES)}",
               self.nonfinite)
        _check(self.rank_states in RANK_STATES, "trainer.rank_states", f"one of {', '.join(RANK_STATES)}",
               self.rank_states)
        _check(self.gradient_clip_val is None or (_finite(self.gradient_clip_val) and self.gradient_clip_val >= 0),
               "trainer.gradient_clip_val", "null (no clipping) or a finite number >= 0", self.gradient_clip_val)


@dataclass
class ProfilerConfig:
    gather_every_n_steps: int = 25
    plot: bool = True

    def validate(self) -> None:
        _check(self.gather_every_n_steps >= 1, "profiler.gather_every_n_steps", ">= 1", self.gather_every_n_steps)


@dataclass
class TrainConfig:
    algorithm: Any = field(default_factory=lambda: {"name": "ring"})
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    seed: int = 0
    target_acc: float = 0.5  # as conf/train.yaml
    output_dir: Optional[str] = None  # default: Hydra's run directory, else the working directory
    advise: bool = False  # print the advisor's recommendation at the end (python -m lightning_straggler.advise)

    def validate(self) -> None:
        self.model.validate()
        self.data.validate()
        self.trainer.validate()
        self.profiler.validate()
        self.straggler.validate(self.trainer.devices)
        if getattr(self.algorithm, "global_batch", None) == 0:  # boa: default global batch
            self.algorithm.global_batch = self.trainer.devices * self.data.batch_size
        self.algorithm.validate(self.trainer.devices)
        if self.algorithm.name == "ddp":
            _check(self.trainer.restart_on_failure == 0, "trainer.restart_on_failure",
                   "0 with algorithm=ddp (restarts are implemented for the Horovod strategies only)",
                   self.trainer.restart_on_failure)
        _check(0.0 <= self.target_acc <= 1.0, "target_acc", "in [0, 1]", self.target_acc)
        _check(_seed_ok(self.seed), "seed", SEED_RANGE, self.seed)


def _merge(schema: Type, cfg: Any, prefix: str):
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg if cfg is not None else {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        if not key:  # OmegaConf did not say which key: find it, one key at a time, into nested groups
            path, node = [], cfg
            while isinstance(node, dict):
                for k, v in node.items():
                    probe: Any = {k: v}
                    for outer in reversed(path):
                        probe = {outer: probe}
                    try:
                        OmegaConf.merge(OmegaConf.structured(schema), probe)
                    except OmegaConfBaseException:
                        path.append(str(k))
                        node = v
                        break
                else:
                    break
            key = ".".join(path)
        # the whole config's keys are named as the user writes them (straggler.factors, seed), a group's
        # with the group (algorithm.initial_batch_sizes)
        where = (key or prefix) if not key or prefix == "config" or key.startswith(prefix) else f"{prefix}.{key}"
        allowed = ", ".join(f.name for f in fields(schema))
        if getattr(e, "object_type", None) is SlowdownEventConfig and not key.startswith("straggler"):
            # OmegaConf names a key inside a list item without the list: say which list it is
            where, prefix = f"straggler.events[].{key}", "straggler.events[]"
            allowed = ", ".join(f.name for f in fields(SlowdownEventConfig))
        raise ConfigError(f"{where}: {e.msg if hasattr(e, 'msg') else e} (settings of {prefix}: {allowed})") from None


def load_config(cfg: Any) -> TrainConfig:
    """Validated :class:`TrainConfig` from a Hydra ``DictConfig``, a dict or a ``TrainConfig``."""
    if isinstance(cfg, TrainConfig):
        cfg = OmegaConf.structured(cfg)
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg.pop("hydra", None)
    algorithm = cfg.pop("algorithm", None) or {"name": "ring"}
    name = algorithm.get("name") if isinstance(algorithm, dict) else algorithm
    if not isinstance(name, str) or name not in ALGORITHM_SCHEMAS:
        raise ConfigError(f"algorithm.name must be one of {', '.join(sorted(ALGORITHM_SCHEMAS))} (got {name!r})")
    base = _merge(TrainConfig, cfg, "config")
    base.algorithm = _merge(ALGORITHM_SCHEMAS[name], algorithm if isinstance(algorithm, dict) else {"name": name}, "algorithm")
    base.validate()
    return base


# --- Hydra structured configs -----------------------------------------------------------------
# Each option file in conf/<group>/ starts from its group's schema (``defaults: [_schema, _self_]``),
# so every option has every key of the schema and Hydra rejects unknown keys and wrong types early.
GROUP_SCHEMAS: Dict[str, Type] = {
    "straggler": StragglerConfig, "model": ModelConfig, "data": DataConfig, "trainer": TrainerConfig,
}


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name="_schema", node=schema)
    for name, schema in ALGORITHM_SCHEMAS.items():
        cs.store(group="algorithm", name=f"_{name}_schema", node=schema)


register_configs()  # at import, as Hydra structured configs expect
